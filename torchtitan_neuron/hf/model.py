"""A recipe's model in one process on the CPU, from a saved checkpoint: what
``python -m torchtitan_neuron.hf export``, ``check`` and ``loss`` load.

``load_weights`` reads a DCP checkpoint folder (``.../checkpoint/step-N``,
full or model-only, any layout) or a Hugging Face safetensors export into the
recipe's model; ``batches`` gives the first batches of the recipe's dataset
as one rank of a 1-rank run reads them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

LOSS_DOC = """The recipe's loss of a checkpoint (DCP ``step-N`` or an HF export) on the
first ``--batches`` batches of ``--batch-size`` sequences of its dataset, in
one process on the CPU.

    python -m torchtitan_neuron.hf loss --module M --config C
        --checkpoint STEP [--batches 1] [--batch-size 2] [trainer flags]
"""


def load_weights(model: torch.nn.Module, checkpoint: Path, sd_adapter) -> str:
    if (checkpoint / "model.safetensors.index.json").exists() or any(
        checkpoint.glob("*.safetensors")
    ):
        from safetensors.torch import load_file

        if sd_adapter is None:
            raise SystemExit(
                f"{checkpoint} is a safetensors export, but this recipe's model has "
                "no Hugging Face state-dict adapter."
            )
        hf_state = {}
        for path in sorted(checkpoint.glob("*.safetensors")):
            hf_state.update(load_file(str(path)))
        state = sd_adapter.from_hf(hf_state)
        fmt = "safetensors"
    elif (checkpoint / ".metadata").exists():
        import torch.distributed.checkpoint as dcp

        state = {k: v for k, v in model.state_dict().items()}
        names = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
        prefix = "model." if any(n.startswith("model.") for n in names) else ""
        wanted = {prefix + k: v for k, v in state.items() if prefix + k in names}
        dcp.load(wanted, checkpoint_id=str(checkpoint), no_dist=True)
        state = {k[len(prefix):]: v for k, v in wanted.items()}
        fmt = "dcp"
    else:
        raise SystemExit(
            f"{checkpoint} is neither a DCP checkpoint (no .metadata) nor a "
            "safetensors export (no *.safetensors): pass a checkpoint/step-N folder."
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters()}
    missing_params = sorted(params & set(missing))
    if missing_params or unexpected:
        raise SystemExit(
            f"{checkpoint} does not match the recipe's model: missing "
            f"{missing_params[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return fmt


def build_model(module: str, recipe: str, trainer_args: list[str]):
    """(config, the recipe's model in fp32 on the CPU with its initial
    weights, its state-dict adapter or None)."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from torchtitan_neuron import devices

    init_logger()
    devices.install()
    config = ConfigManager().parse_args(["--module", module, "--config", recipe, *trainer_args])
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.eval()
    adapter = (
        spec.state_dict_adapter(model_config, config.hf_assets_path)
        if spec.state_dict_adapter
        else None
    )
    return config, model, adapter


def batches(config, batch_size: int, count: int):
    """The first ``count`` batches of ``batch_size`` sequences, as one rank
    of a 1-rank run reads them: a run's first global batch when
    ``batch_size`` is its global batch size (with the validator on, the
    training split, as the trainer reads it)."""
    from torchtitan_neuron.data import held_out_validation

    held_out_validation(config)
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer,
        seq_len=config.training.seq_len, local_batch_size=batch_size,
    )
    for i, batch in enumerate(loader):
        if i == count:
            return
        yield batch


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every one-process checkpoint script takes: the recipe
    (its trainer flags are left over for ``build_model``)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    return parser


def loss_main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_neuron.hf loss``: see ``LOSS_DOC``."""
    parser = recipe_parser(LOSS_DOC)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    opts, trainer_args = parser.parse_known_args(argv)

    config, model, adapter = build_model(opts.module, opts.config, trainer_args)
    fmt = load_weights(model, opts.checkpoint, adapter)

    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, labels in batches(config, opts.batch_size, opts.batches):
            logits = model(inputs["input"])
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
            ).item()
            count += labels.numel()
    print(f"format={fmt} sequences={count // config.training.seq_len} loss={total / count:.8f}")
    return 0
