"""jpaged: PagedAttention LLM inference in JAX and Pallas.

The public names are imported on first use, so ``from jpaged import SamplingParams`` (argument
checking in a command line tool) does not pay for importing JAX, Flax and transformers.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jpaged.entrypoints.llm",
    "LLMEngine": "jpaged.engine.llm_engine",
    "SamplingParams": "jpaged.sampling_params",
    "BeamSearchParams": "jpaged.sampling_params",
    "StructuredOutputsParams": "jpaged.sampling_params",
    "RequestOutput": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
    "BeamSearchOutput": "jpaged.outputs",
    "RequestMetrics": "jpaged.outputs",
    "LoRARequest": "jpaged.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
