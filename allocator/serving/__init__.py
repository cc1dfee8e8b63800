"""Serving simulation: tokens per second of continuous-batching LLM serving on a device, with
each KV allocation policy, from the allocators' real decisions and a memory timing model."""
