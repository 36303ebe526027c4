"""C++ kernels for XLA:CPU (XLA FFI custom calls), each next to its numpy reference; built on first use.

They serve the derived CPU weight layout (:mod:`models.cpu_layout`); nothing else depends on them.
"""
