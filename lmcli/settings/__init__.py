"""Decoding settings: the one table of settings (types, ranges, off values and every name: flag, row key,
generation_config.json key, GGUF key, OpenAI field), the model's own defaults read from its files,
a structured-output constraint as a checked setting, and GenerationSettings layered from them.
Torch-free, below the models and generation.
"""
