"""Turns a model reference (HF directory, GGUF file or jpaged orbax checkpoint directory) into a
loaded NNX model and tokenizer."""
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.loading import hf_checkpoint, orbax_checkpoint
from jpaged.models import ModelConfig, model_class


def read_checkpoint(path: str):
    """(hf config dict, iterable of (name, array), tokenizer or None) for a directory or .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jpaged.loading.gguf_loader import load_gguf

        hf_config, weights, tokenizer = load_gguf(path)
        return hf_config, weights.items(), tokenizer
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        return orbax_checkpoint.read_as_hf(path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r}: directory has no config.json")
        return (hf_checkpoint.read_config(path), hf_checkpoint.iter_safetensors(path),
                hf_checkpoint.load_tokenizer(path))
    raise ValueError(f"model={path!r}: not a Hugging Face directory, a .gguf file or a known preset")


def _set(module, path, value):
    for p in path[:-1]:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    var = getattr(module, path[-1])
    if tuple(var.shape) != tuple(value.shape):
        raise ValueError(f"weight {'.'.join(map(str, path))}: checkpoint shape {value.shape} "
                         f"!= model shape {tuple(var.shape)}")
    var.set_value(value)


def build_model(config: ModelConfig, weights, *, dtype, attention_backend: str, shard_fn=None):
    """Creates the model without initializing it, then fills every parameter from ``weights``."""
    cls = model_class(config)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, attention_backend=attention_backend,
                                       rngs=nnx.Rngs(0)))
    wanted = {name: (path, transpose) for path, name, transpose in model.hf_weight_map()}
    seen = set()
    canonical = getattr(model, "canonical_hf_name", lambda n: n)  # hub names -> save_pretrained names
    for name, array in weights:
        name = canonical(name)
        if name not in wanted:
            continue
        path, transpose = wanted[name]
        array = np.asarray(array)
        array = array.T if transpose else array
        value = jnp.asarray(array, dtype) if shard_fn is None else shard_fn(path, array.astype(dtype))
        _set(model, path, value)
        seen.add(name)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.init_buffers()
    return model


def load_model(path: str, *, dtype, attention_backend: str):
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        return orbax_checkpoint.load_checkpoint(path, dtype=dtype, attention_backend=attention_backend)
    hf_config, weights, tokenizer = read_checkpoint(path)
    config = ModelConfig.from_hf(hf_config)
    model = build_model(config, weights, dtype=dtype, attention_backend=attention_backend)
    return model, config, tokenizer
