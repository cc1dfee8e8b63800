"""A tiered prefix cache for contiguous, predicted-length KV blocks (device -> host -> disk).

    from allocator.prefix import PrefixCache, prefix_key
    cache = PrefixCache("host", bytes_per_token, device_bytes=..., host_bytes=...,
                        disk_bytes=..., disk_dir="/var/cache/kv")
    key = prefix_key(prompt_ids[:n])
    covered, seconds = cache.restore(key, block, n)   # before prefill: skip `covered` tokens
    seconds = cache.offer(key, block, n)              # after the request computed them

cache.py holds PrefixCache (its public calls, construction, invariants, lifetime), made of:
index.py the keys, entries and the index; tiers.py the tiers' space, eviction and moves between
tiers; transfer.py the checked byte moves and their seconds (TierBandwidth); promotion.py the
promotion worker and prefetch; counters.py the counters and stats(). Beneath them: kernels.py
the copy-and-checksum kernels; memory.py where tier bytes live and how they move between
devices; disk.py the file format; order.py the eviction orders.
"""

from allocator.prefix.cache import (DROP_REASONS, EVICTIONS, POOL_ALIGNMENT, TIERS, PrefixCache,
                                    TierBandwidth, prefix_key)

__all__ = ["TIERS", "EVICTIONS", "DROP_REASONS", "POOL_ALIGNMENT", "PrefixCache",
           "TierBandwidth", "prefix_key"]
