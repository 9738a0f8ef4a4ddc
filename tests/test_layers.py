"""The package's layers: building blocks below the trainer, recipes above it.

Proves, from the source alone (every import statement, including those inside
functions): ``components/`` and the other foundation modules import no
trainer, recipe, planner or entry point; ``trainer.py`` imports no recipe;
the plain recipes in ``models/`` import no SimpleFSDP recipe; ``models/``
holds only recipe modules; and no package code builds a path under the
checkout's ``tests/`` (an installed wheel has none).

Tier: fast.

Run: .venv/bin/python -m pytest tests/test_layers.py -q
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_neuron"
ROOT = "torchtitan_neuron"

# Modules that everything else builds on. A new one belongs here when it
# needs nothing above it.
FOUNDATIONS = (
    "activation_checkpoint", "checkpoint", "components", "config_utils", "data",
    "devices", "init", "memory",
)
ABOVE_FOUNDATIONS = ("experiments", "launch", "models", "plan", "preflight", "train", "trainer")
# importer -> what it must not import
FORBIDDEN = {
    **{name: ABOVE_FOUNDATIONS for name in FOUNDATIONS},
    "trainer": ("experiments", "models"),
    "models": ("experiments",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _exists(module: str) -> bool:
    base = PACKAGE.parent.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """Every torchtitan_neuron module ``path`` imports, resolved to absolute names."""
    name = _module_name(path)
    package = name if _is_package(path) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                # ``from pkg import mod`` imports the module pkg.mod.
                full = f"{base}.{alias.name}"
                found.add(full if _exists(full) else base)
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".")}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_never_run_back_up():
    sources = _sources()
    assert any(_layer(_module_name(p)) == "components" for p in sources)
    bad = []
    for path in sources:
        forbidden = FORBIDDEN.get(_layer(_module_name(path)), ())
        for module in sorted(imports(path)):
            if _layer(module) in forbidden:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not bad, "imports that run back up a layer:\n" + "\n".join(bad)


def test_the_import_parser_sees_each_form():
    # The layering check is only as good as the parser: check it on the forms
    # the package uses (relative, from-package-import-module, in a function).
    trainer = imports(PACKAGE / "trainer.py")
    assert {"torchtitan_neuron.components.documents", "torchtitan_neuron.devices"} <= trainer
    registry = imports(PACKAGE / "models" / "llama3" / "config_registry.py")
    assert "torchtitan_neuron.models.llama3" in registry  # ``from . import model_registry``
    assert "torchtitan_neuron.trainer" in registry


def test_models_holds_only_recipe_modules():
    models = PACKAGE / "models"
    files = {p.relative_to(models).as_posix() for p in models.rglob("*.py")
             if "__pycache__" not in p.parts}
    packages = {f.split("/")[0] for f in files if "/" in f}
    assert packages, "no recipe packages under models/"
    expected = {"__init__.py", "recipes.py"} | {
        f"{name}/{leaf}" for name in packages for leaf in ("__init__.py", "config_registry.py")
    }
    assert files == expected, (
        "models/ holds recipes only; move building blocks to components/: "
        f"{sorted(files ^ expected)}"
    )


# "./tests/assets/tokenizer" is a recipe's default --hf_assets_path: a path on
# the command line, relative to where the user launches (the tutorial's), not
# a file the package reads from its own checkout.
_USER_FACING_DEFAULT = "./tests/assets/tokenizer"
_TESTS_PATH = re.compile(r"(^|[/\\])tests([/\\]|$)")


def _paths_under_tests(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = {
        id(node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "hf_assets_path" for t in node.targets)
        and isinstance(node.value, ast.Constant) and node.value.value == _USER_FACING_DEFAULT
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        text = node.value
        # Prose (messages, docstrings) has spaces; a path segment does not.
        if id(node) in allowed or any(c.isspace() for c in text):
            continue
        if _TESTS_PATH.search(text):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_package_builds_no_path_under_tests():
    found = [hit for path in _sources() for hit in _paths_under_tests(path)]
    assert not found, (
        "package code must not read the checkout's tests/ (an installed wheel "
        "has none):\n" + "\n".join(found)
    )


@pytest.mark.parametrize("source, hits", [
    ('p = Path(__file__).parents[1] / "tests" / "assets"\n', 1),
    ('p = os.path.join(root, "tests/assets")\n', 1),
    ('config.hf_assets_path = "./tests/assets/tokenizer"\n', 0),
    ('raise ValueError("see ./tests/assets/tokenizer for one")\n', 0),
    ('other = "./tests/assets/tokenizer"\n', 1),
])
def test_tests_path_check_catches_path_building(tmp_path, source, hits):
    module = tmp_path / "m.py"
    module.write_text(source)
    assert len(_paths_under_tests(module, root=tmp_path)) == hits
