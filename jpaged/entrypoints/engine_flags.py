"""The engine's absl flags, defined once for every command-line entry point.

``define_engine_flags()`` defines ``--model``, ``--config`` and the engine settings (each None by
default: the preset's or the engine's default applies); ``llm_args()`` turns them into the
``LLM(model, **kwargs)`` arguments.
"""
from absl import flags

ENGINE_FLAGS = ["dtype", "kv_cache_dtype", "block_size", "num_kv_blocks", "kv_cache_memory_bytes", "memory_utilization",
                "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "preemption_mode",
                "tensor_parallel_size", "attention_backend", "precompile", "quantization", "num_scheduler_steps",
                "speculative_config", "enable_expert_parallel"]


def define_engine_flags(flag_values=flags.FLAGS) -> None:
    f = dict(flag_values=flag_values)
    flags.DEFINE_string("model", None, "HF directory, .gguf file or preset; default: embedded SmolLM2-135M-Instruct",
                        **f)
    flags.DEFINE_string("config", None, "Preset from configs/ (model + engine settings); flags override it", **f)
    flags.DEFINE_enum("dtype", None, ["auto", "float32", "bfloat16", "float16"], "Weights and KV cache dtype", **f)
    flags.DEFINE_enum("kv_cache_dtype", None, ["auto", "int8", "fp8"],
                      "KV cache storage: auto (the model dtype), or int8 / fp8 (e4m3) pages with a bfloat16 scale "
                      "per token and KV head", **f)
    flags.DEFINE_integer("block_size", None, "Tokens per KV block", **f)
    flags.DEFINE_integer("num_kv_blocks", None, "KV pool size in blocks", **f)
    flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV pool size in bytes", **f)
    flags.DEFINE_float("memory_utilization", None, "Share of the accelerator's memory for weights, temporaries "
                       "and the KV pool (the pool gets what is left)", **f)
    flags.DEFINE_integer("max_num_seqs", None, "Sequences per step", **f)
    flags.DEFINE_integer("max_num_batched_tokens", None, "Tokens per step", **f)
    flags.DEFINE_integer("max_model_len", None, "Longest prompt + output", **f)
    flags.DEFINE_integer("num_scheduler_steps", None, "Decode steps per host round trip: up to this many decode "
                         "steps run back to back on the device when every sequence decodes", **f)
    flags.DEFINE_bool("enable_prefix_caching", None, "Automatic prefix caching", **f)
    flags.DEFINE_enum("preemption_mode", None, ["recompute", "swap"], "How to preempt when the pool is full", **f)
    flags.DEFINE_integer("tensor_parallel_size", None, "Devices to shard attention heads over", **f)
    flags.DEFINE_bool("enable_expert_parallel", None, "Mixture-of-experts models: whole experts per device over "
                      "the tensor_parallel_size devices", **f)
    flags.DEFINE_enum("attention_backend", None, ["auto", "pallas", "xla"], "Attention implementation", **f)
    flags.DEFINE_bool("precompile", None, "Compile every step shape at start, so that none compiles while "
                      "serving (the server's default)", **f)
    flags.DEFINE_enum("quantization", None, ["int8", "gguf"],
                      "Weight-only quantization: int8 per output channel (any checkpoint), or gguf "
                      "(a .gguf file's Q8_0/Q4_0/Q4_1 blocks kept as stored); unset: weights as loaded", **f)
    flags.DEFINE_string("speculative_config", None,
                        'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "path/or/preset", "num_speculative_tokens": 4}\' '
                        "(docs/speculative.md)", **f)


def llm_args(flag_values=flags.FLAGS) -> tuple[str | None, dict]:
    """``(model, engine kwargs)`` for ``LLM(model, **kwargs)``: only the flags that were set."""
    kwargs = {k: flag_values[k].value for k in ENGINE_FLAGS if flag_values[k].value is not None}
    return flag_values["model"].value or flag_values["config"].value, kwargs
