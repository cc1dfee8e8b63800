"""The registry of the KV allocation policies users name: one descriptor per policy.

A PolicySpec (descriptor) says everything the serving code needs to know about a policy, so
that no module outside this one compares policy names:
- make: the allocator factory (device, pool bytes, bytes per token, max tokens, config,
  page_tokens);
- oracle: it sizes blocks by the realized length, so its runs use the oracle predictor;
- layout: how a request's KV lies in the pool: "contiguous" (one block), "paged" (pages; the
  run's paged layout decides the order within a page) or "extent" (a few long extents);
- knee: its extents are sized by the device's knee (the simulation derives it from its timing
  source, the engine from --card or --extent-knee-tokens);
- demand: admission by predicted demand (commit KV as tokens come, preempt the least progress
  to make room) instead of reserving a request's block up front;
- places: its allocator places blocks with a placement policy (allocator.placement), whose
  bucket is a request's co-batching tag;
- cobatches: co-batching by bucket tag changes its runs (static puts every request in one
  bucket: its runs keep arrival order).

The placement policies and the contiguous allocators are in allocator/placement.py; paging in
paged.py; extents in extent.py. This module imports all three and none of them imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from odma_cli.errors import BadArgument

from allocator.extent import ElasticAllocator, ExtentAllocator
from allocator.paged import PagedAllocator
from allocator.placement import OracleAllocator, RacmAllocator, S3Allocator, StaticAllocator

LAYOUTS = ("contiguous", "paged", "extent")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a policy is to the serving code (see the module docstring)."""

    name: str
    make: Callable
    oracle: bool = False
    layout: str = "contiguous"
    knee: bool = False
    demand: bool = False
    places: bool = True
    cobatches: bool = True

    def predictor(self, name: str) -> str:
        """The predictor a run of this policy uses when `name` is asked for."""
        return "oracle" if self.oracle else name


def _contiguous(cls):
    return lambda device, pool, bpt, max_tokens, config, page_tokens: \
        cls(device, pool, bpt, max_tokens, config)


def _paged(device, pool, bpt, max_tokens, config, page_tokens):
    return PagedAllocator(device, pool, bpt, max_tokens, config, page_tokens=page_tokens)


# the command line's order
POLICY = {p.name: p for p in (
    PolicySpec("odma", _contiguous(RacmAllocator)),
    PolicySpec("static", _contiguous(StaticAllocator), cobatches=False),
    PolicySpec("s3", _contiguous(S3Allocator)),
    PolicySpec("paged", _paged, layout="paged", places=False),
    PolicySpec("oracle", _contiguous(OracleAllocator), oracle=True),
    PolicySpec("extent", _contiguous(ExtentAllocator), layout="extent", knee=True),
    PolicySpec("elastic", _contiguous(ElasticAllocator), layout="extent", knee=True,
               demand=True),
)}

# name -> allocator class (what allocator.__init__ and the command lines list)
POLICIES = {"odma": RacmAllocator, "static": StaticAllocator, "s3": S3Allocator,
            "paged": PagedAllocator, "oracle": OracleAllocator, "extent": ExtentAllocator,
            "elastic": ElasticAllocator}


def policy(name: str) -> PolicySpec:
    """The descriptor of policy `name`; BadArgument for a name no policy has."""
    if name not in POLICY:
        raise BadArgument(f"unknown policy {name!r}: expected one of {', '.join(POLICY)}")
    return POLICY[name]


def make_allocator(name: str, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                   config=None, *, page_tokens: int = 16):
    """The allocator of policy `name` (page_tokens applies to paging)."""
    return policy(name).make(device, pool_bytes, bytes_per_token, max_tokens, config,
                             page_tokens)
