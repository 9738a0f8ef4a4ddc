"""A training step traced on FakeTensors, the ground both tools stand on.

The memory planner (``torchtitan_neuron.plan``) and the Neuron rehearsal
(``torchtitan_neuron.rehearse``) each trace a recipe's own trainer for one
rank of N without a device; neither imports the other, and both import this:

- ``world``: the fake worlds (torchtitan's fake process group, or the neuron
  branch on the stand-in device) and the fake trainer;
- ``neuron_device``: the stand-in ``neuron`` device and process group;
- ``patches``: the patches of torch and torchtitan that tracing needs;
- ``random_tokens``: data of the recipe's vocabulary, with no tokenizer file;
- ``ops``: op names, user frames and recorded outputs of a traced graph;
- ``cli``: the command line both tools share (recipe, NGPU, target).
"""
