"""Hugging Face checkpoint directories: config.json, safetensors shards, tokenizer. No torch.

A broken file is a ``ValueError`` that names the file and what is wrong with it (not JSON, a
missing or inconsistent field, an unreadable or truncated safetensors file).
"""
import glob
import os

import numpy as np

from jpaged.models import ModelConfig
from jpaged.models.model_config import MLA_MODEL_TYPES
from jpaged.utils import read_json  # noqa: F401  (re-exported: loaders import it from here)


def read_config(path: str) -> dict:
    return read_json(os.path.join(path, "config.json"))


def _first(d: dict, *keys):
    """(key, value) of the first of ``keys`` present in ``d`` (the names differ by architecture)."""
    for k in keys:
        if d.get(k) is not None:
            return k, d[k]
    return keys[0], None


def model_config(hf_config: dict, source: str) -> ModelConfig:
    """``ModelConfig.from_hf`` after checking the fields the engine sizes everything by; a missing,
    non-positive or inconsistent one is a ValueError naming ``source`` (the file it came from)."""
    def bad(why):
        raise ValueError(f"{source}: {why}")

    if not isinstance(hf_config, dict):
        bad(f"expected a JSON object, got {type(hf_config).__name__}")
    text = hf_config.get("text_config") or hf_config
    sizes = {}
    for keys in (("vocab_size",), ("hidden_size", "n_embd", "d_model"), ("num_attention_heads", "n_head"),
                 ("num_hidden_layers", "n_layer")):
        key, value = _first(text, *keys)
        if value is None:
            bad(f"missing {' / '.join(keys)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad(f"{key}={value!r}: must be a positive integer")
        sizes[keys[0]] = value
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = text.get("num_key_value_heads")
    if kv_heads is not None and hf_config.get("model_type") not in MLA_MODEL_TYPES:  # MLA: no KV heads
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            bad(f"num_key_value_heads={kv_heads!r}: must be a positive integer")
        if heads % kv_heads:
            bad(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = text.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        bad(f"head_dim={head_dim!r}: must be a positive integer")
    if hidden % heads:  # transformers refuses it too, even with a head_dim
        bad(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    try:
        return ModelConfig.from_hf(hf_config)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        bad(f"unreadable model config ({type(e).__name__}: {e})")


def iter_safetensors(path: str):
    """Yields (name, numpy array) from every ``*.safetensors`` file of a directory, lazily."""
    from safetensors import SafetensorError, safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r}: no *.safetensors files in the directory")
    for file in files:
        try:
            handle = safe_open(file, framework="flax")  # "flax" reads bfloat16 too
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                try:
                    array = np.asarray(f.get_tensor(name))
                except (SafetensorError, OSError, ValueError) as e:
                    raise ValueError(f"{file}: tensor {name!r} cannot be read, the file is truncated or "
                                     f"corrupt ({e})") from None
                yield name, array


def load_tokenizer(path: str):
    """The directory's tokenizer, or None when it has none."""
    if not any(os.path.exists(os.path.join(path, n))
               for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- transformers' and huggingface_hub's errors share no base
        raise ValueError(f"{path}: the tokenizer cannot be loaded ({type(e).__name__}: {e})") from None
