"""RACM-aware KV-cache allocator (the ODMA approach) and the policies it is measured against.

    from allocator import RacmAllocator, OutOfMemory
    alloc = RacmAllocator("torch:cpu", pool_bytes=64 << 20, bytes_per_token=1024, max_tokens=4096)
    blk = alloc.reserve("r1", prompt_tokens=100, predicted_tokens=200, uncertainty=0.3)
    blk.write(kv_bytes)                     # real bytes in one contiguous range of the pool
    blk = alloc.grow("r1", 450)             # migrates (streaming copy) when outgrown
    alloc.release("r1", realized_tokens=350)

See core.py for the policy and invariants, tlsf.py for the free-space manager, buckets.py for the
bucket rules, replay.py for `odma-hw replay`.
"""

from allocator.baselines import (POLICIES, OracleAllocator, PagedAllocator, PagedBlock,
                                 S3Allocator, StaticAllocator)
from allocator.buckets import QuantileBuckets, equal_width_bounds
from allocator.cluster import ClusterManager
from allocator.copier import MigrationCopier, StreamingCopier
from allocator.core import LARGE, AllocatorConfig, Block, RacmAllocator
from allocator.errors import (BadArgument, DuplicateRequest, MigrationFailed, OdmaError,
                              OutOfMemory, PoolTooLarge, RequestBusy, StaleBlock, UnknownRequest)
from allocator.predictors import (LengthPredictor, NoisyOraclePredictor, OnlinePredictor,
                                  OraclePredictor, Request, make_predictor)
from allocator.tlsf import TlsfFreeSpace

__all__ = [
    "RacmAllocator", "AllocatorConfig", "Block", "LARGE", "OutOfMemory", "UnknownRequest",
    "DuplicateRequest", "RequestBusy", "StaleBlock", "PoolTooLarge", "MigrationFailed",
    "BadArgument", "OdmaError", "QuantileBuckets", "equal_width_bounds", "TlsfFreeSpace",
    "StreamingCopier", "MigrationCopier", "ClusterManager", "StaticAllocator", "S3Allocator",
    "OracleAllocator", "PagedAllocator", "PagedBlock", "POLICIES", "LengthPredictor",
    "OraclePredictor", "NoisyOraclePredictor", "OnlinePredictor", "Request", "make_predictor",
]
