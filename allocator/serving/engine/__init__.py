"""The real engine: a transformers decoder served on a torch device by the core's Scheduler
(allocator.serving.core), every KV byte in the blocks of a real allocator.

serve.py (serve(): the executor and the run), runner.py (the batched forward pass), kv_runs.py
(each step's KV as run tables), run_attention.py and run_kernels.py (one attention over every
layout: torch and Triton), layer_kernels.py (the KV store and the fused layers' kernels),
launches.py (a step's kernel launches, counted), hf_reference.py (transformers' own continuous
batching, the peer), cli.py (`odma-hw engine`).
"""
