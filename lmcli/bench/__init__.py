"""`lmcli bench`: the engine comparison (lmcli, transformers, llama.cpp on the same weights) and its
sections (job, invariance, speculative, structured, startup, prefill, compiled), each engine in its
own worker process, the busy loops of --background-load, the synthetic models, and the tables.
It sits at the top, beside the commands: nothing below imports it.
"""
