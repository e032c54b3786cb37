"""Turns a model reference (HF directory, GGUF file or jpaged orbax checkpoint directory) into a
loaded NNX model and tokenizer.

With ``quantization`` ("int8", or "gguf" for a GGUF file) the weights of the linear layers and of
the token embedding are quantized as they arrive, one tensor at a time: the model is created
abstractly (`nnx.eval_shape`), and the ``nnx.Linear`` / ``nnx.Embed`` a weight is meant for is
replaced by its quantized counterpart from `jpaged.models.quantized`, so the model classes and
their ``hf_weight_map`` stay as they are.
"""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import sharding
from jpaged.config import check_quantization
from jpaged.loading import hf_checkpoint, orbax_checkpoint
from jpaged.models import ModelConfig, model_class
from jpaged.models.quantized import GGUFEmbed, GGUFLinear, QuantizedEmbed, QuantizedLinear, quantize_int8


TOKEN_TABLES = {"embed_tokens", "wte"}  # the models' token embeddings (positions tables stay float)


def read_checkpoint(path: str, keep_gguf_blocks: bool = False):
    """(hf config dict, iterable of (name, array), tokenizer or None) for a directory or .gguf file.
    ``keep_gguf_blocks``: a GGUF file's Q8_0 / Q4_0 / Q4_1 matrices come as ``GGUFBlocks``."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jpaged.loading.gguf_loader import iter_gguf

        return iter_gguf(path, keep_quantized=keep_gguf_blocks)
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        return orbax_checkpoint.read_as_hf(path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r}: directory has no config.json")
        config = hf_checkpoint.read_config(path)
        # checked before transformers reads config.json again for the tokenizer (its errors name no file)
        hf_checkpoint.model_config(config, os.path.join(path, "config.json"))
        return config, hf_checkpoint.iter_safetensors(path), hf_checkpoint.load_tokenizer(path)
    raise ValueError(f"model={path!r}: not a Hugging Face directory, a .gguf file or a known preset")


def _set(module, path, value):
    var = _variable(module, path)
    if tuple(var.shape) != tuple(value.shape):
        raise ValueError(f"weight {'.'.join(map(str, path))}: checkpoint shape {value.shape} "
                         f"!= model shape {tuple(var.shape)}")
    var.set_value(value)


def _quantized_module(old, array, dtype, place):
    """The quantized replacement of ``old`` (an ``nnx.Linear`` or the token ``nnx.Embed``) holding
    ``array`` (a float kernel ``[in, out]`` / table ``[vocab, hidden]``, or ``GGUFBlocks`` in HF
    ``[out, in]`` orientation), its leaves placed by ``place(leaf name, host array)``."""
    from jpaged.loading.gguf_loader import GGUFBlocks

    embed = isinstance(old, nnx.Embed)
    if isinstance(array, GGUFBlocks):
        qweight, scales, mins = array.parts()
        q, s, m = place("qweight", qweight), place("scales", scales), None if mins is None else place("mins", mins)
        if embed:
            return GGUFEmbed(array.kind, q, s, m, dtype=dtype)
        return GGUFLinear(array.kind, q, s, m, bias=old.bias)
    q, scale = quantize_int8(array, axis=1 if embed else 0)  # per row of a table, per column of a kernel
    if embed:
        return QuantizedEmbed(place("embedding", q), place("scale", scale), dtype)
    return QuantizedLinear(place("kernel", q), place("scale", scale), bias=old.bias)


def _target(model, path):
    """(parent module, attribute name, module) of the module holding the parameter at ``path``."""
    parent = model
    for p in path[:-2]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    return parent, path[-2], getattr(parent, path[-2])


class _Stacks:
    """Stacked parameters (a mixture's experts) filled one slice per checkpoint tensor: a
    weight-map path that ends in an index names slice ``index`` of the parameter before it. A
    parameter is placed once its last slice has arrived."""

    def __init__(self, model, dtype, place):
        self.model, self.dtype, self.place = model, dtype, place
        self.filling: dict[tuple, tuple[np.ndarray, set]] = {}

    def add(self, path: tuple, array: np.ndarray) -> None:
        param_path, index = path[:-1], path[-1]
        if param_path not in self.filling:
            var = _variable(self.model, param_path)
            self.filling[param_path] = (np.empty(tuple(var.shape), self.dtype), set())
        buffer, done = self.filling[param_path]
        if tuple(array.shape) != buffer.shape[1:]:
            raise ValueError(f"weight {'.'.join(map(str, path))}: checkpoint shape {array.shape} "
                             f"!= model shape {buffer.shape[1:]}")
        buffer[index] = array
        done.add(index)
        if len(done) == buffer.shape[0]:
            _set(self.model, param_path, self.place(param_path, buffer))
            del self.filling[param_path]


def _variable(module, path):
    for p in path[:-1]:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    return getattr(module, path[-1])


def _expert_parallel_args(cls, config: ModelConfig, expert_parallel: bool) -> dict:
    """The model class's keyword for ``expert_parallel`` (none when off); a ValueError for a model
    without experts."""
    if not expert_parallel:
        return {}
    if not getattr(cls, "HAS_EXPERTS", False):
        raise ValueError(f"enable_expert_parallel=True: {config.architecture} has no experts")
    return {"expert_parallel": True}


def build_model(config: ModelConfig, weights, *, dtype, attention_backend: str, shard_fn=None,
                quantization: str | None = None, expert_parallel: bool = False):
    """Creates the model without initializing it, then fills every parameter from ``weights``.

    ``quantization="int8"``: every linear kernel and the token table are quantized on arrival
    (`quantize_int8`); ``"gguf"``: weights that arrive as ``GGUFBlocks`` keep their blocks (the
    others load as float). A ``GGUFBlocks`` meant for anything else is dequantized to float.
    ``expert_parallel``: a mixture-of-experts model places whole experts per device."""
    from jpaged.loading.gguf_loader import GGUFBlocks

    cls = model_class(config)
    extra = _expert_parallel_args(cls, config, expert_parallel)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, attention_backend=attention_backend,
                                       rngs=nnx.Rngs(0), **extra))
    wanted = {name: (path, transpose) for path, name, transpose in model.hf_weight_map()}
    seen = set()
    canonical = getattr(model, "canonical_hf_name", lambda n: n)  # hub names -> save_pretrained names
    weights = getattr(model, "convert_hf_weights", lambda w: w)(weights)  # fused / packed tensors, split

    def place(path, array):
        return jnp.asarray(array) if shard_fn is None else shard_fn(path, array)

    stacks = _Stacks(model, dtype, place)
    for name, array in weights:
        name = canonical(name)
        if name not in wanted:
            continue
        path, transpose = wanted[name]
        if isinstance(path[-1], int):  # one slice of a stacked parameter
            array = array.dequantize() if isinstance(array, GGUFBlocks) else np.asarray(array)
            stacks.add(path, (array.T if transpose else array).astype(dtype, copy=False))
            seen.add(name)
            continue
        parent, attr, module = _target(model, path) if len(path) > 1 else (None, None, None)
        linear = isinstance(module, nnx.Linear) and path[-1] == "kernel"
        table = isinstance(module, nnx.Embed) and path[-1] == "embedding" and attr in TOKEN_TABLES
        blocks = isinstance(array, GGUFBlocks)
        # GGUF matrices are [out, in] (HF Linear orientation): kept for a transposed kernel, or a table
        keep = blocks and quantization == "gguf" and ((linear and transpose) or (table and not transpose))
        if blocks and not keep:
            array = array.dequantize()
        if not keep:
            array = np.asarray(array)
            array = array.T if transpose else array
        if keep or ((linear or table) and quantization == "int8"):
            array = array if keep else array.astype(np.float32, copy=False)
            setattr(parent, attr, _quantized_module(module, array, dtype,
                                                    lambda leaf, a, p=path[:-1]: place(p + (leaf,), a)))
        else:
            _set(model, path, place(path, array.astype(dtype, copy=False)))
        seen.add(name)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.init_buffers()
    return model


def abstract_model(config: ModelConfig, *, dtype, attention_backend: str, quantization: str | None = None,
                   expert_parallel: bool = False):
    """The model `build_model` would make, without weights: every parameter a ``jax.ShapeDtypeStruct``
    (``quantization="int8"``: the linear kernels and the token table as `build_model` would quantize
    them). For compiling ahead of time; a GGUF file's blocks need the file, so ``"gguf"`` is refused."""
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization={quantization!r}: only None or 'int8' can be compiled without weights")
    cls = model_class(config)
    extra = _expert_parallel_args(cls, config, expert_parallel)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, attention_backend=attention_backend, rngs=nnx.Rngs(0),
                                       **extra))
    if quantization == "int8":
        s = jax.ShapeDtypeStruct
        for path, _, transpose in model.hf_weight_map():
            if len(path) < 2:
                continue
            parent, attr, module = _target(model, path)
            if isinstance(module, nnx.Linear) and path[-1] == "kernel":
                din, dout = module.kernel.shape
                setattr(parent, attr, QuantizedLinear(s((din, dout), jnp.int8), s((dout,), jnp.float32),
                                                      bias=module.bias))
            elif isinstance(module, nnx.Embed) and path[-1] == "embedding" and attr in TOKEN_TABLES:
                vocab, hidden = module.embedding.shape
                setattr(parent, attr, QuantizedEmbed(s((vocab, hidden), jnp.int8), s((vocab,), jnp.float32), dtype))
    return model


