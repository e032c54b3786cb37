"""New weights for a model the engine already serves (`LLM.update_weights`).

The engine's parameters are leaves of an ``nnx.State``; each has a fixed shape, dtype and sharding
that the compiled step was built for. `new_leaves` turns new weights, given as

* an ``nnx.State`` (or any pytree with the same key paths) of the engine's own model,
* a flat ``{hf_parameter_name: array}`` mapping (the names of the architecture's Hugging Face
  checkpoints, through the model's ``hf_weight_map``, as the loader reads them), or
* a path: a Hugging Face directory, a ``.safetensors`` file or a jpaged orbax checkpoint (its
  tensors read as the loader reads them: names outside the model's map are skipped),

into arrays of exactly those shapes, dtypes and shardings: each one cast and ``jax.device_put``
onto the engine's sharding (device to device for a ``jax.Array`` on another mesh; an array already
in place is used as it is, not copied). For an int8-quantized engine a float kernel or token table
is quantized again on the device (`quantize_int8_jnp`, the loader's rule). Every name and shape is
checked before anything is placed: a missing, unknown or misshapen weight is a ValueError naming it.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.sharding import key_path_names


def quantize_int8_jnp(w, axis: int):
    """`jpaged.models.quantized.quantize_int8` on the device: (q int8, scale float32), one scale per
    slice along every axis but ``axis``."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -127, 127).astype(jnp.int8)
    return q, scale


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


def read_named_weights(path: str) -> dict:
    """``{hf_parameter_name: array}`` of a Hugging Face directory, a ``.safetensors`` file or an
    orbax checkpoint directory (host arrays)."""
    from jpaged.loading import hf_checkpoint, orbax_checkpoint

    if os.path.isfile(path) and path.endswith(".safetensors"):
        from safetensors.numpy import load_file

        return load_file(path)
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_checkpoint(path):
        return dict(orbax_checkpoint.read_as_hf(path)[1])
    if os.path.isdir(path):
        return dict(hf_checkpoint.iter_safetensors(path))
    raise ValueError(f"weights={path!r}: not a Hugging Face directory, a .safetensors file or an orbax checkpoint")


