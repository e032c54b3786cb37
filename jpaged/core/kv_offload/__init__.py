"""Prefix-cache tiers below the device pool: host memory, then disk (kept across restarts).

`KVOffload` is the connector the KV cache manager and the runner share: it keeps the tiers
(`HostTier`, `DiskTier`), plans the block moves of each step (stores of evicted device blocks,
loads of tier hits into free device blocks) and counts hits. docs/kv_offload.md explains the design.
"""
from jpaged.core.kv_offload.connector import KVOffload, TierBlock
from jpaged.core.kv_offload.disk_tier import DiskTier
from jpaged.core.kv_offload.host_tier import BlockEntry, HostTier

__all__ = ["BlockEntry", "DiskTier", "HostTier", "KVOffload", "TierBlock"]
