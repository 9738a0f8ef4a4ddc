"""GraphTrainer recipes, including SimpleFSDP on the Neuron JIT path."""
