"""jpaged: PagedAttention LLM inference in JAX and Pallas.

The public names are imported on first use, so ``from jpaged import SamplingParams`` (argument
checking in a command line tool) does not pay for importing JAX, Flax and transformers.
"""
import importlib
import logging

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jpaged.llm",
    "LLMEngine": "jpaged.engine",
    "SamplingParams": "jpaged.sampling_params",
    "BeamSearchParams": "jpaged.sampling_params",
    "StructuredOutputsParams": "jpaged.sampling_params",
    "RequestOutput": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
    "BeamSearchOutput": "jpaged.outputs",
    "RequestMetrics": "jpaged.outputs",
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


# --- Quiet start-up: two library messages that are not for jpaged's users ----------------------
class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix``, at ``max_level`` or
    below; every other record passes."""

    def __init__(self, prefix: str, max_level: int):
        super().__init__()
        self.prefix, self.max_level = prefix, max_level

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= self.max_level and str(record.msg).startswith(self.prefix))


# JAX probes every platform plugin it finds and logs at INFO each one it cannot start ("Unable to
# initialize backend 'tpu': ... libtpu.so"), which absl-based scripts print. A platform that was
# asked for (JAX_PLATFORMS) still raises.
logging.getLogger("jax._src.xla_bridge").addFilter(_DropMessage("Unable to initialize backend", logging.INFO))
# transformers imported without torch (jpaged never needs it) advises that "PyTorch was not found";
# its other warnings pass.
logging.getLogger("transformers").addFilter(_DropMessage("PyTorch was not found", logging.WARNING))
