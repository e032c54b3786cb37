"""Turns a model reference (HF directory, GGUF file or jpaged orbax checkpoint directory) into a
loaded NNX model and tokenizer."""
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import sharding
from jpaged.loading import hf_checkpoint, orbax_checkpoint
from jpaged.models import ModelConfig, model_class


def read_checkpoint(path: str):
    """(hf config dict, iterable of (name, array), tokenizer or None) for a directory or .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jpaged.loading.gguf_loader import load_gguf

        hf_config, weights, tokenizer = load_gguf(path)
        return hf_config, _drain(weights), tokenizer
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        return orbax_checkpoint.read_as_hf(path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r}: directory has no config.json")
        return (hf_checkpoint.read_config(path), hf_checkpoint.iter_safetensors(path),
                hf_checkpoint.load_tokenizer(path))
    raise ValueError(f"model={path!r}: not a Hugging Face directory, a .gguf file or a known preset")


def _drain(weights: dict):
    """(name, array) pairs, each dropped from ``weights`` as it is handed out, so the host copy of
    a weight can be freed once it is on the device (not all of them held to the end)."""
    while weights:
        yield weights.popitem()


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


def load_model(path: str, *, dtype, attention_backend: str, mesh=None):
    """(model, config, tokenizer); with a mesh, every weight goes straight into its shards."""
    tp = 1 if mesh is None else mesh.shape[sharding.MODEL_AXIS]
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        _, config = orbax_checkpoint.read_manifest(path)
        if sharding.kv_head_replication(config.num_heads, config.num_kv_heads, tp) == 1:
            # restored as saved (any NNX model class); the runner places it on the mesh
            return orbax_checkpoint.load_checkpoint(path, dtype=dtype, attention_backend=attention_backend)
    hf_config, weights, tokenizer = read_checkpoint(path)
    config = hf_checkpoint.model_config(hf_config, path if os.path.isfile(path) else os.path.join(path, "config.json"))
    shard_fn = None
    if mesh is not None:
        factor = sharding.kv_head_replication(config.num_heads, config.num_kv_heads, tp)
        if factor > 1:
            kv_heads = config.num_kv_heads
            config = dataclasses.replace(config, num_kv_heads=kv_heads * factor)
            weights = ((n, sharding.repeat_kv_heads(n, np.asarray(a), kv_heads, factor)) for n, a in weights)
        shard_fn = lambda path, array: sharding.make_array(  # noqa: E731
            mesh, sharding.param_spec(path, array.shape, tp), array)
    model = build_model(config, weights, dtype=dtype, attention_backend=attention_backend, shard_fn=shard_fn)
    return model, config, tokenizer
