"""One way to turn a config into another config class with the same fields.

torchtitan configs are slotted dataclasses, so a recipe cannot just swap a
config's class: this project's subclasses (a RoPE config with the
prefix-cache switch, ``NeuronTrainer.Config``, ...) are built anew from the
upstream config's fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any, TypeVar

C = TypeVar("C")


def promote(config: Any, cls: type[C], *, drop: Iterable[str] = (), **overrides: Any) -> C:
    """``config`` rebuilt as a ``cls``: every field's value carried over (the
    same objects, not copies), except the fields named in ``drop``, then
    ``overrides`` applied.

    ``cls`` is usually a subclass of ``config``'s class. A field of ``config``
    that ``cls`` lacks is an error unless it is in ``drop``, so no setting is
    lost without the caller saying so.
    """
    drop = set(drop)
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in drop}
    unknown = sorted(values.keys() - {f.name for f in fields(cls)})
    if unknown:
        raise TypeError(
            f"cannot promote {type(config).__qualname__} to {cls.__qualname__}: "
            f"{cls.__qualname__} has no field {', '.join(unknown)}; promote to a "
            "subclass of the config's class, or name the field in drop="
        )
    values.update(overrides)
    return cls(**values)