def kv_replicated_config(config: ModelConfig, tensor_parallel_size: int) -> tuple[ModelConfig, int]:
    """``config`` with each KV head repeated so that every device of ``tensor_parallel_size`` owns
    whole heads (`sharding.kv_head_replication`), and the repeat factor."""
    factor = sharding.kv_head_replication(config.num_heads, config.num_kv_heads, tensor_parallel_size)
    if factor == 1:
        return config, 1
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * factor), factor


def _repeat_kv_heads(name, array, kv_heads: int, factor: int):
    """`sharding.repeat_kv_heads` for a float array or the rows of ``GGUFBlocks``."""
    from jpaged.loading.gguf_loader import GGUFBlocks

    if isinstance(array, GGUFBlocks):
        rows = sharding.repeat_kv_heads(name, array.rows, kv_heads, factor)
        return dataclasses.replace(array, rows=rows, shape=(rows.shape[0], array.shape[1]))
    return sharding.repeat_kv_heads(name, np.asarray(array), kv_heads, factor)


def load_model(path: str, *, dtype, attention_backend: str, mesh=None, quantization: str | None = None,
               expert_parallel: bool = False):
    """(model, config, tokenizer); with a mesh, every weight goes straight into its shards.
    ``quantization``: None, "int8" or "gguf" (a .gguf file's blocks kept), see `build_model`;
    ``expert_parallel``: a mixture's experts split whole over the mesh (`sharding.expert_specs`)."""
    check_quantization(quantization, path)
    tp = 1 if mesh is None else mesh.shape[sharding.MODEL_AXIS]
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        _, config = orbax_checkpoint.read_manifest(path)
        if (quantization is None and not expert_parallel
                and sharding.kv_head_replication(config.num_heads, config.num_kv_heads, tp) == 1):
            # restored as saved (any NNX model class); the runner places it on the mesh
            return orbax_checkpoint.load_checkpoint(path, dtype=dtype, attention_backend=attention_backend)
    hf_config, weights, tokenizer = read_checkpoint(path, keep_gguf_blocks=quantization == "gguf")
    config = hf_checkpoint.model_config(hf_config, path if os.path.isfile(path) else os.path.join(path, "config.json"))
    shard_fn = None
    if mesh is not None:
        kv_heads = config.num_kv_heads
        config, factor = kv_replicated_config(config, tp)
        if factor > 1:
            weights = ((n, _repeat_kv_heads(n, a, kv_heads, factor)) for n, a in weights)
        shard_fn = lambda path, array: sharding.make_array(  # noqa: E731
            sharding.param_format(path, array.shape, mesh, expert_parallel), array)
    model = build_model(config, weights, dtype=dtype, attention_backend=attention_backend, shard_fn=shard_fn,
                        quantization=quantization, expert_parallel=expert_parallel)
    return model, config, tokenizer
