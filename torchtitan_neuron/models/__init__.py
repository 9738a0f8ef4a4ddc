"""Neuron Trainer recipes: plain FSDP (torchtitan's ``fully_shard``), eager and compiled."""
