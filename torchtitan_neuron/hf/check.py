"""``python -m torchtitan_neuron.hf check``: a Hugging Face folder against
this project's model, on the recipe's first batch.

Prints ``transformers_loss=`` of ``--hf`` (with ``--adapter``, a peft LoRA
adapter applied on it) on the first ``--batch-size`` sequences of the
recipe's dataset, labels as the trainer has them (prompt tokens of chat
data are -100, out of the loss). Under block-causal attention each packed
document is run alone. With ``--checkpoint`` (a DCP ``step-N`` or an HF
export) it also prints the project model's loss on the same batch, the
relative difference, the argmax agreement and the largest logit difference.

    python -m torchtitan_neuron.hf check --module M --config C --hf FOLDER
        [--adapter FOLDER] [--checkpoint STEP] [--batch-size N] [trainer flags]
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_neuron.hf.model import batches, build_model, load_weights, recipe_parser


def check_main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_neuron.hf check``: see the module docstring."""
    parser = recipe_parser(__doc__)
    parser.add_argument("--hf", required=True, type=Path, help="a Hugging Face model folder")
    parser.add_argument("--checkpoint", type=Path, help="this project's weights to compare")
    parser.add_argument("--adapter", type=Path,
                        help="a peft LoRA adapter folder, applied to --hf with peft")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--zero-expert-bias", action="store_true",
                        help="zero the MoE expert-selection bias of the project's model "
                             "after loading (transformers' DeepSeek-V2 and GPT-OSS have "
                             "none): compares every other tensor")
    opts, trainer_args = parser.parse_known_args(argv)

    from transformers import AutoModelForCausalLM

    config, model, adapter = build_model(opts.module, opts.config, trainer_args)
    reference = AutoModelForCausalLM.from_pretrained(str(opts.hf), dtype=torch.float32).eval()
    if opts.adapter:
        from peft import PeftModel

        reference = PeftModel.from_pretrained(reference, str(opts.adapter)).eval()
    if opts.checkpoint:
        load_weights(model, opts.checkpoint, adapter)
        if opts.zero_expert_bias:
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if name.endswith("expert_bias_E"):
                        buffer.zero_()
    inputs, labels = next(batches(config, opts.batch_size, 1))
    tokens = inputs["input"]
    starts = _document_starts(config, tokens)
    with torch.no_grad():
        theirs = _logits(lambda t, pos: reference(input_ids=t, position_ids=pos).logits,
                         tokens, starts)
        line = f"transformers_loss={F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).item():.8f}"
        if starts is not None:
            line += f" documents={int(starts.sum())}"
        if opts.checkpoint:
            ours = _logits(lambda t, pos: model(t), tokens, starts)
            a = F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).item()
            b = F.cross_entropy(ours.flatten(0, 1), labels.flatten()).item()
            agree = int((theirs.argmax(-1) == ours.argmax(-1)).sum())
            line += (f" project_loss={b:.8f} rel={abs(a - b) / abs(b):.3e} "
                     f"argmax_agree={agree}/{tokens.numel()} "
                     f"max_logit_diff={(theirs - ours).abs().max().item():.3e}")
    print(line, flush=True)
    return 0


def _document_starts(config, tokens: torch.Tensor) -> torch.Tensor | None:
    """Where the batch's packed documents start, when the recipe attends
    block-causally (the trainer's boundaries); None otherwise."""
    if config.model.attn_mask_type != "block_causal":
        return None
    from torchtitan_neuron.components.documents import document_starts

    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    return document_starts(tokens, getattr(tokenizer, "bos_id", None),
                           getattr(tokenizer, "eos_id", None))


def _logits(forward, tokens: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """``forward(tokens, positions)`` in fp32; under block-causal attention,
    each packed document alone, at the positions it has in its row (what
    the trainer's block-causal mask computes)."""
    if starts is None:
        return forward(tokens, None).float()
    rows = []
    for row, start in zip(tokens, starts):
        cuts = [*start.nonzero().flatten().tolist(), row.numel()]
        rows.append(torch.cat([forward(row[None, a:b], torch.arange(a, b)[None]).float()
                               for a, b in zip(cuts, cuts[1:])], dim=1))
    return torch.cat(rows)
