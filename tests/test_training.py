"""Real multi-process SimpleFSDP runs on CPU ranks, launched as a user would.

Proves: a 2-rank run of the SimpleFSDP Llama recipe trains (finite, falling
loss, a real memory figure); the compiled forward graph holds the FSDP
all-gathers (one per block: bucketing), the backward graph the
reduce-scatters and the recomputed all-gathers (reshard after forward), and gradient clipping is its own compiled
graph with the norm's all-reduce; with packed documents under causal attention
the run says which share of attention pairs crosses a document boundary. TP layouts and gradient accumulation are
trained in test_correctness.py and test_deepseek.py, the full-AC recipe in
test_memory.py.

Tier: e2e, in ``make test`` (the default rehearsal).
Run: .venv/bin/python -m pytest tests/test_training.py -q
"""

import math
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import FAST
from runlog import Run, run_command, torchrun

pytestmark = pytest.mark.e2e

ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"


def _assert_trains(result: Run, n_steps: int):
    assert result.returncode == 0, result.output[-4000:]
    steps = result.steps
    assert [s.step for s in steps] == list(range(1, n_steps + 1)), result.output[-4000:]
    assert all(math.isfinite(s.loss) for s in steps)
    assert steps[-1].loss < steps[0].loss - 0.1
    assert all(s.memory_gib > 0.1 for s in steps)


def _graph_ops(capture_dir: Path, kind: str) -> list[Counter]:
    files = sorted(capture_dir.glob(f"rank0_{kind}_*.txt"))
    return [Counter(f.read_text().split()) for f in files]


def test_two_rank_run_trains_and_graphs_hold_fsdp_collectives(tmp_path):
    capture_dir = tmp_path / "graphs"
    capture_dir.mkdir()
    env = dict(os.environ, CAPTURE_DIR=str(capture_dir))
    cmd = torchrun("tests/helpers/train_capturing_graphs.py", [
        *FAST, "--compile.backend", "capture_graphs",
        "--training.steps", "6", f"--dump_folder={tmp_path / 'out'}",
    ])
    result = run_command(cmd, env, timeout=600)
    _assert_trains(result, 6)
    assert result.output.count("compile.mode='jit' is deprecated") == 1
    assert "Per-rank sharded state" in result.output
    # Packed documents under causal attention: the start-up notice.
    notice = re.search(r"(\d+\.\d)% of the attention pairs in the first batch cross a "
                       r"document boundary\. --model\.attn_mask_type block_causal", result.output)
    assert notice and 0 < float(notice[1]) < 100, result.output[-4000:]

    forward, backward = _graph_ops(capture_dir, "fw"), _graph_ops(capture_dir, "bw")
    model_fw = max(forward, key=lambda c: c[ALL_GATHER])
    model_bw = max(backward, key=lambda c: c[REDUCE_SCATTER])
    # The debug model has 45 parameter tensors, all sharded over the 2 ranks;
    # lm_head is applied by the chunked loss outside the model graph. Bucketing
    # (on by default) gathers each of the 6 blocks' 7 tensors at once, so the
    # model graph gathers 6 buckets plus the token embedding and the final
    # norm, and reduce-scatters as many (44 of each with --compile.no-bucketing,
    # tests/test_bucketing.py).
    assert model_fw[ALL_GATHER] == 8
    assert model_bw[REDUCE_SCATTER] == 8
    # Reshard after forward: backward gathers the parameters again (all but
    # the token embedding, whose weight backward does not read).
    assert model_bw[ALL_GATHER] == 7
    # Selective AC under the default --compile.memory_policy (eager,
    # torchtitan's policy) recomputes every second matmul of a block: backward
    # computes each forward matmul's two gradients plus the 2nd and 4th of
    # each of the 6 blocks' 5 matmuls again (tests/test_activation_checkpoint.py).
    assert model_bw["aten.mm.default"] == 2 * model_fw["aten.mm.default"] + 2 * 6
    # Compiled gradient clipping: a separate graph reducing the norm.
    assert any(c[ALL_REDUCE] and not c[ALL_GATHER] for c in forward)

