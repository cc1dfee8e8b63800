"""Placement policies of the contiguous pool, and the contiguous allocators built on them.

A policy answers two questions in tokens, never in bytes: how large a new request's block is
(place) and where a request that outgrew its block goes (overflow); it may learn from completed
requests (learn). ContiguousPool (contiguous.py) does everything else.

- OdmaPolicy (the paper, sections 3.3/3.4): L' = L x (1 + alpha x u); u > tau goes to the large
  bucket; otherwise the smallest regular bucket whose bound holds L' (a prediction beyond the top
  bound also goes large). Bounds count generated tokens by default (the paper's Eq. 2: the block
  holds prompt + bound) or whole footprints (bucket_basis="footprint"). A large block holds
  prompt + the longest generation in the bucket window (max_tokens before any data), capped at
  max_tokens; a large block outgrown doubles its generated part. Cold start, the first
  refresh_every completions: by default (cold_start="prediction") a block is sized by the
  inflated prediction itself, rounded up to the token alignment, while the buckets refresh early
  (QuantileBuckets.learning) so that large blocks soon stop reserving max_tokens;
  cold_start="equal-width" is the paper's rule: equal-width bounds up to max_tokens until the
  first periodic refresh, which hands a request predicting 30 tokens a max_tokens / n_buckets
  block.
- StaticPolicy: every request reserves max_tokens (Orca "Max", FasterTransformer,
  Cambricon-vLLM's static mode). Never migrates.
- S3Policy: static, equal-width buckets over (0, max_tokens] (S3, NeurIPS 2023) in the same bucket
  basis as ODMA; the bucket of L (no inflation, no large bucket). S3 preempts a request that
  outgrows its bucket and reruns it bigger; here the overflow moves it to the smallest bucket
  that holds it (a migration), the cheaper of the two.
- OraclePolicy: exactly prompt + L tokens (with the oracle predictor: the realized length), the
  upper bound on utilization of any contiguous policy.

RacmAllocator, StaticAllocator, S3Allocator and OracleAllocator are a ContiguousPool with that
policy. ExtentAllocator (extent.py) places its first extent with OdmaPolicy, so it imports this
module; the registry of the names users give (allocator/policies.py) imports both.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

from allocator.buckets import QuantileBuckets, align_up, equal_width_bounds
from allocator.config import AllocatorConfig, check_config
from allocator.contiguous import ContiguousPool

LARGE = "large"


class Placement(NamedTuple):
    """A policy's answer: the block's label and capacity (tokens), whether it goes to the large
    region first (then the regular one) or to the regular region only, and the prediction it
    was sized by in the bucket basis (None when the prediction was not used)."""

    bucket: object
    capacity: int
    large: bool = False
    key: float | None = None


class Policy:
    """Base of the placement policies: no buckets, no large region, nothing learned."""

    name = "?"
    large_share = 0.0
    buckets: QuantileBuckets | None = None

    def __init__(self, max_tokens: int, config: AllocatorConfig):
        self.max_tokens = max_tokens
        self.config = config

    def place(self, prompt: int, predicted: float, u: float) -> Placement:
        raise NotImplementedError

    def overflow(self, block, need: int) -> Placement:
        raise NotImplementedError

    def learn(self, block, total: int) -> None:
        """A request completed with `total` tokens (prompt + generated) in `block`."""

    def close(self) -> None:
        """Stop whatever the policy runs (a refresher thread)."""


class OdmaPolicy(Policy):
    name = "odma"

    def __init__(self, max_tokens, config, buckets: QuantileBuckets | None = None):
        super().__init__(max_tokens, config)
        self.large_share = config.large_share
        self._by_generated = config.bucket_basis == "generated"
        self._owns_buckets = buckets is None
        if buckets is None:
            buckets = QuantileBuckets.from_config(max_tokens, config)
        self.buckets = buckets

    def place(self, prompt, predicted, u):
        b = self.buckets
        if u > self.config.tau:
            return Placement(LARGE, b.large_capacity(prompt, prompt + 1), True)
        # at most max_tokens: a huge alpha or uncertainty must not overflow what follows
        inflated = min(max(1.0, predicted * (1.0 + self.config.alpha * u)), float(self.max_tokens))
        offset = 0 if self._by_generated else prompt   # bound = generated or footprint tokens
        key = offset + inflated
        bounds = b.bounds
        i = bisect.bisect_left(bounds, key)
        if b.learning and b.completions < b.refresh_every:  # cold: follow the prediction
            cap = align_up(math.ceil(prompt + inflated), b.alignment)
            if cap <= self.max_tokens:
                return Placement(min(i, len(bounds) - 1), cap, False, key)
        elif i < len(bounds):
            cap = bounds[i] + prompt - offset
            if cap <= self.max_tokens:
                return Placement(i, cap, False, key)
        need = min(self.max_tokens, math.ceil(prompt + inflated))
        return Placement(LARGE, b.large_capacity(prompt, need), True, key)

    def overflow(self, block, need):
        if block.bucket == LARGE:  # outgrew the large block too: double the generated part
            need = block.prompt_tokens + 2 * (need - block.prompt_tokens)
        return Placement(LARGE, self.buckets.large_capacity(block.prompt_tokens, need), True)

    def learn(self, block, total):
        gen = total - block.prompt_tokens
        self.buckets.record(gen if self._by_generated else total, block.predicted, gen,
                            block.prompt_tokens)

    def close(self):
        if self._owns_buckets:
            self.buckets.close()


class StaticPolicy(Policy):
    name = "static"

    def place(self, prompt, predicted, u):
        return Placement("static", self.max_tokens)

    def overflow(self, block, need):  # unreachable: a block holds max_tokens
        return Placement("static", self.max_tokens)


class OraclePolicy(Policy):
    name = "oracle"

    def place(self, prompt, predicted, u):
        return Placement("exact", min(self.max_tokens, prompt + max(1, math.ceil(predicted))))

    def overflow(self, block, need):
        return Placement("exact", need)


class S3Policy(Policy):
    name = "s3"

    def __init__(self, max_tokens, config):
        super().__init__(max_tokens, config)
        c = config
        self.buckets = QuantileBuckets(
            max_tokens, c.n_buckets, alignment=c.token_alignment, frozen=True, background=False,
            initial=equal_width_bounds(max_tokens, c.n_buckets, c.token_alignment))
        self._by_generated = config.bucket_basis == "generated"

    def _bucket(self, prompt: int, key: float) -> Placement:
        bounds = self.buckets.bounds
        offset = 0 if self._by_generated else prompt
        i = min(bisect.bisect_left(bounds, offset + key), len(bounds) - 1)
        return Placement(i, min(self.max_tokens, bounds[i] + prompt - offset), False,
                         offset + key)

    def place(self, prompt, predicted, u):
        return self._bucket(prompt, max(1.0, predicted))

    def overflow(self, block, need):
        p = self._bucket(block.prompt_tokens, need - block.prompt_tokens)
        return p._replace(key=None)


class PolicyAllocator(ContiguousPool):
    """A ContiguousPool whose policy is `policy_class(max_tokens, config)`."""

    policy_class: type = Policy

    def __init__(self, device, pool_bytes, bytes_per_token, max_tokens, config=None):
        self.config = config = check_config(config)
        super().__init__(device, pool_bytes, bytes_per_token, max_tokens,
                         self._make_policy(max_tokens, config),
                         byte_alignment=config.byte_alignment,
                         copy_chunk_bytes=config.copy_chunk_bytes)

    def _make_policy(self, max_tokens, config):
        return self.policy_class(max_tokens, config)


class RacmAllocator(PolicyAllocator):
    """The ODMA allocator: contiguous, predicted-length blocks in quantile buckets, a large
    bucket, allocate-and-copy migration. `buckets` shares one QuantileBuckets between several
    allocators (a cluster); they are then fed and refreshed together and not closed here."""

    def __init__(self, device, pool_bytes, bytes_per_token, max_tokens, config=None, *,
                 buckets: QuantileBuckets | None = None):
        self._shared_buckets = buckets
        super().__init__(device, pool_bytes, bytes_per_token, max_tokens, config)

    def _make_policy(self, max_tokens, config):
        return OdmaPolicy(max_tokens, config, self._shared_buckets)


class StaticAllocator(PolicyAllocator):
    """Static worst-case reservation: every request gets max_tokens."""

    policy_class = StaticPolicy


class OracleAllocator(PolicyAllocator):
    """Exactly prompt + L tokens: the utilization bound of contiguous allocation."""

    policy_class = OraclePolicy


class S3Allocator(PolicyAllocator):
    """S3: static equal-width buckets over (0, max_tokens], mispredictions migrate."""

    policy_class = S3Policy
