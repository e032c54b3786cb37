"""Hugging Face checkpoint directories: config.json, safetensors shards, tokenizer. No torch."""
import glob
import json
import os

import numpy as np


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def iter_safetensors(path: str):
    """Yields (name, numpy array) from every ``*.safetensors`` file of a directory, lazily."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r}: no *.safetensors files in the directory")
    for file in files:
        with safe_open(file, framework="flax") as f:  # "flax" reads bfloat16 too
            for name in f.keys():
                yield name, np.asarray(f.get_tensor(name))


def load_tokenizer(path: str):
    """The directory's tokenizer, or None when it has none."""
    if not any(os.path.exists(os.path.join(path, n))
               for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
