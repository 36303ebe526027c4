"""C++ kernels for XLA:CPU (XLA FFI custom calls), each next to its numpy reference; built on first use.

They serve a model on one CPU device in the derived weight layout (:mod:`models.cpu_layout`): the panel
matmul for its projections and head, the paged attention for its attention (``specjax.attention``), and the two
fused into one call per decoder layer where the layer has nothing else (``decoder_layer``, ``models.llama``).
"""
