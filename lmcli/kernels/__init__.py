"""How a quantized weight is multiplied: the kernels (packed int4 and int8 pairs, dequantise), the kernel
plan each weight kind gets (fixed by default, measured with --fast-kernels), the quantized linear,
head and embedding layers installed at load, and a loaded model's tree as data for the packed cache.
The stored form of a quantized weight is io/group_quantized.py's; the models sit above.
"""
