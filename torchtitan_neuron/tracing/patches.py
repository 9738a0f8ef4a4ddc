"""The planner's patches of torch and torchtitan, all in one place.

Each is undone on exit, has a row in docs/upstream-workarounds.md, and
``PATCHED`` lists the upstream functions they replace; each one's source is
pinned in tests/test_upstream_drift.py, so a torch or torchtitan upgrade that
changes one fails there.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch

# (module, qualified name) of every upstream function patched here.
PATCHED = (
    ("torchtitan.protocols.module", "Module._init_param"),
    ("torchtitan.protocols.model", "BaseModel.init_weights"),
    ("torch.nn.modules.module", "Module.to_empty"),
    ("torch._functorch._aot_autograd.graph_compile", "_log_joint_graph"),
    ("torch._functorch._aot_autograd.graph_compile", "_log_fw_bw_graphs"),
    ("torch.utils.checkpoint", "_detach_helper"),
    ("torchtitan.models.common.token_dispatcher", "AllToAllTokenDispatcher.dispatch"),
)


@contextlib.contextmanager
def fake_model_state(fake_mode):
    """Materialize the model as FakeTensors (``to_empty``) and draw no
    initial weights: FakeTensors hold no values. Buffers (the rotary cache)
    are still computed, as shapes. torchtitan's Trainer does both inside
    ``__init__`` with no option to skip or redirect them."""
    from torchtitan.protocols.model import BaseModel
    from torchtitan.protocols.module import Module

    init_weights = BaseModel.init_weights
    to_empty = torch.nn.Module.to_empty

    def fake_to_empty(self, *args, **kwargs):
        with fake_mode:
            return to_empty(self, *args, **kwargs)

    def fake_init_weights(self, **kwargs):
        with fake_mode:
            return init_weights(self, **kwargs)

    with mock.patch.object(Module, "_init_param", lambda self, name, param: None), \
            mock.patch.object(BaseModel, "init_weights", fake_init_weights), \
            mock.patch.object(torch.nn.Module, "to_empty", fake_to_empty):
        yield


@contextlib.contextmanager
def fast_tracing():
    """Tracing settings that make planning the 8B step faster and leave the
    graphs as they are (tests/test_plan_upstream.py compares them).

    - Dynamo runs no full garbage collection after each compile (a public
      config switch).
    - AOTAutograd prints the joint, forward and backward graphs as text
      whether or not a log is on (about 5% of the 8B plan); Dynamo's
      ``aot_autograd`` offers no ``enable_log=False`` as ``aot_function``
      does, so the text is made only when those logs are on.
    - Selective AC, while AOTAutograd traces the joint graph, detaches every
      op output of a checkpointed region into a cache tracing never reads
      (torch: "storage is a tracing artifact"); each detach is one more op
      through functionalization. Storing the traced tensors as they are
      took 7-11% off the 8B TP1 x FSDP64 plan.
    """
    from torch._functorch._aot_autograd import graph_compile
    from torch._subclasses.functional_tensor import FunctionalTensor

    joint, fw_bw = graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs
    logs_on = torch._logging._internal.log_state.is_artifact_enabled

    def log_joint_graph(*args, **kwargs):
        return joint(*args, **kwargs) if logs_on("aot_joint_graph") else None

    def log_fw_bw_graphs(*args, **kwargs):
        return fw_bw(*args, **kwargs) if logs_on("aot_graphs") else (None, None)

    detach = torch.utils.checkpoint._detach_helper

    def detach_unless_tracing(x):
        if isinstance(x, FunctionalTensor):
            return x
        return detach(x)

    with torch._dynamo.config.patch(run_gc_after_compile=False), \
            mock.patch.object(graph_compile, "_log_joint_graph", log_joint_graph), \
            mock.patch.object(graph_compile, "_log_fw_bw_graphs", log_fw_bw_graphs), \
            mock.patch.object(torch.utils.checkpoint, "_detach_helper", detach_unless_tracing):
        yield


class _RoutedRows:
    """A dispatcher as upstream's ``dispatch`` sees it while traced: every
    attribute is the dispatcher's but the split sizes, computed from
    ``rows`` (its input's ``tokens x top_k``). A new object per call, so
    Dynamo traces no mutation inside an activation-checkpointed block."""

    def __init__(self, dispatcher, rows: int, imbalance: float):
        self._dispatcher, self._rows, self._imbalance = dispatcher, rows, imbalance

    def __getattr__(self, name):
        return getattr(self._dispatcher, name)

    def _sync_token_count_exchange(self, num_local_tokens_per_expert_E,
                                   num_global_tokens_per_local_expert_EP_e, ep_size):
        rows = self._rows
        send = [rows // ep_size + (1 if r < rows % ep_size else 0) for r in range(ep_size)]
        receive = [math.ceil(self._imbalance * rows / ep_size)] * ep_size
        counts = torch.ops._c10d_functional.wait_tensor(
            num_global_tokens_per_local_expert_EP_e).reshape(-1)
        return counts, send, receive


@contextlib.contextmanager
def balanced_expert_routing(imbalance: float = 1.0):
    """Expert parallelism on FakeTensors: the all-to-all split sizes a
    router that loads an EP rank ``imbalance`` times the mean would give.

    Upstream's ``AllToAllTokenDispatcher.dispatch`` exchanges each rank's
    per-expert token counts and reads them back as Python lists
    (``.tolist()`` in ``_sync_token_count_exchange``) to size the token
    all-to-all; FakeTensors hold no counts. Here each rank sends an equal
    share of its ``N = tokens x top_k`` routed rows to every EP rank and
    receives ``imbalance`` times that share from each, so the receive
    buffers, the expert inputs and their activations are planned for a rank
    whose experts get ``imbalance`` times the mean load (1.0: perfect
    balance). Without EP (no ``ep_mesh``) upstream's dispatch runs as is.
    """
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    dispatch = AllToAllTokenDispatcher.dispatch

    def balanced_dispatch(self, x_TD, *args, **kwargs):
        if self.ep_mesh is None:
            return dispatch(self, x_TD, *args, **kwargs)
        view = _RoutedRows(self, x_TD.shape[0] * self.top_k, imbalance)
        return dispatch(view, x_TD, *args, **kwargs)

    with mock.patch.object(AllToAllTokenDispatcher, "dispatch", balanced_dispatch):
        yield