class WeightTargets:
    """The shape, dtype and sharding of every leaf of the engine's model state, and which leaves
    are parameters (the rest, e.g. rotary tables, are buffers that new weights never replace)."""

    def __init__(self, graphdef, state):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [key_path_names(kp) for kp, _ in flat]
        self.specs = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for p, (_, x) in
                      zip(self.paths, flat)}
        # a leaf left on the default device (not committed, e.g. a rotary table) is put back so:
        # jit keys on it, and a committed copy would compile its callers again
        self.uncommitted = {p for p, (_, x) in zip(self.paths, flat) if not getattr(x, "committed", True)}
        self.param_paths = {key_path_names(kp) for kp, _ in
                            jax.tree_util.tree_flatten_with_path(nnx.state(nnx.merge(graphdef, state), nnx.Param))[0]}
        model = nnx.merge(graphdef, state)
        self.canonical = getattr(model, "canonical_hf_name", lambda n: n)
        # a custom NNX model (``LLM.from_model``) may have no Hugging Face names: None, then only
        # its own state or an orbax checkpoint updates it
        self.hf_map = None if not hasattr(model, "hf_weight_map") else {
            name: (tuple(path), transpose) for path, name, transpose in model.hf_weight_map()}

    def state(self, leaves: dict):
        """The model state with ``leaves`` ({path: array}, every leaf) in the engine's structure."""
        return jax.tree_util.tree_unflatten(self.treedef, [leaves[p] for p in self.paths])

    def place(self, path: tuple, array, what: str):
        """``array`` cast to the leaf's dtype and put on its sharding (a ValueError on a shape mismatch)."""
        spec = self.specs[path]
        if tuple(array.shape) != tuple(spec.shape):
            raise ValueError(f"weights: {what}: shape {tuple(array.shape)} != the model's {tuple(spec.shape)}")
        if not isinstance(array, jax.Array):
            array = np.asarray(array)
        if array.dtype != spec.dtype:
            array = array.astype(spec.dtype)
        if path in self.uncommitted:
            return jax.device_put(array)
        if isinstance(array, jax.Array) and array.sharding.is_equivalent_to(spec.sharding, array.ndim):
            return array
        return jax.device_put(array, spec.sharding)

    # The three forms -----------------------------------------------------------------------------------
    def from_state(self, state) -> dict:
        """{path: placed array} of the parameters of an ``nnx.State`` (or pytree) of the engine's model."""
        flat = {key_path_names(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        extra = sorted(_name(p) for p in flat if p not in self.specs)
        if extra:
            raise ValueError(f"weights: unknown parameter(s) {extra[:5]} (not in the engine's model)")
        missing = sorted(_name(p) for p in self.param_paths if p not in flat)
        if missing:
            raise ValueError(f"weights: missing parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for path, x in flat.items():  # every shape before any transfer
            if tuple(np.shape(x)) != tuple(self.specs[path].shape):
                raise ValueError(f"weights: {_name(path)}: shape {tuple(np.shape(x))} != the model's "
                                 f"{tuple(self.specs[path].shape)}")
        return {path: self.place(path, x, _name(path)) for path, x in flat.items()}

    def from_hf(self, named: dict, ignore_unknown: bool = False) -> dict:
        """{path: placed array} from ``{hf_parameter_name: array}`` (every name of the model's map).
        ``ignore_unknown``: names outside the map are skipped, as the loader skips them in a
        checkpoint file (a tied ``lm_head.weight``, an old ``rotary_emb.inv_freq``)."""
        if self.hf_map is None:
            raise ValueError("weights: this model has no Hugging Face parameter names (hf_weight_map); "
                             "pass its nnx.State instead")
        by_name = {self.canonical(str(name)): x for name, x in named.items()}
        extra = sorted(n for n in by_name if n not in self.hf_map)
        if extra and not ignore_unknown:
            raise ValueError(f"weights: unknown parameter name(s) {extra[:5]} (not a weight of this architecture)")
        missing = sorted(n for n in self.hf_map if n not in by_name)
        if missing:
            raise ValueError(f"weights: missing parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        prepared = {}  # path -> (array in the model's orientation, hf name); stacked slices collected
        stacks: dict[tuple, dict[int, object]] = {}
        for name, (path, transpose) in self.hf_map.items():
            x = by_name[name]
            x = x.T if transpose else x
            if isinstance(path[-1], int):  # one expert's slice of a stacked parameter
                stacks.setdefault(path[:-1], {})[path[-1]] = (x, name)
            else:
                prepared[path] = (x, name)
        for path, slices in stacks.items():
            parts = [slices[i][0] for i in range(len(slices))]
            self._check_shape(path, (len(parts),) + tuple(np.shape(parts[0])), slices[0][1])
            stack = jnp.stack if any(isinstance(p, jax.Array) for p in parts) else np.stack
            prepared[path] = (stack(parts), slices[0][1])
        for path, (x, name) in prepared.items():  # every shape before any transfer
            self._check_shape(path, tuple(np.shape(x)), name)
        out = {}
        for path, (x, name) in prepared.items():
            scale_path = path[:-1] + ("scale",)
            if self.specs[path].dtype == jnp.int8 and scale_path in self.specs:  # an int8 engine: quantize again
                q, scale = quantize_int8_jnp(x, axis=1 if path[-1] == "embedding" else 0)
                out[path], out[scale_path] = self.place(path, q, name), self.place(scale_path, scale, name)
            else:
                out[path] = self.place(path, x, name)
        return out

    def _check_shape(self, path: tuple, shape: tuple, name: str) -> None:
        if path not in self.specs:
            raise ValueError(f"weights: {name}: the engine's model has no parameter {_name(path)} "
                             "(its quantization keeps this weight in another form)")
        if shape != tuple(self.specs[path].shape):
            raise ValueError(f"weights: {name}: shape {shape} != the model's {tuple(self.specs[path].shape)}")

    def new_leaves(self, weights) -> dict:
        """{path: placed array} of the parameters ``weights`` gives (any of the three forms)."""
        if isinstance(weights, (str, os.PathLike)):
            return self.from_hf(read_named_weights(os.fspath(weights)), ignore_unknown=True)
        if isinstance(weights, nnx.State):
            return self.from_state(weights)
        if isinstance(weights, dict) and weights and all(isinstance(k, str) for k in weights) and \
                any("." in k for k in weights):
            return self.from_hf(weights)
        if isinstance(weights, dict) or hasattr(weights, "items"):
            return self.from_state(weights)
        raise ValueError(f"weights: expected an nnx.State, a {{hf_parameter_name: array}} dict or a path, "
                         f"got {type(weights).__name__}")
