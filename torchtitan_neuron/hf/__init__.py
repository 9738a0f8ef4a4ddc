"""Hand-off to the Hugging Face ecosystem: exports ``from_pretrained`` opens,
imports checked before a rank starts.

- ``config``: the transformers ``config.json`` of each family, and what its
  architecture can express;
- ``export``: ``config.json``, tokenizer and notes written beside an export,
  by the trainer (``--checkpoint.last_save_in_hf``) or after the fact;
- ``load``: an HF folder checked against the recipe's flavor before any rank;
- ``model``: a recipe's model in one process from a checkpoint;
- ``check``: a folder against this project's model, through transformers;
- ``download``: tokenizer, config or weights from the Hub.

``python -m torchtitan_neuron.hf export|check|loss|download ...`` runs them
(docs/hf.md).
"""

from torchtitan_neuron.hf.config import (
    HFExportError,
    coverage_gaps,
    family,
    transformers_config,
)
from torchtitan_neuron.hf.export import (
    bias_notes,
    export_config,
    finish_export,
    export_hand_off,
    write_hand_off,
)
from torchtitan_neuron.hf.load import (
    family_flavors,
    folder_shapes,
    import_refusal,
    unexpressed_import_skip,
)

__all__ = [
    "HFExportError", "bias_notes", "coverage_gaps", "export_config", "export_hand_off",
    "family", "family_flavors", "finish_export", "folder_shapes", "import_refusal",
    "transformers_config", "unexpressed_import_skip", "write_hand_off",
]
