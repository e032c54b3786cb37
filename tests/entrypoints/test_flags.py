"""The command-line flags are generated from the settings dataclasses: every field of EngineConfig
(and its CacheConfig / SchedulerConfig) and of SamplingParams has help text, is a flag of the
scripts that take it, is listed by their ``--help`` in its group, and a set flag reaches
``LLM``'s keyword arguments / ``SamplingParams`` with the field's type."""
import dataclasses
import typing

import pytest
from absl import flags

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.entrypoints import dataclass_flags, engine_flags, flag_help
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams
from run_script import run_script

ENGINE_GROUPS = ("model/engine", "cache", "scheduler", "parallelism")


def settings_fields(cls):
    """``[(dataclass, field)]`` of every setting, written out independently of the generator: a
    field typed by a dataclass (EngineConfig.cache) stands for that dataclass's fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += settings_fields(hints[f.name])
        else:
            out.append((cls, f))
    return out


def flag_name(f: dataclasses.Field) -> str | None:
    """The flag a field documents for itself (None: excluded by ``metadata={"flag": False}``)."""
    flag = f.metadata.get("flag", True)
    return None if flag is False else flag if isinstance(flag, str) else f.name


ENGINE_FIELDS = settings_fields(EngineConfig)
SAMPLING_FIELDS = settings_fields(SamplingParams)
ENGINE_FLAG_NAMES = [n for _, f in ENGINE_FIELDS if (n := flag_name(f))]
SAMPLING_FLAG_NAMES = [n for _, f in SAMPLING_FIELDS if (n := flag_name(f))]


def test_the_walk_covers_the_known_configs():
    owners = {cls for cls, _ in ENGINE_FIELDS}
    assert {EngineConfig, CacheConfig, SchedulerConfig} <= owners
    assert {"block_size", "max_num_seqs", "dtype", "model", "engine_seed", "swap_space_bytes", "allocator",
            "data_parallel_size"} <= set(ENGINE_FLAG_NAMES)
    assert {"seed", "stop_token_ids", "logit_bias", "bad_words"} <= set(SAMPLING_FLAG_NAMES)


@pytest.mark.parametrize("owner,f", ENGINE_FIELDS + SAMPLING_FIELDS + [
    (EngineConfig, f) for f in dataclasses.fields(EngineConfig) if dataclasses.is_dataclass(f.default_factory)],
    ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_every_field_has_help(owner, f):
    help_text = f.metadata.get("help")
    assert isinstance(help_text, str) and help_text.strip(), (
        f"{owner.__name__}.{f.name}: give it field(metadata={{'help': ...}})")
    if flag_name(f) is None:  # an exclusion says why
        assert "benchmark" in help_text or "internal" in help_text, f"{owner.__name__}.{f.name}: {help_text}"


def test_a_field_without_help_is_refused():
    @dataclasses.dataclass
    class Settings:
        documented: int = dataclasses.field(default=1, metadata={"help": "has help"})
        undocumented: int = 2

    with pytest.raises(ValueError, match=r"Settings\.undocumented: no help text"):
        dataclass_flags.field_flags(Settings, "g")


def test_kinds_exclusions_and_renames():
    @dataclasses.dataclass
    class Inner:
        depth: float = dataclasses.field(default=0.5, metadata={"help": "d"})

    @dataclasses.dataclass
    class Settings:
        mode: str = dataclasses.field(default="a", metadata={"help": "m", "choices": ("a", "b")})
        level: typing.Literal["low", "high"] = dataclasses.field(default="low", metadata={"help": "l"})
        words: str | list[str] | None = dataclasses.field(default=None, metadata={"help": "w"})
        ids: list[int] | None = dataclasses.field(default=None, metadata={"help": "i"})
        table: dict[str, int] | None = dataclasses.field(default=None, metadata={"help": "t"})
        secret: bool = dataclasses.field(default=False, metadata={"help": "internal", "flag": False})
        seed: int = dataclasses.field(default=0, metadata={"help": "s", "flag": "settings_seed"})
        inner: Inner = dataclasses.field(default_factory=Inner, metadata={"help": "n", "group": "nested"})

    specs = {s.name: s for s in dataclass_flags.field_flags(Settings, "g")}
    assert {n: s.kind for n, s in specs.items()} == {
        "mode": "enum", "level": "enum", "words": "multi_str", "ids": "int_list", "table": "json",
        "settings_seed": "int", "depth": "float"}
    assert specs["level"].choices == ("low", "high") and specs["settings_seed"].field == "seed"
    assert specs["depth"].group == "nested" and specs["depth"].owner is Inner and specs["mode"].group == "g"

    @dataclasses.dataclass
    class Unflaggable:
        pair: int | str = dataclasses.field(default=0, metadata={"help": "p"})

    with pytest.raises(TypeError, match=r"Unflaggable\.pair"):
        dataclass_flags.field_flags(Unflaggable, "g")


def all_flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    engine_flags.define_engine_flags(fv)
    engine_flags.define_sampling_flags(fv)
    return fv


def test_generated_flags_are_the_fields():
    specs = engine_flags.engine_field_flags()
    assert [s.name for s in specs] == ENGINE_FLAG_NAMES
    assert [s.name for s in engine_flags.sampling_field_flags()] == SAMPLING_FLAG_NAMES
    fv = all_flags()
    fv(["prog"])
    for name in ENGINE_FLAG_NAMES + SAMPLING_FLAG_NAMES + ["config"]:
        assert fv[name].value is None, name  # unset: the preset's or the dataclass's default applies
    assert engine_flags.llm_args(fv) == (None, {})
    assert engine_flags.sampling_params(fv) == SamplingParams()
    # LLM(**kwargs) takes every engine flag's field (engine_config maps keywords onto the dataclasses)
    from jpaged.config_resolution import engine_config
    engine_config(None, **{s.field: s.default for s in specs if s.field != "model"})


def sample_value(spec):
    """(argv for ``spec``'s flag, the value its field should get)."""
    if spec.kind == "enum":
        return [f"--{spec.name}={spec.choices[-1]}"], spec.choices[-1]
    return {
        "bool": ([f"--no{spec.name}"], False),
        "int": ([f"--{spec.name}=3"], 3),
        "float": ([f"--{spec.name}=0.5"], 0.5),
        "str": ([f"--{spec.name}=some/text"], "some/text"),
        "multi_str": ([f"--{spec.name}=a,b", f"--{spec.name}=c"], ["a,b", "c"]),
        "int_list": ([f"--{spec.name}=2,7"], [2, 7]),
        "json": ([f'--{spec.name}={{"7": 1.5, "k": [1]}}'], {"7": 1.5, "k": [1]}),
    }[spec.kind]


@pytest.mark.parametrize("spec", engine_flags.engine_field_flags() + engine_flags.sampling_field_flags(),
                         ids=lambda s: s.name)
def test_a_set_flag_reaches_its_field_with_its_type(spec):
    argv, expected = sample_value(spec)
    fv = all_flags()
    fv(["prog", *argv])
    values = dataclass_flags.set_values([spec], fv)
    assert values == {spec.field: expected} and type(values[spec.field]) is type(expected)
    if spec.owner is not SamplingParams:
        model, kwargs = engine_flags.llm_args(fv)
        assert (model, kwargs) == (("some/text", {}) if spec.field == "model" else (None, {spec.field: expected}))


def test_engine_flags_reach_the_engine_config():
    from jpaged.config_resolution import engine_config

    fv = all_flags()
    fv(["prog", "--block_size=32", "--noenable_prefix_caching", "--engine_seed=7", "--max_num_seqs=4",
        "--preemption_mode=swap", "--swap_space_bytes=1024", "--data_parallel_size=2",
        '--speculative_config={"method": "ngram", "num_speculative_tokens": 3}', "--allocator=paged"])
    model, kwargs = engine_flags.llm_args(fv)
    config = engine_config(model, **kwargs)
    assert (config.cache.block_size, config.cache.enable_prefix_caching, config.seed) == (32, False, 7)
    assert (config.scheduler.max_num_seqs, config.cache.preemption_mode, config.cache.swap_space_bytes) == (
        4, "swap", 1024)
    assert config.data_parallel_size == 2 and config.speculative_config.num_speculative_tokens == 3


def test_sampling_flags_reach_sampling_params():
    fv = all_flags()
    fv(["prog", "--temperature=0.7", "--seed=3", "--stop=END", "--stop=, then", "--stop_token_ids=2,5",
        '--logit_bias={"11": -100, "12": 2.5}', "--bad_words=spam", "--allowed_token_ids=1,2,3",
        '--structured_outputs={"choice": ["yes", "no"]}', "--noskip_special_tokens", "--max_tokens=9"])
    p = engine_flags.sampling_params(fv)
    assert (p.temperature, p.seed, p.max_tokens, p.skip_special_tokens) == (0.7, 3, 9, False)
    assert p.stop == ["END", ", then"] and p.stop_token_ids == [2, 5] and p.allowed_token_ids == [1, 2, 3]
    assert p.logit_bias == {11: -100, 12: 2.5} and p.bad_words == ["spam"]
    assert p.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    assert engine_flags.llm_args(fv) == (None, {})  # the sampling seed is not the engine's


def test_program_defaults_and_bad_values():
    fv = flags.FlagValues()
    engine_flags.define_sampling_flags(fv, defaults={"temperature": 0.0, "max_tokens": 64})
    fv(["prog"])
    assert engine_flags.sampling_params(fv) == SamplingParams(temperature=0.0, max_tokens=64)
    assert "(default: 0.0; SamplingParams default: 1.0)" in fv["temperature"].help
    for bad in ("--logit_bias={x", "--stop_token_ids=2,x", "--block_size=big", "--dtype=float8"):
        fv = all_flags()
        with pytest.raises(flags.IllegalFlagValueError, match=bad.split("=")[0]):
            fv(["prog", bad])
    fv = all_flags()
    fv(["prog", "--top_p=2"])  # the dataclass validates, naming the field
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=2\.0"):
        engine_flags.sampling_params(fv)


def test_help_groups_and_program_flags():
    fv = all_flags()
    flags.DEFINE_integer("port", 8000, "Port to listen on", flag_values=fv)
    groups = flag_help.grouped_flags(fv, "prog.py")
    assert list(groups) == [*ENGINE_GROUPS, "sampling", "prog.py"]
    assert groups["prog.py"] == ["port"] and groups["parallelism"][0] == "tensor_parallel_size"
    text = flag_help.grouped_help(fv, "prog.py", "What prog does.")
    assert text.startswith("What prog does.") and "  --port=<int>\n      Port to listen on (default: 8000)" in text
    assert "  --dtype=<auto|float32|bfloat16|float16>\n      Weights and KV cache dtype" in text


@pytest.mark.parametrize("script,names", [
    ("generate.py", ENGINE_FLAG_NAMES + SAMPLING_FLAG_NAMES + ["config", "prompt", "prompts_file", "chat"]),
    ("serve.py", ENGINE_FLAG_NAMES + ["config", "host", "port", "api_key", "max_queued_requests"]),
    ("aot_compile.py", ENGINE_FLAG_NAMES + ["config", "topology", "gpu", "shapes"]),
])
def test_script_help_lists_every_flag_grouped(script, names):
    result = run_script(script, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for name in names:
        assert f"  --{name}=" in out or f"  --[no]{name}\n" in out, f"{script} --help lacks --{name}"
    headers = [f"{g} flags:" for g in ENGINE_GROUPS] + (["sampling flags:"] if script == "generate.py" else [])
    positions = [out.index(h) for h in headers + [f"{script} flags:"]]
    assert positions == sorted(positions), positions
    if script != "generate.py":
        assert "sampling flags:" not in out
