"""The architectures: one shared decoder (base.py, layers.py) and a thin module per family."""
