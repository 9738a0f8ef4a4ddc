"""Model building blocks: rotary embeddings, MoE, expert kernels, document
attention and the model-config shaping every recipe applies.

They sit below the trainer and the recipes and import neither, so the trainer
can use them and every recipe module can build on them
(``tests/test_layers.py`` checks the layering).
"""
