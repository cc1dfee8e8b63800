"""Generation-length predictors behind one protocol.

A predictor maps a request to (L, u): L the predicted number of generated tokens, u >= 0 an
uncertainty score. The allocator inflates L' = L x (1 + alpha x u) and sends u > tau to the large
bucket, so every predictor here states u in the same unit: the *relative distance from L to the
predictor's upper coverage quantile* (by default 95 %). With alpha = 1, L' is that quantile.

After a request completes, the runtime calls observe(request, generated_tokens); predictors that
learn use it, the others ignore it.

A model-based predictor (the paper's DistilBERT-scale encoder) plugs in the same way: implement
`predict(request) -> (L, u)` from `request.text` and metadata, e.g. L from the regression head and
u = q_hi / L - 1 from the quantile of the bucket-classification head's distribution; and
`observe` as a no-op or an online-fine-tuning hook.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Protocol, runtime_checkable

import numpy as np

from odma_cli.errors import BadArgument

# one-sided standard-normal quantile for the default 95 % coverage
_Z95 = 1.6448536269514722


@dataclasses.dataclass(frozen=True)
class Request:
    """What a predictor may look at. `generated_tokens` is the truth: only oracles read it (and
    replays, which know it from the trace)."""

    request_id: object
    prompt_tokens: int
    generated_tokens: int | None = None
    text: str | None = None
    metadata: dict | None = None


@runtime_checkable
class LengthPredictor(Protocol):
    name: str

    def predict(self, request: Request) -> tuple[float, float]:
        """(predicted generated tokens L >= 0, uncertainty u >= 0; math.inf = no idea)."""

    def observe(self, request: Request, generated_tokens: int) -> None:
        """Learn from one completed request."""


class OraclePredictor:
    """Knows the realized length: (L, 0). The upper bound on what prediction can give."""

    name = "oracle"

    def predict(self, request: Request) -> tuple[float, float]:
        if request.generated_tokens is None:
            raise BadArgument("the oracle predictor needs requests with generated_tokens")
        return float(request.generated_tokens), 0.0

    def observe(self, request: Request, generated_tokens: int) -> None:
        pass


class NoisyOraclePredictor:
    """The realized length times log-normal noise exp(sigma x z), seeded: a stand-in for a trained
    model with known error. u = exp(z_cov x sigma) - 1, the relative distance to the 95 % upper
    bound of the truth given the prediction."""

    name = "noisy"

    def __init__(self, sigma: float = 0.3, seed: int = 0):
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise BadArgument(f"sigma must be a finite number >= 0, got {sigma!r}")
        self.sigma = sigma
        self._rng = np.random.default_rng(seed)
        self._u = math.exp(_Z95 * sigma) - 1.0

    def predict(self, request: Request) -> tuple[float, float]:
        if request.generated_tokens is None:
            raise BadArgument("the noisy-oracle predictor needs requests with generated_tokens")
        z = self._rng.standard_normal()
        return request.generated_tokens * math.exp(self.sigma * z), self._u

    def observe(self, request: Request, generated_tokens: int) -> None:
        pass


def prompt_bin(prompt_tokens: int) -> int:
    """Half-octave bins of prompt length: 0, 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-23, ..."""
    b = prompt_tokens.bit_length()
    if b < 2:
        return b
    return 2 * b + ((prompt_tokens >> (b - 2)) & 1)


class OnlinePredictor:
    """Learns from realized lengths: per half-octave prompt-length bin, the median (L) and the
    upper `coverage` quantile (q) of the generated lengths of the last `window_per_bin` completions
    in that bin; u = q / L - 1. Bins with fewer than `min_samples` fall back to all bins together;
    before `min_samples` completions at all it answers (0, inf): no idea, use the large bucket.

    Tables are recomputed every `refresh_every` observations, so predict() is a dict lookup.
    """

    name = "online"

    def __init__(self, *, coverage: float = 0.95, window_per_bin: int = 2_000,
                 global_window: int = 10_000, min_samples: int = 50, refresh_every: int = 200):
        if not 0.5 < coverage < 1:
            raise BadArgument(f"coverage must be in (0.5, 1), got {coverage!r}")
        self.coverage = coverage
        self.min_samples = min_samples
        self.refresh_every = refresh_every
        self._bins: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=window_per_bin))
        self._all: collections.deque = collections.deque(maxlen=global_window)
        self._table: dict[int, tuple[float, float]] = {}
        self._fallback: tuple[float, float] = (0.0, math.inf)
        self._since = 0

    def predict(self, request: Request) -> tuple[float, float]:
        return self._table.get(prompt_bin(request.prompt_tokens), self._fallback)

    def observe(self, request: Request, generated_tokens: int) -> None:
        self._bins[prompt_bin(request.prompt_tokens)].append(generated_tokens)
        self._all.append(generated_tokens)
        self._since += 1
        # refresh often while learning, then every refresh_every observations
        if self._since >= self.refresh_every or len(self._all) == self.min_samples:
            self._since = 0
            self.refresh()

    def _estimate(self, samples) -> tuple[float, float]:
        median, q = np.quantile(np.fromiter(samples, float, len(samples)), [0.5, self.coverage])
        median = max(1.0, float(median))
        return median, max(0.0, float(q) / median - 1.0)

    def refresh(self) -> None:
        if len(self._all) < self.min_samples:
            return
        self._fallback = self._estimate(self._all)
        self._table = {b: self._estimate(d) for b, d in self._bins.items()
                       if len(d) >= self.min_samples}


PREDICTORS = {"oracle": OraclePredictor, "noisy": NoisyOraclePredictor, "online": OnlinePredictor}


def after_preemption(predicted: tuple[float, float], made: int) -> tuple[float, float]:
    """A preempted request's prediction for its rerun: mispredicted, as seen, it makes more
    than the `made` tokens it reached, and nobody knows how much more (an uncertainty of inf
    sends it to ODMA's large bucket, as the paper routes overflows)."""
    return max(predicted[0], made + 1.0), math.inf


def make_predictor(name: str, *, seed: int = 0, sigma: float = 0.3) -> LengthPredictor:
    """A predictor by name; `sigma` is the noisy oracle's log-normal error."""
    if name == "oracle":
        return OraclePredictor()
    if name == "noisy":
        return NoisyOraclePredictor(sigma=sigma, seed=seed)
    if name == "online":
        return OnlinePredictor()
    raise BadArgument(f"unknown predictor {name!r}: expected one of {', '.join(PREDICTORS)}")
