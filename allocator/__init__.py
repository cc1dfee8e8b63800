"""RACM-aware KV-cache allocator (the ODMA approach) and the policies it is measured against.

    from allocator import RacmAllocator, OutOfMemory
    alloc = RacmAllocator("torch:cpu", pool_bytes=64 << 20, bytes_per_token=1024, max_tokens=4096)
    blk = alloc.reserve("r1", prompt_tokens=100, predicted_tokens=200, uncertainty=0.3)
    blk.write(bytes(100 * 1024))            # the prompt's KV: real bytes in one contiguous range
    blk = alloc.grow("r1", 450)             # migrates (streaming copy) when outgrown
    alloc.release("r1", realized_tokens=350)

Every allocator implements the KVAllocator protocol (kv.py). pool.py holds the device pool and
what every allocator shares; contiguous.py the contiguous-block pool; policies.py the ODMA,
static, S3 and oracle policies; paged.py vLLM-style paging; tlsf.py the free-space manager;
buckets.py the bucket rules; replay.py `odma-hw replay` (replay_events.py its event loop);
prefix/ the tiered prefix cache; serving/ `odma-hw simulate` and `odma-hw workload`.
"""

from allocator.buckets import QuantileBuckets, equal_width_bounds
from allocator.cluster import ClusterManager
from allocator.config import AllocatorConfig
from allocator.contiguous import Block, ContiguousPool
from allocator.copier import MigrationCopier, StreamingCopier
from allocator.errors import (AllocatorClosed, BadArgument, DuplicateRequest, InvariantBroken,
                              MigrationFailed, OdmaError, OutOfMemory, PoolTooLarge, RequestBusy,
                              StaleBlock, UnknownRequest)
from allocator.kv import KVAllocator, KVBlock
from allocator.paged import PagedAllocator, PagedBlock
from allocator.placement import (LARGE, OdmaPolicy, OracleAllocator, OraclePolicy, Placement,
                                 Policy, RacmAllocator, S3Allocator, S3Policy, StaticAllocator,
                                 StaticPolicy)
from allocator.policies import POLICIES, make_allocator
from allocator.pool import BlockPin
from allocator.predictors import (LengthPredictor, NoisyOraclePredictor, OnlinePredictor,
                                  OraclePredictor, Request, make_predictor)
from allocator.prefix import PrefixCache, TierBandwidth, prefix_key
from allocator.tlsf import TlsfFreeSpace

__all__ = [
    "RacmAllocator", "AllocatorConfig", "Block", "LARGE", "OutOfMemory", "UnknownRequest",
    "DuplicateRequest", "RequestBusy", "StaleBlock", "PoolTooLarge", "MigrationFailed",
    "AllocatorClosed", "InvariantBroken", "BadArgument", "OdmaError", "QuantileBuckets",
    "equal_width_bounds", "TlsfFreeSpace", "StreamingCopier", "MigrationCopier", "ClusterManager",
    "KVAllocator", "KVBlock", "ContiguousPool", "Placement", "Policy", "OdmaPolicy",
    "StaticPolicy", "S3Policy", "OraclePolicy", "StaticAllocator", "S3Allocator",
    "OracleAllocator", "PagedAllocator", "PagedBlock", "POLICIES", "make_allocator",
    "LengthPredictor", "OraclePredictor", "NoisyOraclePredictor", "OnlinePredictor", "Request",
    "make_predictor", "BlockPin", "PrefixCache", "TierBandwidth", "prefix_key",
]
