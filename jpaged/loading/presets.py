"""Named presets: a model plus engine settings, loaded by name.

The presets ship inside the package (``jpaged/presets/*.json``, package data), so a name resolves
from any directory and in a non-editable install. ``"smollm2-135m-instruct"``,
``"presets/smollm2-135m-instruct"`` and ``"smollm2-135m-instruct.json"`` name the same preset; the
path of a ``.json`` file of one's own is a preset too.
"""
import os

from jpaged.utils import read_json

PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")


def list_presets() -> list[str]:
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_preset(name: str) -> dict | None:
    """The preset's settings, or None when ``name`` is not a preset."""
    if name.endswith(".json") and os.path.isfile(name):
        return read_json(name)
    base = name.removeprefix("presets/").removesuffix(".json")
    if not base or os.sep in base or "/" in base:
        return None
    path = os.path.join(PRESET_DIR, f"{base}.json")
    return read_json(path) if os.path.isfile(path) else None


def is_model_path(name: str) -> bool:
    return os.path.exists(name) and not (name.endswith(".json") and os.path.isfile(name))


def resolve(model: str | None, overrides: dict) -> tuple[str | None, dict]:
    """(model path or None for the embedded default, engine kwargs) with explicit kwargs winning."""
    if model is None or is_model_path(model):
        return model, overrides
    preset = load_preset(model)
    if preset is None:
        raise ValueError(f"model={model!r}: not a directory, a .gguf file, or a preset "
                         f"(presets: {', '.join(list_presets()) or 'none'})")
    preset = dict(preset)
    path = preset.pop("model", None)
    return path, {**preset, **overrides}
