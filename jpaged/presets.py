"""Named presets in `configs/`: a model plus engine settings, loaded by name."""
import json
import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def list_presets() -> list[str]:
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def load_preset(name: str) -> dict | None:
    """The preset's settings, or None when ``name`` is not a preset."""
    path = os.path.join(CONFIG_DIR, f"{name}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def is_model_path(name: str) -> bool:
    return os.path.exists(name)


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
