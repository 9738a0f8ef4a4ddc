"""The package's layers: building blocks below the trainer, recipes above it.

Proves, from the source alone (every import statement, including those inside
functions): every top-level module and package has a layer (``LAYERS``) and
a line in docs/architecture.md's source map; each imports only lower layers,
so building blocks import no trainer, recipe, tool or entry point, the plain
recipes no SimpleFSDP recipe, and the planner and the rehearsal not each
other; no two modules import each other, however indirectly or lazily;
``models/`` holds only recipe modules; and no package code builds a path
under the checkout's ``tests/`` (an installed wheel has none).

Tier: fast.

Run: .venv/bin/python -m pytest tests/test_layers.py -q
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_neuron"
ROOT = "torchtitan_neuron"

# Every top-level module and package, by layer. An entry imports only entries
# of lower layers, so nothing runs back up, and the two tools on layer 7 (the
# planner and the rehearsal) stand on ``tracing`` without importing each
# other. A new top-level file fails test_every_module_has_a_layer until it
# is placed here and in docs/architecture.md's source map.
LAYERS = {
    # what everything builds on
    "config_utils": 0, "devices": 0,
    # building blocks
    "checkpoint": 1, "components": 1, "cpu_twins": 1, "data": 1,
    "memory_accounting": 1, "seeded_init": 1,
    "hf": 2, "run_report": 2, "validation": 2,
    # the trainers and the checks before any rank
    "preflight": 3, "trainer": 3,
    # recipes: plain, then SimpleFSDP's jit path
    "models": 4,
    "experiments": 5,
    # the tools: what both stand on, then each
    "tracing": 6,
    "plan": 7, "rehearse": 7,
    # entry points
    "launch": 8, "train": 8,
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


def _top_level_entries() -> set[str]:
    return {_layer(_module_name(p)) for p in _sources()} - {""}


def test_every_module_has_a_layer():
    unplaced = _top_level_entries() - set(LAYERS)
    assert not unplaced, (
        f"top-level modules with no layer: {sorted(unplaced)}; place each in "
        "LAYERS here and in docs/architecture.md's source map"
    )
    assert not set(LAYERS) - _top_level_entries(), "LAYERS names a module that is gone"


def test_imports_never_run_back_up_or_sideways():
    bad = []
    for path in _sources():
        importer = _layer(_module_name(path))
        if not importer:
            continue
        for module in sorted(imports(path)):
            imported = _layer(module)
            if imported and imported != importer and LAYERS[imported] >= LAYERS[importer]:
                way = "sideways" if LAYERS[imported] == LAYERS[importer] else "back up"
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module} ({way}: "
                           f"layer {LAYERS[importer]} -> {LAYERS[imported]})")
    assert not bad, "imports that run back up or sideways:\n" + "\n".join(bad)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, lazy imports included; a
    module that imports ``a.b.c`` also runs ``a`` and ``a.b``."""
    modules = {_module_name(p): p for p in _sources()}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module in imports(path):
            parts = module.split(".")
            for k in range(2, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in modules and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import each other, lazily or not: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _source_map() -> str:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text[text.index("## Source layout"):]
    block = block[block.index("```"):]
    return block[: block.index("```", 3)]


def _map_name(path: Path) -> str | None:
    """How the source map names a file: a module by its file name, a
    package (and a recipe package's config_registry.py) by its folder."""
    rel = path.relative_to(PACKAGE)
    if path.name in ("__init__.py", "__main__.py", "config_registry.py"):
        return f"{rel.parent.name}/" if rel.parent.parts else None
    return path.name


def test_the_source_map_names_every_module():
    block = _source_map()
    missing = sorted({str(p.relative_to(PACKAGE)) for p in _sources()
                      if (name := _map_name(p))
                      and not re.search(rf"(^|[\s,/]){re.escape(name)}", block)})
    assert not missing, f"docs/architecture.md's source map leaves out {missing}"
    gone = [entry for entry in sorted(set(re.findall(r"[\w]+\.py", block)))
            if not any(p.name == entry for p in _sources())
            and not (PACKAGE.parent / "scripts" / entry).exists()]
    assert not gone, f"docs/architecture.md's source map names files that are gone: {gone}"


def test_the_import_parser_sees_each_form():
    # The layering check is only as good as the parser: check it on the forms
    # the package uses (relative, from-package-import-module, in a function).
    trainer = imports(PACKAGE / "trainer.py")
    assert {"torchtitan_neuron.components.documents", "torchtitan_neuron.devices"} <= trainer
    registry = imports(PACKAGE / "models" / "llama3" / "config_registry.py")
    assert "torchtitan_neuron.models.llama3" in registry  # ``from . import model_registry``
    assert "torchtitan_neuron.trainer" in registry


def test_models_holds_recipes_and_each_family_its_own_code():
    # models/<family>/ holds the family's recipes (__init__, config_registry)
    # and the model code only that family uses, as upstream's models/<family>/;
    # shared building blocks live in components/, which imports no family.
    models = PACKAGE / "models"
    files = {p.relative_to(models).as_posix() for p in models.rglob("*.py")
             if "__pycache__" not in p.parts}
    families = {f.split("/")[0] for f in files if "/" in f}
    assert families, "no recipe packages under models/"
    top = {f for f in files if "/" not in f}
    assert top == {"__init__.py", "recipes.py"}, (
        f"models/ holds the family packages and recipes.py only: {sorted(top)}")
    missing = [f"{name}/{leaf}" for name in sorted(families)
               for leaf in ("__init__.py", "config_registry.py")
               if f"{name}/{leaf}" not in files]
    assert not missing, f"a family package without its recipes: {missing}"
    for path in _sources():
        name = _module_name(path)
        family = name.split(".")[2] if name.startswith(ROOT + ".models.") else None
        for module in imports(path):
            if module.startswith(ROOT + ".models.") and module != ROOT + ".models.recipes":
                other = module.split(".")[2]
                assert other == family or not name.startswith(ROOT + ".models."), (
                    f"{name} imports {module}: one family's code does not use another's")


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


def _docstrings(tree) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _scripts_named(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value[:80]!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and re.search(r"(^|[\s`'\"])scripts/", node.value)]


def test_no_package_message_names_a_file_the_wheel_does_not_ship():
    # scripts/ stays in the checkout; a message sends the user to a command
    # the package ships (python -m torchtitan_neuron.hf ..., .plan, ...).
    found = [hit for path in _sources() for hit in _scripts_named(path)]
    assert not found, "package messages naming scripts/:\n" + "\n".join(found)


def test_the_scripts_check_sees_a_message_not_a_docstring(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Run scripts/x.py."""\nraise SystemExit("use scripts/x.py")\n')
    assert len(_scripts_named(module, root=tmp_path)) == 1
