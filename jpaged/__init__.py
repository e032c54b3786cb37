"""jpaged: PagedAttention LLM inference in JAX and Pallas.

The public names are imported on first use, so ``from jpaged import SamplingParams`` (argument
checking in a command line tool) does not pay for importing JAX, Flax and transformers.
"""
import importlib
import logging
import os

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jpaged.llm",
    "LLMEngine": "jpaged.engine",
    "SamplingParams": "jpaged.sampling_params",
    "BeamSearchParams": "jpaged.sampling_params",
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
# transformers, imported without torch (jpaged never needs it), advises at import that "PyTorch was
# not found"; the variable drops only its advisory messages, and a user's own setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class _DropBackendProbe(logging.Filter):
    """JAX probes every platform plugin it finds and logs at INFO each one it cannot start
    ("Unable to initialize backend 'tpu': ... libtpu.so"), which absl-based scripts print. Only
    those INFO records are dropped; a platform that was asked for still raises."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and str(record.msg).startswith("Unable to initialize backend"))


logging.getLogger("jax._src.xla_bridge").addFilter(_DropBackendProbe())
