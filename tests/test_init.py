"""Seeded initialization: a function of the seed and parameter names only.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_init.py -q
"""

import torch

from torchtitan_neuron.experiments.graph_trainer.llama3 import model_registry
from torchtitan_neuron.seeded_init import canonical_name, layout_invariant_init, parameter_seed


def _build(seed):
    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with layout_invariant_init(seed), torch.no_grad():
        model.init_weights(buffer_device=None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = _build(0), _build(0), _build(1)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    weights = [n for n in a if a[n].dim() >= 2]
    assert all(not torch.equal(a[n], c[n]) for n in weights)
    # Initializers' distributions are kept: norms are ones, weights are not.
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))
    assert 0.001 < a["layers.0.feed_forward.w1.weight"].std().item() < 0.1


def test_wrapper_names_do_not_change_a_parameter_seed():
    name = "layers.0._checkpoint_wrapped_module.attention.wo.weight"
    assert canonical_name(name) == "layers.0.attention.wo.weight"
    assert parameter_seed(0, canonical_name(name)) == parameter_seed(0, "layers.0.attention.wo.weight")
    assert parameter_seed(0, "a") != parameter_seed(1, "a")
