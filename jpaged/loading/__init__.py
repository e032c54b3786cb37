"""From a model reference to a loaded model: Hugging Face directories (`hf_checkpoint`), GGUF files
(`gguf_loader`), jpaged orbax checkpoints (`orbax_checkpoint`), presets by name (`presets`);
`model_loader.load_model` puts them together. ``load_model`` and ``read_checkpoint`` are imported
on first use, so that ``jpaged.loading.presets`` (command-line checks) does not import JAX."""
import importlib

_LAZY = {"load_model", "build_model", "read_checkpoint"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jpaged.loading' has no attribute {name!r}")
    return getattr(importlib.import_module("jpaged.loading.model_loader"), name)
