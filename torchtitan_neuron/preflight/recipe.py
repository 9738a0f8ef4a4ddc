"""The recipe a run names: MODULE imports and has CONFIG; otherwise the
message says which module has it, or the import error that hides it
(torchtitan 0.3.0 turns it into "Available config functions: []").
"""

from __future__ import annotations

import difflib
import importlib
import sys
import traceback

from torchtitan_neuron.preflight.errors import PreflightError

# The recipe modules this package ships, searched when a recipe is not where
# MODULE says.
RECIPE_MODULES = (
    "torchtitan_neuron.experiments.graph_trainer.llama3",
    "torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
    "torchtitan_neuron.models.llama3",
    "torchtitan_neuron.models.qwen3",
    "torchtitan_neuron.models.deepseek_v3",
    "torchtitan_neuron.experiments.graph_trainer.gpt_oss",
    "torchtitan_neuron.models.gpt_oss",
)



def _is_missing(exc: ModuleNotFoundError, candidate: str) -> bool:
    """Whether ``exc`` says ``candidate`` itself (or a package above it) does
    not exist, as opposed to something it imports."""
    missing = exc.name or ""
    return candidate == missing or candidate.startswith(missing + ".")


def _import_error(candidate: str, exc: BaseException) -> PreflightError:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "importlib" not in f.filename), None)
    at = f" ({where.filename}:{where.lineno})" if where else ""
    # The module that failed: the first package on the path that did not
    # finish importing (MODULE itself when "MODULE.config_registry" was tried).
    parts = candidate.split(".")
    failed = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                   if ".".join(parts[:i]) not in sys.modules), candidate)
    return PreflightError(
        f"MODULE={failed} failed to import: {type(exc).__name__}: {exc}{at}. "
        "Fix that import (a missing package: pip install it into the same "
        "environment) and launch again."
    )


def _candidates(module_name: str) -> list[str]:
    """The import paths torchtitan's ConfigManager tries, in its order."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module_name in _supported_models | _supported_experiments:
        return [f"{prefix}.{module_name}.config_registry" for prefix in
                ("torchtitan.models", "torchtitan.experiments",
                 "torchtitan.experiments.rl.examples")]
    return [f"{module_name}.config_registry", module_name]


def _import_recipe_module(module_name: str):
    for candidate in _candidates(module_name):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            if _is_missing(exc, candidate):
                continue
            raise _import_error(candidate, exc) from None
        except Exception as exc:  # ImportError, SyntaxError, anything it raised
            raise _import_error(candidate, exc) from None
    return None


def _modules_with(config_name: str, skip: str) -> list[str]:
    found = []
    for name in RECIPE_MODULES:
        if name == skip:
            continue
        module = _import_recipe_module(name)
        if module is not None and callable(getattr(module, config_name, None)):
            found.append(name)
    return found


def _recipes(module) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_") and n[0].islower()
                  and callable(getattr(module, n)))


def check_recipe(module_name: str, config_name: str) -> None:
    """MODULE imports and has CONFIG; otherwise say where CONFIG is."""
    module = _import_recipe_module(module_name)
    if module is not None and callable(getattr(module, config_name, None)):
        return
    homes = _modules_with(config_name, skip=module_name)
    where = (f"MODULE={module_name} cannot be imported" if module is None
             else f"CONFIG={config_name} is not a recipe of MODULE={module_name}")
    if homes:
        raise PreflightError(
            f"{where}. {config_name} is in {homes[0]}: set "
            f"MODULE={homes[0]} (MODULE takes the fully qualified path; a short "
            "name such as llama3 resolves to torchtitan's own registry, which has "
            "no SimpleFSDP recipes)."
        )
    if module is None:
        raise PreflightError(
            f"{where}. Recipe modules in this package: {', '.join(RECIPE_MODULES)}."
        )
    close = difflib.get_close_matches(config_name, _recipes(module), n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise PreflightError(
        f"{where}, nor of any recipe module of this package.{hint} "
        f"Recipes in {module_name}: {', '.join(_recipes(module))}."
    )
