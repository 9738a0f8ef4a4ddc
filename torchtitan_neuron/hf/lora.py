"""LoRA adapters out of a run and back in, in peft's format.

torchtitan's ``LoRAConverter`` (``components/lora.py``) gives each target
linear ``M`` two adapter matrices: ``M.lora_a.weight`` (rank x in) and
``M.lora_b.weight`` (out x rank); the layer computes
``W x + (alpha / rank) B A x``. The recipe's state-dict adapter (``to_hf``)
knows only the base weights. Here:

- ``LoRAMap.merged``: the state with every adapter folded into its base
  weight, ``W + (alpha / rank) B A`` (what ``--checkpoint.last_save_in_hf``
  writes: a plain model ``AutoModelForCausalLM`` opens);
- ``LoRAMap.to_peft`` / ``from_peft``: the adapter tensors under peft's
  names (``base_model.model.<HF module>.lora_A.weight``), what
  ``peft.PeftModel.from_pretrained`` opens on the base model, and back;
- ``LoRAMap.refusal``: why a peft folder cannot start this recipe's LoRA run.

graph_trainer's Llama fuses q, k and v into one ``wqkv`` (rows interleaved
per KV group, ``FusedQKVLinear``), which takes one adapter: the same
``lora_A`` for q, k and v, and ``lora_B`` split by rows as the fused weight
is split. An adapter whose q, k and v ``lora_A`` differ (one peft trained on
separate projections) has no fused form of the same rank; it is refused.

Names and row orders come from the recipe's own adapter: ``to_hf`` is run
on a tensor of row and column indices of each base weight, so a permutation
it applies (Llama's rotary q/k interleave) is read off, not restated here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

ADAPTER_FOLDER = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear: its fqn, rank and alpha, and the base weights its
    delta lands on (one, or q/k/v of a fused ``wqkv``)."""

    fqn: str
    rank: int
    alpha: float
    fused: SimpleNamespace | None  # head_dim, heads_per_kv, r_dim of a FusedQKVLinear

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def prefix(self) -> str:  # the parent's prefix, for the fused split
        return self.fqn.rsplit(".", 1)[0] + "."

    def base_keys(self) -> list[str]:
        if self.fused is None:
            return [f"{self.fqn}.weight"]
        return [f"{self.prefix}{w}.weight" for w in ("wq", "wk", "wv")]

    def split(self, fused_rows: torch.Tensor) -> list[torch.Tensor]:
        """``fused_rows`` (rows of ``wqkv``) as the base keys' rows."""
        if self.fused is None:
            return [fused_rows]
        from torchtitan.models.common.attention import FusedQKVLinear

        state = {f"{self.prefix}wqkv.weight": fused_rows}
        FusedQKVLinear._split_qkv_on_save(self.fused, state, self.prefix, None)
        return [state[k] for k in self.base_keys()]

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of ``split``."""
        if self.fused is None:
            return parts[0]
        from torchtitan.models.common.attention import FusedQKVLinear

        state = dict(zip(self.base_keys(), parts))
        FusedQKVLinear._merge_qkv_on_load(self.fused, state, self.prefix)
        return state[f"{self.prefix}wqkv.weight"]


def lora_modules(model_config) -> list[LoRAModule]:
    """Every LoRA linear of a converted model config; empty without LoRA."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.protocols.module import Module

    found = []
    for fqn, cfg, parent, _ in model_config.traverse(Module.Config, recurse=True):
        if not (hasattr(cfg, "rank") and hasattr(cfg, "alpha") and hasattr(cfg, "out_features")):
            continue
        fused = None
        if isinstance(parent, FusedQKVLinear.Config) and fqn.endswith(".wqkv"):
            hpk = parent.n_heads // parent.n_kv_heads
            fused = SimpleNamespace(head_dim=parent.head_dim, heads_per_kv=hpk, r_dim=hpk + 2)
        found.append(LoRAModule(fqn, int(cfg.rank), float(cfg.alpha), fused))
    return found


