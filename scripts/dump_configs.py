"""Every recipe's built config, field by field, as JSON: the proof that a
refactor changes no recipe.

    .venv/bin/python scripts/dump_configs.py --write tests/assets/recipe_configs.json.xz
    .venv/bin/python scripts/dump_configs.py --check tests/assets/recipe_configs.json.xz

Each recipe function of every ``config_registry`` in the package is called
and its config walked: dataclass fields by name, classes and functions by
``module.qualname``, partials by function and arguments, other objects by type
and their public attributes. ``--check FILE`` compares with a saved dump and
prints each recipe and field that differs (exit 1); ``--module-paths`` leaves
a class's or function's module out of the comparison, for a change that only
moves code.
"""

import argparse
import dataclasses
import enum
import functools
import importlib
import inspect
import json
import lzma
import pkgutil
import sys

import torchtitan_neuron


def registries() -> list[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages(torchtitan_neuron.__path__,
                                                    "torchtitan_neuron.")
        if info.name.endswith(".config_registry")
    )


def recipes(registry: str) -> dict:
    module = importlib.import_module(registry)
    return {
        name: fn for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == registry and not name.startswith("_")
    }


def _name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def walk(obj, seen: frozenset = frozenset()):
    """A JSON-able picture of ``obj``: what a recipe's config holds."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return f"{_name(type(obj))}.{obj.name}"
    if isinstance(obj, (list, tuple)):
        # Runs of equal items (a model's identical layers) as one item and a count.
        items, out = [walk(v, seen) for v in obj], []
        for item in items:
            if out and isinstance(out[-1], dict) and out[-1].get("@repeat") \
                    and out[-1]["item"] == item:
                out[-1]["@repeat"] += 1
            elif out and out[-1] == item and not isinstance(item, (int, float, str)):
                out[-1] = {"@repeat": 2, "item": item}
            else:
                out.append(item)
        return out
    if isinstance(obj, dict):
        return {str(k): walk(v, seen) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(v) for v in obj)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return {"@ref": _name(obj)}
    if isinstance(obj, functools.partial):
        return {"@partial": walk(obj.func, seen), "args": walk(list(obj.args), seen),
                "keywords": walk(dict(obj.keywords), seen)}
    if id(obj) in seen:
        return {"@cycle": _name(type(obj))}
    seen = seen | {id(obj)}
    if dataclasses.is_dataclass(obj):
        fields = {f.name: walk(getattr(obj, f.name), seen) for f in dataclasses.fields(obj)}
        return {"@type": _name(type(obj)), **fields}
    if inspect.ismethod(obj):
        return {"@method": obj.__func__.__qualname__, "of": walk(obj.__self__, seen)}
    attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_")} \
        if hasattr(obj, "__dict__") else {}
    return {"@type": _name(type(obj)), **{k: walk(v, seen) for k, v in attrs.items()}}


def dump() -> dict:
    return {f"{registry.removesuffix('.config_registry')}:{name}": walk(fn())
            for registry in registries() for name, fn in recipes(registry).items()}


def _strip_modules(obj):
    if isinstance(obj, dict):
        return {k: (v.rpartition(".")[2] if k in ("@ref", "@type") and isinstance(v, str)
                    else _strip_modules(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_modules(v) for v in obj]
    return obj


def differences(old, new, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            where = f"{path}.{key}" if path else key
            if key not in old:
                found.append(f"{where}: added")
            elif key not in new:
                found.append(f"{where}: removed")
            else:
                found += differences(old[key], new[key], where)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new))
                for d in differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def _open(path: str, mode: str):
    return lzma.open(path, mode) if path.endswith(".xz") else open(path, mode[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="FILE", help="compare with a saved dump")
    parser.add_argument("--write", metavar="FILE",
                        help="save the dump (xz-compressed where FILE ends in .xz)")
    parser.add_argument("--module-paths", action="store_true",
                        help="with --check: ignore the module a class or function lives in")
    args = parser.parse_args()
    current = dump()
    if args.write:
        text = json.dumps(current, indent=1, sort_keys=True) + "\n"
        with _open(args.write, "wt") as f:
            f.write(text)
        print(f"{len(current)} recipes written to {args.write}")
        return 0
    if not args.check:
        json.dump(current, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    with _open(args.check, "rt") as f:
        saved = json.load(f)
    if args.module_paths:
        saved, current = _strip_modules(saved), _strip_modules(current)
    found = differences(saved, current)
    for line in found:
        print(line)
    print(f"{len(current)} recipes, {len(found)} differences from {args.check}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
