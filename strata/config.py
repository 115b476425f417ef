"""The engine's configs, re-exported: they live in `engine.config` (the engine owns its configuration)."""
from engine.config import CacheConfig, ModelConfig, SchedulerConfig

__all__ = ["CacheConfig", "ModelConfig", "SchedulerConfig"]
