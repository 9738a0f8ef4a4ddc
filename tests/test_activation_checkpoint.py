"""Selective activation checkpointing in jit mode follows ``--compile.memory_policy``.

Proves: under ``default`` no matmul of a block is recomputed in the backward
graph, under ``eager`` every second one is (torchtitan's eager policy); under
both, CPU attention is saved, not recomputed in backward, where torchtitan's own
``SelectiveAC`` recomputes it; a user's own selective subclass is kept; the two
policies never share a compile-cache entry; a memory policy jit mode cannot
honour is refused at parse time, naming the flag and the fix.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_activation_checkpoint.py -q
"""

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import (
    AttentionSavingSAC,
    apply_activation_checkpointing,
    check_memory_policy,
    SaveEveryMatmulSAC,
    save_attention,
)

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import compile_sac_block  # noqa: E402

MM = torch.ops.aten.mm.default
LLAMA = "torchtitan_neuron.experiments.graph_trainer.llama3"


class Block(nn.Module):
    """Four matmuls in a row, as a block's projections are."""

    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x):
        for proj in self.proj:
            x = torch.tanh(proj(x))
        return x


def Model(block=Block) -> nn.Module:
    """compile_sac_block's two-block model, with ``block``s."""
    model = compile_sac_block.Model()
    model.layers = nn.ModuleDict({"0": block(), "1": block()})
    return model


def _op_counts(op, block, apply, x, partition_fn=None) -> tuple[int, int]:
    """Calls of ``op`` in the forward and backward graph of one compiled step
    of a two-block model of ``block``s, after ``apply(model)``."""
    counts = {}

    def recorder(kind):
        def compile_graph(gm, _inputs):
            counts[kind] = Counter(n.target for n in gm.graph.nodes)[op]
            return make_boxed_func(gm.forward)
        return compile_graph

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model(block)
    apply(model)
    kwargs = {"partition_fn": partition_fn} if partition_fn else {}
    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"), **kwargs)
    torch.compile(model, backend=backend)(x.requires_grad_()).sum().backward()
    return counts["fw"], counts["bw"]


def _matmuls(memory_policy: str, partition_fn=None) -> tuple[int, int]:
    """Matmuls in the forward and backward graph of one compiled step."""
    return _op_counts(MM, Block, lambda m: apply_activation_checkpointing(
        m, SelectiveAC.Config(), "", memory_policy), torch.randn(8, 16), partition_fn)


# aot_eager's partitioner and inductor's (min-cut) both follow the tags.
@pytest.mark.parametrize("partition_fn", [None, min_cut_rematerialization_partition],
                         ids=["default_partition", "min_cut"])
def test_selective_ac_recomputes_what_the_memory_policy_says(partition_fn):
    # 8 forward matmuls; backward has 2 per forward matmul (input and weight
    # gradients), plus the recomputed ones.
    assert _matmuls("default", partition_fn) == (8, 16)
    # torchtitan's eager policy recomputes the 2nd and 4th of each block.
    assert _matmuls("eager", partition_fn) == (8, 16 + 4)


CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class AttentionBlock(nn.Module):
    """A projection, causal SDPA (CPU's flash kernel), a projection."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48, bias=False), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn.transpose(1, 2).reshape(2, 8, 16))


def _attention_calls(apply) -> tuple[int, int]:
    """CPU flash attention forward calls in the forward and backward graph."""
    return _op_counts(CPU_FLASH, AttentionBlock, apply, torch.randn(2, 8, 16))


@pytest.mark.parametrize("memory_policy", ["default", "eager"])
def test_selective_ac_saves_cpu_attention(memory_policy):
    # torchtitan's SelectiveAC as it is: CPU attention runs again in backward.
    assert _attention_calls(lambda m: SelectiveAC(SelectiveAC.Config()).apply(m)) == (2, 2)
    assert _attention_calls(lambda m: apply_activation_checkpointing(
        m, SelectiveAC.Config(), "", memory_policy)) == (2, 0)


def test_only_torchtitans_own_selective_policy_is_promoted():
    # The memory policy is a visible choice: a SelectiveAC subclass, built
    # from the promoted config, not a method swapped on an instance.
    config = SelectiveAC.Config(preserve_rng_state=True)
    promoted = save_attention(config)
    assert type(promoted) is AttentionSavingSAC.Config and promoted.preserve_rng_state
    default = save_attention(config, "default")
    assert type(default) is SaveEveryMatmulSAC.Config and default.preserve_rng_state
    assert type(default.build()) is SaveEveryMatmulSAC
    assert type(save_attention(AttentionSavingSAC.Config(), "default")) is SaveEveryMatmulSAC.Config

    class MySAC(SelectiveAC):
        @dataclass(kw_only=True, slots=True)
        class Config(SelectiveAC.Config):
            pass

    for kept in (FullAC.Config(), None, MySAC.Config()):
        for policy in ("default", "eager"):
            assert save_attention(kept, policy) is kept


def test_the_two_policies_never_share_a_cache_entry():
    hashes = {}
    for policy in ("default", "eager"):
        model = Model()
        apply_activation_checkpointing(model, SelectiveAC.Config(), "", policy)
        fns = {block.checkpoint_fn.keywords["context_fn"] for block in model.layers.values()}
        assert len(fns) == 1
        hashes[policy] = fns.pop().cache_hash
    assert hashes["default"] != hashes["eager"]


def test_memory_policies_jit_mode_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="--compile.memory_policy full is applied by "
                       "graph_trainer's aot_fx_trace mode only.*use a _fullac recipe"):
        check_memory_policy(SelectiveAC.Config(), "full")
    with pytest.raises(ValueError, match="sac_and_offload"):
        check_memory_policy(SelectiveAC.Config(), "sac_and_offload")
    for ac, name in ((FullAC.Config(), "full"), (None, "none")):
        with pytest.raises(ValueError, match="--compile.memory_policy default chooses what "
                           f"selective activation checkpointing saves, but this recipe's is {name}"):
            check_memory_policy(ac, "default")
        # eager, the default, leaves full or no AC as it is.
        check_memory_policy(ac, "eager")


def test_recipe_with_a_refused_memory_policy_fails_at_parse_time(capsys):
    with pytest.raises(SystemExit) as exc:
        ConfigManager().parse_args(["--module", LLAMA, "--config", "simple_fsdp_llama3_8b_fullac",
                                    "--compile.memory_policy", "default"])
    assert exc.value.code != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "but this recipe's is full" in err
    # The recipes' selective AC is torchtitan's policy unless the flag says otherwise.
    config = ConfigManager().parse_args(["--module", LLAMA, "--config", "simple_fsdp_llama3_8b"])
    assert config.compile.memory_policy == "eager"
    config = ConfigManager().parse_args(["--module", LLAMA, "--config", "simple_fsdp_llama3_8b",
                                         "--compile.memory_policy", "default"])
    assert config.compile.memory_policy == "default"
