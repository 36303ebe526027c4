"""Training the built-in model pair: corpus + tokenizer, LM training and distillation, HF export.

Nothing here is imported by the engine; it needs optax (and ``tokenizers`` for the corpus).
"""
