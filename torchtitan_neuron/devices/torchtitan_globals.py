"""torchtitan's import-time copies of its device globals, and setting them.

torchtitan 0.3.0 assumes an accelerator: ``tools/utils.py`` falls back to
``"cuda"`` when none is found, and several modules copy ``device_type`` /
``device_module`` at import time. ``set_device_globals`` points every copy at
the platform's device; ``torchtitan_neuron.devices.install`` calls it once.
"""

from __future__ import annotations

import importlib


# Where torchtitan 0.3.0 keeps an import-time copy of ``device_type`` and/or
# ``device_module``. A test checks this list against torchtitan's source, so a
# new copy upstream is noticed. The autoparallel modules are left out on
# purpose: they import the optional ``autoparallel`` package and are never
# reached by this project's recipes.
DEVICE_GLOBAL_COPIES: dict[str, tuple[str, ...]] = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
    "torchtitan.tools.profiler": ("device_module",),
}
UNPATCHED_DEVICE_COPIES = frozenset(
    {
        "torchtitan.experiments.graph_trainer.llama3.parallelize_autoparallel",
        "torchtitan.experiments.graph_trainer.deepseek_v3.parallelize_autoparallel",
    }
)



def set_device_globals(device_type: str, device_module) -> list[str]:
    """Every import-time copy of torchtitan's ``device_type`` and
    ``device_module`` (``DEVICE_GLOBAL_COPIES``) set to these."""
    touched = []
    for module_name, names in DEVICE_GLOBAL_COPIES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, device_type if name == "device_type" else device_module)
            touched.append(f"{module_name}.{name}")
    return touched

