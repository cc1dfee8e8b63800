"""Regular-bucket bounds learned from realized request lengths (ODMA section 3.3).

A bound is a number of tokens in the allocator's bucket basis: generated tokens (the paper's
Eq. 2: quantiles of realized generation lengths; a block holds prompt + bound) or the whole KV
footprint (prompt + generated; a block holds exactly the bound). A request goes to the smallest
bucket whose bound holds its inflated prediction. Bounds
are refreshed from a sliding window of completed requests; a refresh publishes a new tuple (never
mutates the old one), so a reservation sees either the old or the new bounds, and blocks already
handed out keep their capacity.

Two rules pick the bounds from the window:

- "occupancy" (the paper's): bound i is the (i/K)-quantile of realized footprints, so each bucket
  would hold about the same number of requests if predictions were exact.
- "min-waste" (ours): choose up to K bounds that minimise the expected reserved-but-unused tokens
  of the requests in the window *given the predictions that were actually made for them*: a
  request predicted into bucket b wastes b - realized when it fits, and when it outgrows b it pays
  a migration (its large block's waste plus `migration_penalty` x the mean footprint: the copy),
  and one predicted above the top bound goes to the large bucket. The cost separates
  over buckets, so an exact dynamic programme over candidate bounds (quantiles of the predicted
  footprints) finds the optimum in K x C^2 steps (C <= 256 candidates).
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

from odma_cli.errors import BadArgument

RULES = ("occupancy", "min-waste")
_NAN = float("nan")


def align_up(x, alignment: int):
    return -(-x // alignment) * alignment


# Bounds are learned from a window of completions (10,000 by default), and the min-waste rule
# picks them among 257 quantiles of it: more regular buckets than this cannot be told apart,
# while each one costs a pass of every refresh (a hundred million took 104 s to set up).
MAX_BUCKETS = 256


def _check_buckets(n_buckets) -> None:
    if not isinstance(n_buckets, int) or isinstance(n_buckets, bool) or \
            not 1 <= n_buckets <= MAX_BUCKETS:
        raise BadArgument(f"n_buckets must be an integer from 1 to {MAX_BUCKETS}, got "
                          f"{n_buckets!r}")


def equal_width_bounds(max_tokens: int, n_buckets: int, alignment: int) -> tuple[int, ...]:
    """S3-style static bounds: n_buckets equal-width buckets over (0, max_tokens]."""
    _check_buckets(n_buckets)
    out = []
    for i in range(1, n_buckets + 1):
        b = min(max_tokens, align_up(-(-max_tokens * i // n_buckets), alignment))
        if not out or b > out[-1]:
            out.append(b)
    return tuple(out)


FIRST_REFRESH = 64  # completions before a learning pool's first refresh


def refresh_due(completions: int, refresh_every: int, learning: bool) -> bool:
    """Every `refresh_every` completions; when `learning`, also at FIRST_REFRESH completions and
    each doubling of it until then, so that a new pool's large blocks (sized by the longest
    generation seen) stop reserving max_tokens after a few dozen requests, not a thousand."""
    if learning and completions < refresh_every:
        return completions >= FIRST_REFRESH and completions & (completions - 1) == 0
    return completions % refresh_every == 0


class QuantileBuckets:
    """Bucket bounds from quantiles of realized footprints over a sliding window.

    Invariants: `bounds` is a non-empty, strictly increasing tuple of at most n_buckets ints, each a
    multiple of `alignment` or equal to max_tokens, each <= max_tokens; it is only ever replaced
    whole. `history` lists (completions, bounds) for every published tuple.

    record() is called once per completed request (cheap: one append under a lock). Every
    `refresh_every` records (see refresh_due for a `learning` pool) a refresh runs on the
    background thread (background=True) or inline; refresh() can also be called directly.
    """

    def __init__(self, max_tokens: int, n_buckets: int = 8, *, window: int = 10_000,
                 refresh_every: int = 1_000, alignment: int = 16, rule: str = "min-waste",
                 background: bool = True, initial: tuple[int, ...] | None = None,
                 migration_penalty: float = 1.0, frozen: bool = False, learning: bool = False):
        if rule not in RULES:
            raise BadArgument(f"unknown bucket rule {rule!r}: expected one of {', '.join(RULES)}")
        for name, v in (("max_tokens", max_tokens), ("n_buckets", n_buckets), ("window", window),
                        ("refresh_every", refresh_every), ("alignment", alignment)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadArgument(f"{name} must be a positive integer, got {v!r}")
        _check_buckets(n_buckets)
        self.max_tokens = max_tokens
        self.n_buckets = n_buckets
        self.window = window
        self.refresh_every = refresh_every
        self.alignment = alignment
        self.rule = rule
        self.migration_penalty = float(migration_penalty)
        self.frozen = frozen           # S3: bounds never change
        self.learning = learning       # extra refreshes before the first `refresh_every`
        bounds = initial if initial is not None else equal_width_bounds(max_tokens, n_buckets,
                                                                        alignment)
        self.bounds: tuple[int, ...] = self._clean(bounds)
        # largest generated length seen in the window: sizes large-bucket blocks (None: no data)
        self.generated_cap: int | None = None
        self._completions = 0
        self.refreshes = 0
        self.history: list[tuple[int, tuple[int, ...]]] = [(0, self.bounds)]
        # window of (realized value, predicted value or nan, generated tokens, prompt tokens)
        self._window: collections.deque = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = None
        if background and not frozen:
            # The thread holds only a weak reference, and a finalizer stops it, so buckets
            # (and the allocator owning them) that are dropped without close() free the thread.
            self._thread = threading.Thread(target=_refresh_loop, name="odma-bucket-refresh",
                                            args=(weakref.ref(self), self._wake, self._stopped),
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, _stop_refresher, self._wake, self._stopped)

    @classmethod
    def from_config(cls, max_tokens: int, config) -> "QuantileBuckets":
        """The buckets an ODMA pool (or a cluster of them) learns with `config` (AllocatorConfig).
        Pools that follow predictions until the first periodic refresh learn early too; the
        paper's rule (equal-width bounds until then) refreshes only every refresh_every."""
        c = config
        return cls(max_tokens, c.n_buckets, window=c.window, refresh_every=c.refresh_every,
                   alignment=c.token_alignment, rule=c.bucket_rule,
                   background=c.background_refresh, initial=c.initial_bounds,
                   migration_penalty=c.migration_penalty,
                   learning=c.initial_bounds is None and c.cold_start == "prediction")

    # -- feeding -----------------------------------------------------------------------------
    def record(self, realized: int, predicted: float | None, generated: int, prompt: int) -> None:
        """Log one completed request: its realized and predicted values in the bucket basis
        (predicted None when it was not placed by prediction), its generated and prompt tokens.
        Triggers a refresh every `refresh_every` records."""
        with self._lock:  # held for two appends; refresh() snapshots under the same lock
            self._window.append((realized, _NAN if predicted is None else predicted, generated,
                                 prompt))
            self._completions += 1
            due = (refresh_due(self._completions, self.refresh_every, self.learning)
                   and not self.frozen)
        if due:
            if self._thread is not None:
                self._wake.set()
            else:
                self.refresh()

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        _stop_refresher(self._wake, self._stopped)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    @property
    def completions(self) -> int:
        """Requests recorded so far."""
        return self._completions

    # -- computing bounds --------------------------------------------------------------------
    def _clean(self, bounds) -> tuple[int, ...]:
        """Round up to the alignment, cap at max_tokens, sort, drop duplicates, keep <= K."""
        out = sorted({min(self.max_tokens, int(align_up(int(np.ceil(b)), self.alignment)))
                      for b in bounds if b > 0})
        if not out:
            out = [self.max_tokens]
        if len(out) > self.n_buckets:  # keep the top bound, thin the rest evenly
            idx = np.linspace(0, len(out) - 1, self.n_buckets).round().astype(int)
            out = [out[i] for i in sorted(set(idx.tolist()))]
        return tuple(out)

    def refresh(self) -> tuple[int, ...]:
        """Recompute the bounds from the current window and publish them; returns them."""
        with self._lock:
            window = self._window.copy()        # atomic snapshot; record() may append meanwhile
            if not window:
                return self.bounds
            data = np.array(window, dtype=np.float64)
            completions = self._completions
        realized, predicted, generated, prompt = data.T
        gen_cap = int(align_up(int(generated.max()), self.alignment))
        if self.frozen:
            bounds = self.bounds
        elif self.rule == "min-waste" and np.isfinite(predicted).sum() >= 4 * self.n_buckets:
            # tokens a large block would leave unused: room for gen_cap generated tokens
            large_waste = np.minimum(self.max_tokens - prompt, gen_cap) - generated
            penalty = self.migration_penalty * float((prompt + generated).mean())
            bounds = self._min_waste(realized, predicted, large_waste, penalty)
        else:
            bounds = self._occupancy(realized)
        bounds = self._clean(bounds)
        with self._lock:
            self.generated_cap = gen_cap
            if bounds != self.bounds:
                self.history.append((completions, bounds))
            self.bounds = bounds
            self.refreshes += 1
        return bounds

    def _occupancy(self, total: np.ndarray) -> list[int]:
        levels = np.arange(1, self.n_buckets + 1) / self.n_buckets
        return np.quantile(total, levels, method="higher").tolist()

    def large_capacity(self, prompt: int, need: int = 0) -> int:
        """Tokens of a large-bucket block for a request with this prompt that needs at least
        `need` tokens now: room for the longest generation in the window (max_tokens before any
        data), doubling the generated part when even that is outgrown; capped at max_tokens."""
        cap = self.generated_cap
        base = self.max_tokens if cap is None else prompt + cap
        if need > base:
            base = prompt + 2 * (need - prompt)
        return min(self.max_tokens, align_up(base, self.alignment))

    def _min_waste(self, realized, predicted, large_waste, penalty) -> list[int]:
        ok = np.isfinite(predicted)
        order = np.argsort(predicted[ok], kind="stable")
        x, xhat, large_cost = realized[ok][order], predicted[ok][order], large_waste[ok][order]
        large_cost = np.maximum(large_cost, 0.0)
        overflow = large_cost + penalty                    # cost of outgrowing a bucket
        a = self.alignment
        cand = np.unique(np.minimum(
            self.max_tokens,
            np.ceil(np.quantile(xhat, np.linspace(0, 1, 257), method="higher") / a) * a))
        cand = cand[cand > 0]
        C = len(cand)
        pos = np.searchsorted(xhat, cand, side="right")             # samples with xhat <= c_j
        # S[j, i] = cost of the first i samples (by xhat) if they all sat in a bucket of bound c_j
        cost = np.where(x[None, :] <= cand[:, None], cand[:, None] - x[None, :], overflow[None, :])
        S = np.zeros((C, len(x) + 1))
        np.cumsum(cost, axis=1, out=S[:, 1:])
        own = S[np.arange(C), pos]                                  # S_j[pos_j]
        G = S[:, pos]                                               # G[j, m] = S_j[pos_m]
        seg = own[:, None] - G                                      # seg[j, m]: bucket (c_m, c_j]
        large_prefix = np.concatenate([[0.0], np.cumsum(large_cost)])
        tail = large_prefix[-1] - large_prefix[pos]                 # samples above c_j go large
        best = own.copy()                                           # one bucket ending at c_j
        choice = [np.full(C, -1)]
        results = [best + tail]
        mask = np.triu(np.ones((C, C), dtype=bool))                 # [j, m] with m >= j: not allowed
        for _ in range(1, self.n_buckets):
            trial = best[None, :] + seg                             # [j, m]
            trial[mask] = np.inf
            arg = trial.argmin(axis=1)
            best = trial[np.arange(C), arg]
            choice.append(arg)
            results.append(best + tail)
        k_best, j_best = np.unravel_index(np.argmin(np.array(results)), (len(results), C))
        bounds = []
        j = int(j_best)
        for k in range(int(k_best), -1, -1):
            bounds.append(float(cand[j]))
            j = int(choice[k][j])
        return bounds


def _refresh_loop(ref, wake: threading.Event, stopped: threading.Event) -> None:
    """Body of the refresher thread: refresh whenever woken, until stopped or the buckets die."""
    while True:
        wake.wait()
        wake.clear()
        if stopped.is_set():
            return
        buckets = ref()
        if buckets is None:
            return
        buckets.refresh()
        del buckets


def _stop_refresher(wake: threading.Event, stopped: threading.Event) -> None:
    stopped.set()
    wake.set()
