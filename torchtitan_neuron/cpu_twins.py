"""Each Trainium recipe and the CPU debug recipe that rehearses the same path
(same module, trainer, parallelism and AC choice, a tiny model): what the
launcher suggests when a Trainium recipe is started on a CPU host, and what a
CPU run's summary offers to plan for trn2."""

from __future__ import annotations

from torchtitan_neuron.devices.neuron import HOST_CORES

LLAMA = "torchtitan_neuron.experiments.graph_trainer.llama3"
DEEPSEEK = "torchtitan_neuron.experiments.graph_trainer.deepseek_v3"
PLAIN_LLAMA = "torchtitan_neuron.models.llama3"
PLAIN_DEEPSEEK = "torchtitan_neuron.models.deepseek_v3"
PLAIN_QWEN = "torchtitan_neuron.models.qwen3"
GPT_OSS = "torchtitan_neuron.experiments.graph_trainer.gpt_oss"
PLAIN_GPT_OSS = "torchtitan_neuron.models.gpt_oss"

# (module, Trainium recipe) -> (CPU twin, its ranks). The first Trainium
# recipe listed for a twin is the one its summary offers to plan.
TWINS: dict[tuple[str, str], tuple[str, int]] = {
    (LLAMA, "simple_fsdp_llama3_8b"): ("simple_fsdp_llama3_debugmodel", 2),
    (LLAMA, "simple_fsdp_llama3_8b_fullac"): ("simple_fsdp_llama3_debugmodel_fullac", 2),
    (LLAMA, "simple_fsdp_llama3_70b_fullac"): ("simple_fsdp_llama3_debugmodel_fullac", 2),
    (LLAMA, "simple_fsdp_llama3_8b_cp4_32k"): ("simple_fsdp_llama3_debugmodel_cp2", 2),
    (LLAMA, "simple_fsdp_llama3_70b_tp8_fsdp16"): ("simple_fsdp_llama3_debugmodel_fullac", 2),
    (DEEPSEEK, "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16"):
        ("simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2", 4),
    (DEEPSEEK, "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16_fac"):
        ("simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2_fac", 4),
    (PLAIN_LLAMA, "llama3_8b_neuron"): ("llama3_debugmodel_neuron", 2),
    (PLAIN_LLAMA, "llama3_8b_neuron_compiled"): ("llama3_debugmodel_neuron_compiled", 2),
    (PLAIN_LLAMA, "llama3_8b_tp4_fsdp16_sac"): ("llama3_debugmodel_tp2_fsdp2_sac", 4),
    (PLAIN_DEEPSEEK, "deepseek_v3_16b_neuron_tp4_fsdp16"):
        ("deepseek_v3_debugmodel_neuron_tp2_fsdp2", 4),
    (PLAIN_QWEN, "qwen3_8b_tp4_fsdp16_sac"): ("qwen3_debugmodel_tp2_fsdp2_sac", 4),
    (GPT_OSS, "simple_fsdp_gpt_oss_20b"): ("simple_fsdp_gpt_oss_debugmodel_tp2_fsdp2", 4),
    (GPT_OSS, "simple_fsdp_gpt_oss_20b_fullac"): ("simple_fsdp_gpt_oss_debugmodel_fullac", 2),
    (GPT_OSS, "simple_fsdp_gpt_oss_120b_fullac"): ("simple_fsdp_gpt_oss_debugmodel_fullac", 2),
    (PLAIN_GPT_OSS, "gpt_oss_20b_neuron_tp2_fsdp32"): ("gpt_oss_debugmodel_neuron_tp2_fsdp2", 4),
    (PLAIN_GPT_OSS, "gpt_oss_120b_neuron_tp8"): ("gpt_oss_debugmodel_neuron_tp2_fsdp2", 4),
}
TRAINIUM_RANKS = HOST_CORES["trn2"]  # a trn2.48xlarge's NeuronCores at LNC=2


def cpu_twin(module: str, recipe: str) -> tuple[str, int] | None:
    """The CPU debug recipe (and its ranks) that rehearses ``recipe``."""
    return TWINS.get((module, recipe))


def trainium_counterpart(module: str, recipe: str) -> str | None:
    """The Trainium recipe a CPU debug ``recipe`` rehearses, if any."""
    for (mod, big), (twin, _) in TWINS.items():
        if mod == module and twin == recipe:
            return big
    return None


def plan_command(module: str, recipe: str) -> str:
    """The planner command that answers "does ``recipe`` fit a trn2.48xlarge"."""
    return (f"python -m torchtitan_neuron.plan --module {module} --config {recipe} "
            f"--ngpu {TRAINIUM_RANKS} --target trn2")
