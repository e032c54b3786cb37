"""Settings resolution: from `LLM`-style keyword arguments (and a preset's settings) to one
validated `EngineConfig`, each keyword routed to the dataclass of `jpaged.config` that declares it."""
import dataclasses

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.loading import presets


def _field_names(cls, *exclude) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - set(exclude)


def engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """A validated EngineConfig from LLM-style keyword arguments (a preset's settings filled in)."""
    model, kwargs = presets.resolve(model, kwargs)
    cache_keys, scheduler_keys = _field_names(CacheConfig), _field_names(SchedulerConfig)
    engine_keys = _field_names(EngineConfig, "model", "cache", "scheduler")
    unknown = set(kwargs) - cache_keys - scheduler_keys - engine_keys
    if unknown:
        raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
    pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys}  # noqa: E731
    return EngineConfig(model=model, cache=CacheConfig(**pick(cache_keys)),
                        scheduler=SchedulerConfig(**pick(scheduler_keys)), **pick(engine_keys))
