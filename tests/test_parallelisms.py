"""Expert, pipeline and context parallelism past the tutorial's TP x FSDP:
what parses and what each layout refuses, on this machine's CPU.

Proves: torchtitan's CUDA-graph checks (which refuse pipeline parallelism
and expert parallelism's synchronizing token dispatch unless
``--training.disable_cuda_graphs``) apply on CUDA only, where a graph is
captured; elsewhere the EP and PP flags parse as a user types them, for the
plain and the SimpleFSDP recipes, and on CUDA upstream's refusal stands.
The planner refuses expert parallelism before tracing, with the reason, and
the preflight refuses pipeline stages on a SimpleFSDP recipe (GraphPP runs in
aot_fx_trace mode only).
The EP runs themselves are in tests/test_deepseek.py (slow tier).

Tier: fast.

Run: .venv/bin/python -m pytest tests/test_parallelisms.py -q
"""

import pytest
from torchtitan.config import ConfigManager

from torchtitan_neuron import devices

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


def test_the_planner_refuses_expert_parallelism_before_tracing(capsys):
    # Traced on FakeTensors, the token all-to-all's split sizes have no values.
    from torchtitan_neuron.plan.__main__ import main

    code = main(["--module", DEEPSEEK_SIMPLE_FSDP[0], "--config", "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16",
                 "--ngpu", "64", "--target", "trn2", "--parallelism.tensor_parallel_degree", "1",
                 "--parallelism.expert_parallel_degree", "8"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--parallelism.expert_parallel_degree 8: the planner does not plan expert parallelism yet" in err


def test_the_preflight_refuses_pipeline_stages_on_a_simple_fsdp_recipe():
    # graph_trainer's GraphPP runs in aot_fx_trace mode only; these recipes are jit.
    from torchtitan_neuron.preflight import PreflightError, check_layout

    config = _parse(LLAMA_SIMPLE_FSDP, "--parallelism.pipeline_parallel_degree", "2")
    with pytest.raises(PreflightError, match=r"--parallelism.pipeline_parallel_degree 2: this "
                       r"SimpleFSDP recipe pipelines with graph_trainer's GraphPP, which "
                       r"torchtitan 0.3.0 runs only in aot_fx_trace mode"):
        check_layout(config, 4)
    check_layout(_parse(LLAMA_SIMPLE_FSDP), 4)  # no PP: the same recipe passes
