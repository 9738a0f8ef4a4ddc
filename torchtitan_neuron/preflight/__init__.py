"""The checks a run passes in one process before any rank starts
(``python -m torchtitan_neuron.preflight``, which ``run_train.sh`` runs
first; ``checks`` lists what each refuses):

- ``recipe``: MODULE imports and has CONFIG;
- ``layout`` and ``model_layout``: NGPU, the parallel degrees, the model's
  heads and experts per degree, the sequence and the batch;
- ``data``: the tokenizer, the dataset, a multi-node endpoint;
- ``hf_import``: a Hugging Face folder the run starts from;
- ``host_memory``: a Trainium-sized run on a CPU host, refused by its
  sharded state;
- ``errors``: ``PreflightError`` and the exit code.
"""

from torchtitan_neuron.preflight.checks import SIMULATED_COMM_MODES, main, run_checks
from torchtitan_neuron.preflight.data import (
    check_dataset,
    check_endpoint,
    check_json_lines,
    check_tokenizer,
)
from torchtitan_neuron.preflight.errors import EXIT_USAGE, PreflightError
from torchtitan_neuron.preflight.hf_import import check_hf_import
from torchtitan_neuron.preflight.layout import check_layout, check_ngpu
from torchtitan_neuron.preflight.recipe import RECIPE_MODULES, check_recipe

__all__ = [
    "EXIT_USAGE", "RECIPE_MODULES", "SIMULATED_COMM_MODES", "PreflightError",
    "check_dataset", "check_endpoint", "check_hf_import", "check_json_lines",
    "check_layout", "check_ngpu", "check_recipe", "check_tokenizer", "main", "run_checks",
]