def is_lora_key(key: str) -> bool:
    return re.search(r"\.lora_[ab]\.weight$", key) is not None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _add(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight + delta`` in the weight's placement and dtype; ``delta`` is
    the same whole tensor on every rank, so each takes its own shard."""
    if hasattr(weight, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        delta = distribute_tensor(delta.to(weight.device), weight.device_mesh,
                                  weight.placements, src_data_rank=None)
    return (weight.float() + delta).to(weight.dtype)


class LoRAMap:
    """This recipe's LoRA tensors against peft's, through its ``to_hf``."""

    def __init__(self, modules: list[LoRAModule], sd_adapter, base_shapes: dict[str, tuple]):
        self.modules = modules
        self.sd_adapter = sd_adapter
        self.base_shapes = base_shapes
        self._orders: dict[str, tuple[str, torch.Tensor]] = {}
        self.exported: dict[str, torch.Tensor] | None = None

    @classmethod
    def for_model(cls, model_spec, model_config, sd_adapter) -> "LoRAMap | None":
        modules = lora_modules(model_config)
        if not modules or sd_adapter is None:
            return None
        from torchtitan_neuron.hf.config import meta_state

        shapes = {k: tuple(v.shape) for k, v in meta_state(model_spec, model_config).items()}
        return cls(modules, sd_adapter, shapes)

    @property
    def rank(self) -> int:
        return self.modules[0].rank

    @property
    def alpha(self) -> float:
        return self.modules[0].alpha

    # ---- names and row orders ------------------------------------------------

    def _hf(self, key: str) -> tuple[str, torch.Tensor]:
        """(the HF name of base weight ``key``, the row of ``key`` each HF row
        holds)."""
        abstract = re.sub(r"\d+", "{}", key, count=1)
        if abstract not in self._orders:
            rows, cols = self.base_shapes[key]
            index = torch.arange(rows * cols, dtype=torch.int32).view(rows, cols)
            (name, moved), = self.sd_adapter.to_hf({key: index}).items()
            if not torch.equal(moved % cols, index % cols):
                raise ValueError(f"the state-dict adapter reorders the columns of {key}; "
                                 "its LoRA adapter cannot be written in peft's format")
            self._orders[abstract] = (re.sub(r"\d+", "{}", name, count=1),
                                      (moved[:, 0] // cols).long())
        template, order = self._orders[abstract]
        number = re.search(r"\d+", key)
        return template.format(number.group(0)) if number else template, order

    def peft_names(self, key: str) -> tuple[str, str]:
        """peft's (lora_A, lora_B) names for the adapter of base weight ``key``."""
        name = self._hf(key)[0].removesuffix(".weight")
        return f"{PEFT_PREFIX}{name}.lora_A.weight", f"{PEFT_PREFIX}{name}.lora_B.weight"

    def target_modules(self) -> list[str]:
        return sorted({self._hf(k)[0].removesuffix(".weight").rsplit(".", 1)[-1]
                       for m in self.modules for k in m.base_keys()})

    def peft_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for module in self.modules:
            for key in module.base_keys():
                rows, cols = self.base_shapes[key]
                a, b = self.peft_names(key)
                shapes[a], shapes[b] = (module.rank, cols), (rows, module.rank)
        return shapes

    # ---- out -------------------------------------------------------------------

    def merged(self, state: dict) -> dict:
        """``state`` with each adapter folded into its base weights and the
        adapter tensors left out. Every rank calls it (the adapters are
        gathered whole); the peft tensors are kept in ``exported``."""
        out = dict(state)
        exported = {}
        for module in self.modules:
            a = _full(out.pop(f"{module.fqn}.lora_a.weight")).float()
            b = _full(out.pop(f"{module.fqn}.lora_b.weight")).float()
            parts = module.split(module.scaling * (b @ a))
            for key, delta, b_part in zip(module.base_keys(), parts, module.split(b)):
                out[key] = _add(out[key], delta)
                exported[key] = (a.cpu(), b_part.cpu())
        self.exported = exported
        return out

    def to_peft(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """{base key: (A, B in its rows)} as peft's tensors."""
        tensors = {}
        for key, (a, b) in adapters.items():
            name_a, name_b = self.peft_names(key)
            tensors[name_a] = a.clone()  # q, k and v each get their own copy
            tensors[name_b] = b[self._hf(key)[1]].contiguous()
        return tensors

    def adapter_config(self, base: str | None) -> dict:
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": self.target_modules(), "base_model_name_or_path": base,
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {},
        }

    def write_adapter(self, folder: str | Path, base: str | None, dtype: torch.dtype) -> Path:
        """The adapter of the last ``merged`` call as a peft folder
        ``<folder>/adapter``; returns it."""
        from safetensors.torch import save_file

        out = Path(folder) / ADAPTER_FOLDER
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(dtype) for k, v in self.to_peft(self.exported).items()}
        save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config(base), indent=2) + "\n")
        return out

    # ---- in --------------------------------------------------------------------

    def refusal(self, folder: str | Path, read_values: bool = True) -> str | None:
        """Why the peft folder cannot start this recipe's LoRA, or None."""
        folder = Path(folder)
        config_path, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
        if not config_path.is_file() or not weights.is_file():
            return (f"{folder} is not a peft adapter folder: it needs {ADAPTER_CONFIG} and "
                    f"{ADAPTER_WEIGHTS} (what --checkpoint.last_save_in_hf writes into "
                    f"step-N/{ADAPTER_FOLDER})")
        config = json.loads(config_path.read_text())
        if config.get("peft_type") != "LORA":
            return f"{config_path}: peft_type {config.get('peft_type')!r}, not 'LORA'"
        for field, ours in (("r", self.rank), ("lora_alpha", self.alpha)):
            if float(config.get(field, -1)) != float(ours):
                return (f"{config_path}: {field} {config.get(field)} where the recipe's LoRA "
                        f"has {ours}; the adapter does not fit this recipe's LoRA converter")
        from torchtitan_neuron.hf.load import folder_shapes

        found = {k.replace(".default.", "."): v for k, v in folder_shapes(folder).items()}
        want = self.peft_shapes()
        for name, shape in want.items():
            if name in found and tuple(found[name]) != shape:
                return (f"{weights}: {name} is {list(found[name])}, {list(shape)} expected: "
                        "the adapter was trained on another base model")
        missing, unexpected = sorted(set(want) - set(found)), sorted(set(found) - set(want))
        if missing or unexpected:
            return (f"{weights} does not match the recipe's LoRA targets "
                    f"({', '.join(self.target_modules())}): missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}")
        if read_values:
            try:
                self.from_peft(folder)
            except ValueError as exc:
                return str(exc)
        return None

    def from_peft(self, folder: str | Path) -> dict[str, torch.Tensor]:
        """A peft folder's tensors as this recipe's ``lora_a``/``lora_b``."""
        from safetensors.torch import load_file

        found = {k.replace(".default.", "."): v
                 for k, v in load_file(str(Path(folder) / ADAPTER_WEIGHTS)).items()}
        state = {}
        for module in self.modules:
            a_parts, b_parts = [], []
            for key in module.base_keys():
                name_a, name_b = self.peft_names(key)
                b_hf = found[name_b]
                b = torch.empty_like(b_hf)
                b[self._hf(key)[1]] = b_hf
                a_parts.append(found[name_a])
                b_parts.append(b)
            if any(not torch.equal(a, a_parts[0]) for a in a_parts[1:]):
                names = ", ".join(self.peft_names(k)[0].rsplit(".", 3)[-3] for k in module.base_keys())
                raise ValueError(
                    f"{Path(folder) / ADAPTER_WEIGHTS}: the lora_A of {names} in "
                    f"{module.prefix.rstrip('.')} differ; this recipe fuses them into "
                    "one wqkv, which takes one lora_A for all three. Adapters this project "
                    "wrote share it; one trained on separate projections cannot continue here")
            state[f"{module.fqn}.lora_a.weight"] = a_parts[0]
            state[f"{module.fqn}.lora_b.weight"] = module.join(b_parts)
        return state


