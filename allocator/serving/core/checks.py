"""Settings no Scheduler can run, refused in one line before any work."""

from __future__ import annotations

from odma_cli.errors import BadArgument

PREEMPTION = ("recompute", "swap")


def check_scheduling(max_batch: int, max_batched_tokens: int | None,
                     concurrency: int | None, replicas: int = 1, *,
                     preemption: str = "recompute", swap_bytes: int = 0,
                     cobatch: int = 0) -> None:
    """BadArgument for settings no scheduler can run: vLLM's rule that a step's token budget
    holds at least one decode token per running request; a closed loop's places split evenly
    over the replicas; a known preemption mode, a swap space of whole bytes >= 0 and a
    co-batching window of whole requests >= 0."""
    if not (isinstance(cobatch, int) and cobatch >= 0):
        raise BadArgument(f"the co-batching window must be a whole number of requests >= 0, "
                          f"got {cobatch!r}")
    if preemption not in PREEMPTION:
        raise BadArgument(f"unknown preemption mode {preemption!r}: expected one of "
                          f"{', '.join(PREEMPTION)}")
    if not (isinstance(swap_bytes, int) and swap_bytes >= 0):
        raise BadArgument(f"the swap space must be a whole number of bytes >= 0, got "
                          f"{swap_bytes!r}")
    if max_batched_tokens is not None and not (isinstance(max_batched_tokens, int)
                                               and max_batched_tokens >= max_batch):
        raise BadArgument(f"--max-num-batched-tokens {max_batched_tokens} must be an integer of "
                          f"at least --max-batch ({max_batch}): every running request decodes "
                          f"one token per step within that budget")
    if concurrency is not None and not (isinstance(concurrency, int) and concurrency >= 1):
        raise BadArgument(f"--concurrency must be a positive integer, got {concurrency!r}")
    if concurrency is not None and concurrency % replicas:
        raise BadArgument(f"--concurrency {concurrency} does not split evenly over {replicas} "
                          f"replicas (each keeps its share in flight)")
