"""Which model is this: `-c PATH` / `-m NAME` resolved once into a ResolvedModel (path, kind, config and
tokenizer source, the model's defaults, its fingerprint), model names searched in lmcli's models
directory, the packaged real models and the HF hub cache, and the embedded default model.
"""