def load_into(model_parts, state: dict[str, torch.Tensor]) -> int:
    """Copy whole tensors into the (possibly sharded) parameters they name;
    returns how many were copied."""
    copied = 0
    for part in model_parts:
        for name, param in part.named_parameters():
            # (names as the state dict gives them: no wrapper segments)
            name = re.sub(r"(_checkpoint_wrapped_module|_orig_mod)\.", "", name)
            if name not in state:
                continue
            value = state[name]
            with torch.no_grad():
                if hasattr(param, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    shard = distribute_tensor(value.to(param.device, param.dtype),
                                              param.device_mesh, param.placements,
                                              src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(value.to(param.device, param.dtype))
            copied += 1
    return copied


def adapter_loader(trainer):
    """What ``NeuronCheckpointManager.adapter_load`` runs for
    ``--checkpoint.initial_load_adapter``, or None without it."""
    checkpointer = trainer.checkpointer
    folder = getattr(checkpointer, "initial_load_adapter", None)
    if not folder:
        return None
    spec = trainer.config.model_spec
    lora = LoRAMap.for_model(spec, spec.model, checkpointer.sd_adapter)
    if lora is None:
        raise ValueError(f"--checkpoint.initial_load_adapter {folder}: the recipe "
                         f"{trainer.config.model_spec.name} has no LoRA adapters to load it into")

    def load() -> None:
        from torchtitan.tools.logging import logger

        copied = load_into(trainer.model_parts, lora.from_peft(folder))
        logger.info(f"Loaded the LoRA adapters of {folder} ({copied} tensors on this rank)")

    return load
