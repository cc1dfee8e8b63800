"""AllocatorConfig: the knobs of the allocation policies, the contiguous pool and the extent
allocator."""

from __future__ import annotations

import dataclasses

from odma_cli.errors import BadArgument

from allocator.arguments import amount
from allocator.buckets import MAX_BUCKETS, RULES

BASES = ("generated", "footprint")
COLD_STARTS = ("prediction", "equal-width")
EXTENT_GROWTHS = ("generated", "footprint", "knee")
EXTENT_FIRSTS = ("prediction", "knee")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """Knobs of the ODMA policy and pool; every field has the default the replays use."""

    alpha: float = 1.0              # L' = L (1 + alpha u)
    tau: float = 4.0                # u > tau: straight to the large bucket
    n_buckets: int = 8              # regular buckets (the large bucket is extra)
    bucket_basis: str = "generated"  # bounds count generated tokens (block = prompt + bound,
    #                                  the paper's Eq. 2) or the whole "footprint"
    bucket_rule: str = "min-waste"  # or "occupancy" (the paper's equal-occupancy quantiles)
    window: int = 10_000            # completions the bounds are learned from
    refresh_every: int = 1_000      # completions between refreshes
    background_refresh: bool = True  # refresh on a thread (False: inline, deterministic)
    token_alignment: int = 16       # bucket bounds / capacities are multiples of this (tokens)
    byte_alignment: int | None = None  # block offsets; None: the device's alignment
    large_share: float = 0.1        # share of the pool reserved for the large bucket
    migration_penalty: float = 1.0  # min-waste rule: cost of a migration, in mean requests
    initial_bounds: tuple | None = None  # bounds before the first refresh (None: see cold_start)
    cold_start: str = "prediction"  # the first refresh_every completions: size blocks by the
    #                                 prediction itself and refresh early (buckets.refresh_due),
    #                                 or by "equal-width" bounds up to max_tokens (the paper)
    copy_chunk_bytes: int | None = None  # migration copy chunk (None: one streaming copy)
    # the extent allocator (allocator/extent.py): a request outgrowing its extents gets a new one
    # of max(knee, growth) tokens; growth is the tokens generated so far ("generated": the
    # generated part doubles), all the tokens it holds ("footprint") or nothing ("knee": every
    # growth extent is knee-sized)
    extent_growth: str = "generated"
    # the first extent: ODMA's block for the prediction ("prediction"), or the prompt and one
    # knee of room ("knee"): memory committed as tokens come, in runs long enough to stream
    extent_first: str = "knee"
    extent_max: int = 4             # extents a request holds; growth past them merges (migrates)
    extent_knee_tokens: int | None = None  # the knee: None is token_alignment (nothing known of
    #                                 the device); the serving simulation derives it from its
    #                                 timing source when left None
    extent_knee_fraction: float = 0.8  # the knee is the shortest run that reads at this
    #                                    fraction of the sequential bandwidth
    # elastic admission: a request's predicted final footprint is prompt + L x (1 + demand_bound
    # x u), u the predictor's relative distance to its 95 % upper bound: 0 = the prediction
    # itself, 1 = that upper bound; None plans for nothing beyond what a request holds (admit
    # while its first placement fits, as paging does: for cheap preemption, a swap)
    demand_bound: float | None = 0.0

    def __post_init__(self):
        for name in ("alpha", "tau", "migration_penalty", "demand_bound"):
            if name != "demand_bound" or self.demand_bound is not None:
                amount(name, getattr(self, name), allow_inf=name == "tau")
        for name in ("n_buckets", "window", "refresh_every", "token_alignment", "extent_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadArgument(f"{name} must be a positive integer, got {v!r}")
        if self.n_buckets > MAX_BUCKETS:
            raise BadArgument(f"n_buckets (--buckets) must be at most {MAX_BUCKETS}, got "
                              f"{self.n_buckets}")
        for name, value, allowed in (("bucket basis", self.bucket_basis, BASES),
                                     ("bucket rule", self.bucket_rule, RULES),
                                     ("cold start", self.cold_start, COLD_STARTS),
                                     ("extent growth", self.extent_growth, EXTENT_GROWTHS),
                                     ("extent first", self.extent_first, EXTENT_FIRSTS)):
            if value not in allowed:
                raise BadArgument(f"unknown {name} {value!r}: expected one of {', '.join(allowed)}")
        a = self.byte_alignment
        if a is not None and (not isinstance(a, int) or isinstance(a, bool) or a <= 0
                              or a & (a - 1)):
            raise BadArgument(f"byte_alignment must be a power of two, got {a!r}")
        b = self.initial_bounds
        if b is not None:
            if not isinstance(b, (tuple, list)) or not 1 <= len(b) <= MAX_BUCKETS:
                raise BadArgument(f"initial_bounds must be a tuple of 1 to {MAX_BUCKETS} token "
                                  f"counts, got {b!r:.80}")
            for v in b:
                if amount("initial_bounds", v) == 0:
                    raise BadArgument(f"initial_bounds must be > 0, got {v!r}")
        c = self.copy_chunk_bytes
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c <= 0):
            raise BadArgument(f"copy_chunk_bytes must be a positive integer, got {c!r}")
        k = self.extent_knee_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k <= 0):
            raise BadArgument(f"extent_knee_tokens must be a positive integer or None, got {k!r}")
        if not 0 < amount("extent_knee_fraction", self.extent_knee_fraction) <= 1:
            raise BadArgument(f"extent_knee_fraction must be in (0, 1], got "
                              f"{self.extent_knee_fraction!r}")
        if not 0 <= amount("large_share", self.large_share) < 1:
            raise BadArgument(f"large_share must be in [0, 1), got {self.large_share!r}")


def check_config(config) -> AllocatorConfig:
    """`config`, or the defaults for None; BadArgument for anything else."""
    if config is None:
        return AllocatorConfig()
    if not isinstance(config, AllocatorConfig):
        raise BadArgument(f"config must be an AllocatorConfig, got {config!r}")
    return config
