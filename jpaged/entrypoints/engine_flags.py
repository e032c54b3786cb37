"""The entry points' flag sets, generated from the settings dataclasses (`dataclass_flags`).

``define_engine_flags()`` defines ``--config`` and a flag for every field of `EngineConfig` and its
`CacheConfig` / `SchedulerConfig` (``--model`` included), each None by default: the preset's or
the engine's default applies; ``llm_args()`` turns them into the ``LLM(model, **kwargs)`` arguments.
``define_sampling_flags()`` does the same for `SamplingParams`, ``sampling_params()`` builds one.
A field added to those dataclasses is a flag of every script without more code here.
"""
from absl import flags

from jpaged.config import EngineConfig
from jpaged.entrypoints import dataclass_flags
from jpaged.entrypoints.dataclass_flags import FieldFlag
from jpaged.sampling_params import SamplingParams

ENGINE_GROUP, SAMPLING_GROUP = "model/engine", "sampling"
GROUP_ORDER = (ENGINE_GROUP, "cache", "scheduler", "parallelism", SAMPLING_GROUP)  # --help's order


def engine_field_flags() -> list[FieldFlag]:
    """Every engine setting's flag: EngineConfig's fields, its nested configs' fields in theirs."""
    return dataclass_flags.field_flags(EngineConfig, ENGINE_GROUP)


def sampling_field_flags() -> list[FieldFlag]:
    return dataclass_flags.field_flags(SamplingParams, SAMPLING_GROUP)


def define_engine_flags(flag_values=flags.FLAGS) -> None:
    """``--config`` and every engine setting (None: the preset's or the engine's default)."""
    flags.DEFINE_string("config", None, "Preset from configs/ (model + engine settings) or its .json file; "
                        "the other flags override it", flag_values=flag_values)
    for spec in engine_field_flags():
        dataclass_flags.define(spec, flag_values)


def define_sampling_flags(flag_values=flags.FLAGS, defaults: dict | None = None) -> None:
    """Every SamplingParams field; ``defaults``: the program's own ``{field: value}`` where it
    differs from SamplingParams' (e.g. greedy)."""
    defaults = defaults or {}
    for spec in sampling_field_flags():
        dataclass_flags.define(spec, flag_values, defaults.get(spec.field))


def llm_args(flag_values=flags.FLAGS) -> tuple[str | None, dict]:
    """``(model, engine kwargs)`` for ``LLM(model, **kwargs)``: only the flags that were set;
    the model is ``--model``, else ``--config``."""
    kwargs = dataclass_flags.set_values(engine_field_flags(), flag_values)
    model = kwargs.pop("model", None)
    return model or flag_values["config"].value, kwargs


def sampling_params(flag_values=flags.FLAGS) -> SamplingParams:
    """A SamplingParams of the sampling flags that hold a value (ValueError naming a bad field)."""
    return SamplingParams(**dataclass_flags.set_values(sampling_field_flags(), flag_values))


def flag_groups() -> dict[str, list[str]]:
    """``{group: flag names}`` of the generated flags (``--config`` with the model's), in --help order."""
    groups = {g: [] for g in GROUP_ORDER}
    groups[ENGINE_GROUP].append("config")
    for spec in engine_field_flags() + sampling_field_flags():
        groups.setdefault(spec.group, []).append(spec.name)
    return groups
