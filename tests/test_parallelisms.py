"""Expert, pipeline and context parallelism past the tutorial's TP x FSDP:
what parses and what each layout refuses, on this machine's CPU.

Proves: torchtitan's CUDA-graph checks (which refuse pipeline parallelism
and expert parallelism's synchronizing token dispatch unless
``--training.disable_cuda_graphs``) apply on CUDA only, where a graph is
captured; elsewhere the EP and PP flags parse as a user types them, for the
plain and the SimpleFSDP recipes, and on CUDA upstream's refusal stands.
The planner refuses expert parallelism before tracing, with the reason. The
SimpleFSDP recipes pipeline with torchtitan's pipeline_llm (GraphPP runs in
aot_fx_trace mode only, and a spec that keeps it is refused), and stages
torchtitan cannot split are refused before any rank starts.
Context parallelism gathers keys and values over ``cp``: each rank's mask
rows, stitched together, are the whole sequence's causal or block-causal mask;
its rotary rows are the positions it holds; torch's ring attention has no CPU
kernel (why upstream's CP cannot run here); GPT-OSS's sink attention is
refused before any rank starts. One launch set (slow tier) proves CP2 x FSDP2
and PP2 x FSDP2 with block-causal documents against 1 rank, a bit-identical
resume at each, and resumes across layouts (CP2 -> PP2, PP2 -> FSDP2).
The EP runs themselves are in tests/test_deepseek.py (slow tier).

Tier: fast, but the CP and PP runs (slow).

Run: .venv/bin/python -m pytest tests/test_parallelisms.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.config import ConfigManager

from torchtitan_neuron import devices

REPO = Path(__file__).resolve().parent.parent
DEEPSEEK_SIMPLE_FSDP = ("torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
                        "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2")
DEEPSEEK_PLAIN = ("torchtitan_neuron.models.deepseek_v3", "deepseek_v3_debugmodel_neuron_tp2_fsdp2")
LLAMA_SIMPLE_FSDP = ("torchtitan_neuron.experiments.graph_trainer.llama3",
                     "simple_fsdp_llama3_debugmodel")


def _parse(recipe, *flags):
    module, config = recipe
    return ConfigManager().parse_args(["--module", module, "--config", config, *flags])


@pytest.mark.parametrize("recipe, flags", [
    (DEEPSEEK_SIMPLE_FSDP, ["--parallelism.expert_parallel_degree", "2"]),
    (DEEPSEEK_PLAIN, ["--parallelism.expert_parallel_degree", "2"]),
    (LLAMA_SIMPLE_FSDP, ["--parallelism.pipeline_parallel_degree", "2"]),
])
def test_ep_and_pp_flags_parse_off_cuda(recipe, flags):
    assert devices.detect().name == "cpu"
    config = _parse(recipe, *flags)
    assert not config.training.disable_cuda_graphs  # zero_grad keeps its default


def test_on_cuda_upstreams_cuda_graph_refusal_stands(monkeypatch, capsys):
    cuda = type("Platform", (), {"name": "cuda"})()
    monkeypatch.setattr(devices, "detect", lambda *args, **kwargs: cuda)
    with pytest.raises(SystemExit):
        _parse(DEEPSEEK_SIMPLE_FSDP, "--parallelism.expert_parallel_degree", "2")
    assert "CUDA graphs support only expert parallel" in " ".join(capsys.readouterr().err.split())
    config = _parse(DEEPSEEK_SIMPLE_FSDP, "--parallelism.expert_parallel_degree", "2",
                    "--training.disable_cuda_graphs")
    assert config.parallelism.expert_parallel_degree == 2


def test_traced_ep_splits_are_even_sends_and_imbalanced_receives():
    # Row plan-ep-splits: the split sizes the planner and the rehearsal trace
    # with, from the rows dispatch routes (tokens x top_k).
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from torchtitan_neuron.tracing import patches

    dispatcher = AllToAllTokenDispatcher.__new__(AllToAllTokenDispatcher)
    dispatcher.top_k, dispatcher.ep_mesh = 2, None
    x, scores = torch.randn(5, 3), torch.rand(5, 2)
    ids = torch.tensor([[0, 1], [0, 3], [0, 1], [0, 3], [2, 3]])
    counts = torch.bincount(ids.view(-1), minlength=4)
    # What dispatch sees under EP: the dispatcher's attributes, balanced splits.
    view = patches._RoutedRows(dispatcher, 10, 1.5)
    assert view.top_k == 2 and view._local_reorder.__self__ is dispatcher
    out, send, receive = view._sync_token_count_exchange(counts, counts.view(2, 2), 2)
    assert send == [5, 5] and receive == [8, 8]  # ceil(1.5 x 10 / 2)
    assert out.tolist() == counts.tolist()
    # Upstream's own method reads the counts: 6 rows for experts 0-1, 4 for 2-3.
    _, send, receive = dispatcher._sync_token_count_exchange(counts, counts.view(2, 2), 2)
    assert send == [6, 4] and receive == [6, 4]
    # Without EP, upstream's dispatch runs as is; the patch is undone on exit.
    upstream = AllToAllTokenDispatcher.dispatch
    with patches.balanced_expert_routing(1.5):
        assert AllToAllTokenDispatcher.dispatch is not upstream
        rows, tokens, _ = AllToAllTokenDispatcher.dispatch(dispatcher, x, scores, ids, counts)
    assert rows.shape == (10, 3) and tokens.tolist() == counts.tolist()
    assert AllToAllTokenDispatcher.dispatch is upstream


def test_the_planner_refuses_an_ep_imbalance_below_the_mean(capsys):
    from torchtitan_neuron.plan.__main__ import main

    code = main(["--module", DEEPSEEK_SIMPLE_FSDP[0], "--config", "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16",
                 "--ngpu", "64", "--target", "trn2", "--parallelism.tensor_parallel_degree", "1",
                 "--parallelism.expert_parallel_degree", "8", "--ep-imbalance", "0.5"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--ep-imbalance 0.5: an EP rank receives at least the mean" in err


def test_pipeline_stages_get_their_shapes_from_the_config():
    # What the schedule's shape agreement would say, for a traced rank.
    import torch
    from torch.distributed.tensor import DTensor

    from torchtitan_neuron.tracing.world import last_stage_rank, stage_shapes

    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "2",
                    "--training.mixed_precision_param", "float32")
    tokens, hidden = stage_shapes(config, 0, 4)
    assert (tuple(tokens.shape), tokens.dtype) == ((1, 512), torch.int64)
    assert (tuple(hidden.shape), hidden.dtype, hidden.requires_grad) == (
        (1, 512, 256), torch.float32, True)
    received, logits = stage_shapes(config, 3, 4)
    assert tuple(received.shape) == (1, 512, 256) and tuple(logits.shape) == (1, 512, 2048)
    assert not isinstance(received, DTensor)
    assert last_stage_rank(config, 8) == 4
    config.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    assert last_stage_rank(config, 8) == 0


@pytest.mark.e2e
def test_the_planner_plans_both_end_stages_and_the_rehearsal_sees_send_and_receive():
    # PP2 x TP2 x FSDP2 on 8 trn2 ranks: rank 0 holds the first stage, rank 4
    # the last; under TP the hidden states cross stages as sequence-sharded
    # DTensors. The plan is the larger of the two ranks' peaks.
    args = ["--module", LLAMA_SIMPLE_FSDP[0], "--config", "simple_fsdp_llama3_debugmodel_pp2",
            "--ngpu", "8", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "1F1B"]
    proc = subprocess.run([sys.executable, "-m", "torchtitan_neuron.plan", *args, "--json"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    plan = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert plan["layout"]["pp"] == 2 and plan["layout"]["microbatches"] == 4
    peaks = plan["stage_peaks_gib"]
    assert set(peaks) == {"0", "4"} and all(v > 0 for v in peaks.values())
    assert plan["peak_gib"] == max(peaks.values())
    assert str(plan.get("rank", 0)) == max(peaks, key=peaks.get) and plan["fits"]
    proc = subprocess.run([sys.executable, "-m", "torchtitan_neuron.rehearse", *args, "--json",
                           "--one-rank"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert report["ready"], report["reasons"]
    # Microbatches x local stages, each way; listed, not warned of.
    sends, receives = report["collectives"]["send"], report["collectives"]["recv_"]
    assert sends["count"] == receives["count"] == 4 and sends["bytes"] > 0
    assert not any("send" in w or "recv" in w for w in report["warnings"])


def test_simple_fsdp_recipes_pipeline_with_torchtitans_pipeline_llm():
    # graph_trainer's GraphPP runs in aot_fx_trace mode only; in jit mode each
    # stage goes through pipeline_llm and this project's parallelize (row pp-jit-stages).
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.experiments.graph_trainer.graph_pp.pipeline import graph_pipeline_llm

    from torchtitan_neuron.preflight import PreflightError, check_layout

    for recipe in (LLAMA_SIMPLE_FSDP, DEEPSEEK_SIMPLE_FSDP):
        assert _parse(recipe).model_spec.pipelining_fn is pipeline_llm
    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "2")
    assert check_layout(config, 4)["dp_shard"] == 2
    # A spec that still pipelines with GraphPP in jit mode is refused with the reason.
    config.model_spec.pipelining_fn = graph_pipeline_llm
    with pytest.raises(PreflightError, match=r"--parallelism.pipeline_parallel_degree 2: this "
                       r"SimpleFSDP recipe pipelines with graph_trainer's GraphPP, which "
                       r"torchtitan 0.3.0 runs only in aot_fx_trace mode"):
        check_layout(config, 4)


def test_the_preflight_refuses_microbatches_the_schedule_cannot_run():
    from torchtitan_neuron.preflight import PreflightError, check_layout

    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "1F1B",
                    "--training.local_batch_size", "1", "--training.global_batch_size", "1")
    with pytest.raises(PreflightError, match=r"1F1B: --training.local_batch_size 1 in "
                       r"microbatches of .* gives 1 microbatches, and 1F1B needs at least "
                       r"one per stage \(2\). Raise the local batch to 2"):
        check_layout(config, 2)
    # Interleaved1F1B at PP2: 6 microbatches are 3 rounds of 2; 5 are not.
    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "2",
                    "--training.local_batch_size", "5", "--training.global_batch_size", "5")
    with pytest.raises(PreflightError, match=r"needs a multiple of its 2 rounds .* Use a "
                       r"local batch of 4 or 6"):
        check_layout(config, 2)
    config.training.local_batch_size = config.training.global_batch_size = 6
    assert check_layout(config, 2)["dp_shard"] == 1


def test_the_preflight_refuses_stages_torchtitan_cannot_split():
    from torchtitan_neuron.preflight import PreflightError, check_layout

    # 8 ranks x 2 virtual stages = 16 stages for 6 layers + embedding + output.
    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "8")
    with pytest.raises(PreflightError, match=r"--parallelism.pipeline_parallel_degree 8: "
                       r"torchtitan cannot split the model into pipeline stages: Number of "
                       r"stages \(16\) cannot be greater than effective layers \(8\)"):
        check_layout(config, 8)
    assert check_layout(_parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "4"),
                        4)["dp_shard"] == 1


def test_context_parallel_masks_stitch_into_the_whole_sequences_mask():
    import torch

    from torchtitan_neuron.components.context_parallel import local_attention_mask, token_order
    from torchtitan_neuron.components.documents import block_causal_mask, document_ids

    seq, batch = 16, 2
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, 5] = starts[1, 11] = True
    for balancer in ("headtail", None):
        for cp in (2, 4):
            order = token_order(seq, cp, balancer)
            assert sorted(order.tolist()) == list(range(seq))
            for documents, full in ((None, torch.ones(seq, seq, dtype=torch.bool).tril()
                                     .expand(batch, 1, seq, seq)),
                                    (document_ids(starts), block_causal_mask(starts))):
                rows = torch.cat([
                    local_attention_mask(batch, seq, cp, rank, balancer, documents)
                    for rank in range(cp)], dim=2)
                # Rows in the ranks' order, columns in the gathered keys' order.
                assert torch.equal(rows, full[:, :, order][:, :, :, order])
    # Head-tail: rank 0 of 2 holds the first and the last quarter.
    assert token_order(16, 2, "headtail")[:8].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="context_parallel_load_balancer 'ptrr'"):
        token_order(16, 2, "ptrr")


def test_context_parallel_rotary_rows_are_the_positions_a_rank_holds():
    import torch

    from torchtitan_neuron.components.context_parallel import position_runs, token_order
    from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
        simple_fsdp_llama3_debugmodel_cp2,
    )

    rope_config = simple_fsdp_llama3_debugmodel_cp2().model_spec.model.layers[0].attention.rope
    assert rope_config.use_prefix_cache_for_positions
    rope = rope_config.build()
    seq = 32
    held = token_order(seq, 2, "headtail")[16:]  # rank 1's positions
    rope.cp_ranges = position_runs(held)
    assert rope.cp_ranges == ((8, 24),)
    q = torch.randn(1, 16, 2, rope_config.dim)  # (batch, seq / 2, heads, head dim)
    k = torch.randn_like(q)
    got = rope(q, k)
    rope.cp_ranges = ()
    whole_q = torch.zeros(1, seq, 2, q.shape[-1])
    whole_k = torch.zeros_like(whole_q)
    whole_q[:, held], whole_k[:, held] = q, k
    want = rope(whole_q, whole_k)
    assert torch.allclose(got[0], want[0][:, held]) and torch.allclose(got[1], want[1][:, held])


def test_torchs_ring_attention_has_no_cpu_kernel():
    # Why upstream's apply_cp_to_forward cannot run SDPA on CPU ranks (row
    # cp-allgather-sdpa): its DTensor handlers cover the CUDA kernels only.
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops

    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in custom_ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in custom_ops


def test_the_preflight_refuses_context_parallelism_on_sink_attention():
    from torchtitan_neuron.preflight import PreflightError, check_layout

    gpt_oss = ("torchtitan_neuron.experiments.graph_trainer.gpt_oss", "simple_fsdp_gpt_oss_debugmodel")
    with pytest.raises(PreflightError, match=r"--parallelism.context_parallel_degree 2: layer 0's "
                       r"attention is SinkSDPA; context parallelism here gathers keys and values "
                       r"for SDPA attention \(causal or block_causal\) only"):
        check_layout(_parse(gpt_oss, "--parallelism.context_parallel_degree", "2"), 2)
    assert check_layout(_parse(LLAMA_SIMPLE_FSDP, "--parallelism.context_parallel_degree", "2"),
                        4)["dp_shard"] == 2


CP_RUN = [
    "--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
    "--compile.backend", "aot_eager", "--training.mixed_precision_param", "float32",
    "--training.seq_len", "256", "--training.local_batch_size", "2",
    "--training.global_batch_size", "4", "--metrics.log_freq", "1", "--debug.seed", "0",
    "--model.attn_mask_type", "block_causal", "--training.steps", "6",
    "--checkpoint.enable", "--checkpoint.interval", "3",
]


@pytest.mark.slow
@pytest.mark.e2e
def test_cp_and_pp_match_one_rank_and_resume_across_layouts(tmp_path):
    """CP2 x FSDP2 and PP2 x FSDP2 (4 ranks, block-causal documents) print
    the 1-rank losses; each one's step-3 checkpoint resumes bit for bit at
    its own layout, and at another (CP2 -> PP2, PP2 -> FSDP2 alone) with the
    1-rank losses."""
    import shutil

    from conftest import run_train

    cp2 = dict(ngpu=4, config="simple_fsdp_llama3_debugmodel_cp2")
    pp2 = dict(ngpu=4, config="simple_fsdp_llama3_debugmodel_pp2", env={"LOG_RANK": "2"})

    def losses(run, first=1):
        assert run.returncode == 0, run.output[-4000:]
        assert [s.step for s in run.steps] == list(range(first, 7)), run.output[-2000:]
        return [(s.loss, s.grad_norm) for s in run.steps]

    def close(mine, ref):
        assert all(abs(a - b) <= 1e-5 * abs(b) for (a, _), (b, _) in zip(mine, ref)), (mine, ref)

    one = losses(run_train(CP_RUN, ngpu=1, dump_folder=tmp_path / "one"))
    runs = {}
    for name, layout, mesh in (("cp2", cp2, "cp=2"), ("pp2", pp2, "pp=2")):
        run = run_train(CP_RUN, dump_folder=tmp_path / name, **layout)
        assert mesh in run.output and "dp_shard=2" in run.output
        assert "Block-causal attention:" in run.output
        runs[name] = losses(run)
        close(runs[name], one)
    resumes = (("cp2", "cp2", cp2), ("pp2", "pp2", pp2), ("cp2", "cp2-at-pp2", pp2),
               ("pp2", "pp2-at-fsdp2", dict(ngpu=2)))
    for saved, name, layout in resumes:
        shutil.copytree(tmp_path / saved / "checkpoint" / "step-3",
                        tmp_path / f"r-{name}" / "checkpoint" / "step-3")
        resumed = losses(run_train(CP_RUN, dump_folder=tmp_path / f"r-{name}", **layout), 4)
        if name == saved:
            assert resumed == runs[saved][3:]  # bit for bit at its own layout
        else:
            close(resumed, one[3:])
