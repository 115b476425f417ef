"""Storage tiers behind one interface (DESIGN §5), registered by the name users write in config.

`host` and `disk` register on import; `redis` and `s3` are imported on first use (`kvstore.store.build_tier`) so
their client libraries load only where configured.
"""
from kvstore.tiers.base import TIER_REGISTRY, Tier, TierFull, TierStats, TierUnavailable, register_tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier, HostTierReader

__all__ = ["TIER_REGISTRY", "Tier", "TierFull", "TierStats", "TierUnavailable", "register_tier", "DiskTier",
           "HostTier", "HostTierReader"]
