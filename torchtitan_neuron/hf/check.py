"""
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
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--zero-expert-bias", action="store_true",
                        help="zero the MoE expert-selection bias of the project's model "
                             "after loading (transformers' DeepSeek-V2 and GPT-OSS have "
                             "none): compares every other tensor")
    opts, trainer_args = parser.parse_known_args(argv)

    from transformers import AutoModelForCausalLM

    config, model, adapter = build_model(opts.module, opts.config, trainer_args)
    reference = AutoModelForCausalLM.from_pretrained(str(opts.hf), dtype=torch.float32).eval()
    if opts.checkpoint:
        load_weights(model, opts.checkpoint, adapter)
        if opts.zero_expert_bias:
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if name.endswith("expert_bias_E"):
                        buffer.zero_()
    inputs, labels = next(batches(config, opts.batch_size, 1))
    tokens = inputs["input"]
    with torch.no_grad():
        theirs = reference(input_ids=tokens).logits.float()
        line = f"transformers_loss={F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).item():.8f}"
        if opts.checkpoint:
            ours = model(tokens).float()
            a = F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).item()
            b = F.cross_entropy(ours.flatten(0, 1), labels.flatten()).item()
            agree = int((theirs.argmax(-1) == ours.argmax(-1)).sum())
            line += (f" project_loss={b:.8f} rel={abs(a - b) / abs(b):.3e} "
                     f"argmax_agree={agree}/{tokens.numel()} "
                     f"max_logit_diff={(theirs - ours).abs().max().item():.3e}")
    print(line, flush=True)
    return 0
