"""Quantized weights in their stored form (no models, no kernels)."""
