"""What the tools read from a traced graph: an op's name, the user line a
node came from, and a compiled program's outputs as its graph records them.
"""

from __future__ import annotations

import re

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_frame(node: torch.fx.Node) -> tuple[str, int] | None:
    """The innermost user frame in a node's stack trace."""
    found = _FRAME.findall(node.meta.get("stack_trace") or "")
    return (found[-1][0], int(found[-1][1])) if found else None


def op_name(target) -> str:
    """``aten.mm`` for ``aten.mm.default``: the overload packet's name."""
    name = str(getattr(target, "_overloadpacket", target))
    return name



def recorded_outputs(gm, args: list) -> list:
    """A program's outputs as its graph records them (size, stride, offset,
    dtype, device), made in the inputs' fake mode without running its ops."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(args)
    if fake_mode is None:
        raise RuntimeError("planner: a compiled program got real tensors in its first step")
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    args.clear()  # a boxed program owns its inputs, as when it runs

    def extent(val) -> int:
        return val.storage_offset() + 1 + sum(
            (n - 1) * st for n, st in zip(val.shape, val.stride()) if n > 0)

    def key(val):
        return (val.untyped_storage()._cdata, val.dtype)

    # Outputs that are views of one storage in the graph (a bucket's
    # gradients, views of its flat reduce-scatter output) share one storage
    # here too, sized to the furthest of them.
    vals = [n.meta["val"] if isinstance(n, torch.fx.Node) else n for n in outputs]
    sizes: dict = {}
    for val in vals:
        if isinstance(val, torch.Tensor) and val.numel():
            sizes[key(val)] = max(sizes.get(key(val), 0), extent(val))
    flats: dict = {}

    def make(val):
        if not isinstance(val, torch.Tensor):
            return val
        with fake_mode:
            if not val.numel():
                flat = torch.empty(0, dtype=val.dtype, device=val.device)
            else:
                if key(val) not in flats:
                    flats[key(val)] = torch.empty(sizes[key(val)], dtype=val.dtype,
                                                  device=val.device)
                flat = flats[key(val)]
            return flat.as_strided(val.shape, val.stride(), val.storage_offset())

    return [make(v) for v in vals]
