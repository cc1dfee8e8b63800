"""Building a Scheduler from a run's options: the one place the simulation and the engine turn
their settings into a Scheduler (check_scheduling refuses settings no scheduler can run)."""

from __future__ import annotations

import dataclasses

from allocator.policies import PolicySpec
from allocator.predictors import make_predictor
from allocator.serving.core.checks import check_scheduling
from allocator.serving.core.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class SchedulingOptions:
    """How a replica schedules: the batch and prefill limits, chunked prefill's token budget
    (None: prefill-first), the closed loop's places (None: open loop), the preemption mode and
    its host swap space, and the co-batching window (0: off)."""

    max_batch: int
    max_model_len: int
    max_prefill: int = 0            # 0: max(max_model_len, 2048), vLLM v0's default
    max_batched_tokens: int | None = None
    concurrency: int | None = None
    preemption: str = "recompute"
    swap_bytes: int = 0
    cobatch: int = 0

    def __post_init__(self):
        check_scheduling(self.max_batch, self.max_batched_tokens, self.concurrency,
                         preemption=self.preemption, swap_bytes=self.swap_bytes,
                         cobatch=self.cobatch)


def build_scheduler(policy: PolicySpec, alloc, requests: list, options: SchedulingOptions, *,
                    predictor: str, bytes_per_token: int, seed: int = 0, sigma: float = 0.3,
                    cache=None, schedule: str = "fcfs", prefetch: int = 0, tot=None,
                    migrate=None, log: list | None = None) -> Scheduler:
    """The Scheduler of one replica of `policy` on `alloc`: its predictor by name (the oracle
    for a policy that sizes by the realized length), the prefix cache and its schedule when
    given, `tot` the counter it and the executor share."""
    o = options
    return Scheduler(alloc, make_predictor(policy.predictor(predictor), seed=seed, sigma=sigma),
                     requests, policy=policy, max_batch=o.max_batch,
                     max_prefill=o.max_prefill or max(o.max_model_len, 2048),
                     bytes_per_token=bytes_per_token, cache=cache, schedule=schedule,
                     prefetch=prefetch, tot=tot, migrate=migrate, log=log,
                     max_batched_tokens=o.max_batched_tokens, concurrency=o.concurrency,
                     preemption=o.preemption, swap_bytes=o.swap_bytes, cobatch=o.cobatch)
