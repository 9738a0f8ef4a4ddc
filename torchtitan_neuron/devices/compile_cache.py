"""Where each rank's compiled code is cached."""

from __future__ import annotations

import os

def per_rank_compile_cache() -> str | None:
    """Give this rank its own inductor/AOTAutograd cache directory.

    Ranks on one host share ``/tmp/torchinductor_<user>`` by default. Under TP
    x FSDP, ranks of different subgroups trace graphs that differ only in the
    name of their process group, and torch 2.14's AOTAutograd cache serves
    one rank's compiled code to another: seen here as "Could not resolve the
    process group registered under the name 23" on a 4-rank TP2 x FSDP2
    DeepSeek run with inductor. ``$TORCHINDUCTOR_CACHE_DIR`` (or torch's
    default) stays the root; each rank uses ``<root>/rank<R>-of-<N>``.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return per_rank_dir("TORCHINDUCTOR_CACHE_DIR", default_cache_dir)


def per_rank_dir(env: str, default_root) -> str | None:
    """``<root>/rank<R>-of-<N>`` for a launched rank, set in ``env``: the root
    is ``env``'s value or ``default_root()``. None outside a launch."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    path = os.path.join(os.environ.get(env) or default_root(), f"rank{rank}-of-{world}")
    os.environ[env] = path
    return path


