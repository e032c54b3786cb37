"""New weights for a model the engine already serves (`LLM.update_weights`).

The engine's parameters are leaves of an ``nnx.State``; each has a fixed shape, dtype and sharding
that the compiled step was built for. `new_leaves` turns new weights, given as

* an ``nnx.State`` (or any pytree with the same key paths) of the engine's own model,
* a flat ``{hf_parameter_name: array}`` mapping (the names of the architecture's Hugging Face
  checkpoints, through the model's ``hf_weight_map``, as the loader reads them), or
* a path: a Hugging Face directory, a ``.safetensors`` file or a jpaged orbax checkpoint (its
  tensors read as the loader reads them: names outside the model's map are skipped),

into arrays of exactly those shapes, dtypes and shardings. Every name and shape is checked before
anything is placed: a missing, unknown or misshapen weight is a ValueError naming it. Then, for the
whole tree at once (`Assembly`):

* an array already of the leaf's dtype and sharding is used as it is (not copied);
* the others not yet on the engine's devices (host arrays, a ``jax.Array`` on the trainer's mesh)
  move in one batched ``jax.device_put`` onto the engine's mesh, device to device, in their own
  orientation;
* one jitted program (compiled once per tree signature) then transposes the Hugging Face
  ``[out, in]`` kernels, stacks per-expert slices, casts, quantizes again for an int8 engine
  (`quantize_int8_jnp`, the loader's rule) and lays every leaf out on its sharding, writing into
  the donated buffers of the old weights where the engine owns them.
"""
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.sharding import is_placed, is_row_major_leaf, key_path_names


def quantize_int8_jnp(w, axis: int):
    """`jpaged.models.quantized.quantize_int8` on the device: (q int8, scale float32), one scale per
    slice along every axis but ``axis``."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -127, 127).astype(jnp.int8)
    return q, scale


def host_copies(arrays: list) -> list:
    """Host (numpy) copies of device arrays that own their memory: on the CPU ``device_get`` may
    return a view of the device buffer, which would keep it alive."""
    return [h if h.flags.owndata else h.copy() for h in jax.device_get(arrays)]


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


class Recipe(NamedTuple):
    """How one parameter leaf is made from its source array(s) (static: part of the jit key)."""

    transpose: bool  # a Hugging Face ``[out, in]`` kernel: the engine keeps ``[in, out]``
    num_stacked: int  # >0: per-expert slices (one source each) stacked on a new first axis
    quantize_axis: int | None  # an int8 engine: quantized along it, a second output (the scale)
    dtype: str  # the leaf's dtype (float leaves: cast to it)


def _assemble(recipes: tuple, sources: list, donated: list) -> list:
    """Every recipe's output(s), in order (``sources[i]``: an array, or a tuple of slices)."""
    del donated  # only there so that XLA writes the outputs into the old weights' buffers
    out = []
    for recipe, x in zip(recipes, sources):
        if recipe.num_stacked:
            x = jnp.stack([s.T if recipe.transpose else s for s in x])
        elif recipe.transpose:
            x = x.T
        if recipe.quantize_axis is None:
            out.append(x.astype(recipe.dtype))
        else:
            out.extend(quantize_int8_jnp(x, recipe.quantize_axis))
    return out


class WeightTargets:
    """The shape, dtype and sharding of every leaf of the engine's model state, and which leaves
    are parameters (the rest, e.g. rotary tables, are buffers that new weights never replace).

    ``borrowed``: paths of leaves whose buffers someone outside the engine may hold (a model given
    to ``LLM.from_model``, an array of an update used as it is): never donated."""

    def __init__(self, graphdef, state, weights_shared: bool = False):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [key_path_names(kp) for kp, _ in flat]
        # an embedding table keeps its row-major order too (`sharding.param_format`): `spec.format`
        self.specs = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.format if (
            is_row_major_leaf(p) and getattr(x, "committed", False)) else x.sharding) for p, (_, x) in
            zip(self.paths, flat)}
        # a leaf left on the default device (not committed, e.g. a rotary table) is put back so:
        # jit keys on it, and a committed copy would compile its callers again
        self.uncommitted = {p for p, (_, x) in zip(self.paths, flat) if not getattr(x, "committed", True)}
        self.borrowed = set(self.paths) if weights_shared else set()
        self.param_paths = {key_path_names(kp) for kp, _ in
                            jax.tree_util.tree_flatten_with_path(nnx.state(nnx.merge(graphdef, state), nnx.Param))[0]}
        model = nnx.merge(graphdef, state)
        self.canonical = getattr(model, "canonical_hf_name", lambda n: n)
        # a custom NNX model (``LLM.from_model``) may have no Hugging Face names: None, then only
        # its own state or an orbax checkpoint updates it
        self.hf_map = None if not hasattr(model, "hf_weight_map") else {
            name: (tuple(path), transpose) for path, name, transpose in model.hf_weight_map()}
        self._assemblers: dict = {}  # (recipes, output paths, donated paths) -> jitted `_assemble`

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
        if is_placed(array, spec.format):
            return array
        return jax.device_put(array, spec.format)

    def place_all(self, arrays: dict) -> dict:
        """{path: array} (host copies of leaves, e.g. after sleep) back on their shardings, in one
        batched transfer."""
        moved = [p for p in arrays if p not in self.uncommitted]
        out = {p: jax.device_put(arrays[p]) for p in arrays if p in self.uncommitted}
        out.update(zip(moved, jax.device_put([arrays[p] for p in moved], [self.specs[p].format for p in moved])))
        return out

    # The three forms -----------------------------------------------------------------------------------
    def from_state(self, state, old: dict | None = None) -> dict:
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
        return self.assemble({path: (x, Recipe(False, 0, None, str(self.specs[path].dtype)))
                              for path, x in flat.items()}, old)

    def from_hf(self, named: dict, ignore_unknown: bool = False, old: dict | None = None) -> dict:
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
        single: dict[tuple, tuple] = {}  # path -> (array as given, hf name, transpose)
        stacks: dict[tuple, dict[int, tuple]] = {}  # one expert's slice of a stacked parameter
        for name, (path, transpose) in self.hf_map.items():
            if isinstance(path[-1], int):
                stacks.setdefault(path[:-1], {})[path[-1]] = (by_name[name], name, transpose)
            else:
                single[path] = (by_name[name], name, transpose)
        jobs = {}  # every shape before any transfer
        for path, (x, name, transpose) in single.items():
            shape = tuple(np.shape(x))
            self._check_shape(path, shape[::-1] if transpose else shape, name)
            jobs[path] = (x, self._recipe(path, transpose, 0))
        for path, slices in stacks.items():
            parts = [slices[i] for i in range(len(slices))]
            shape = tuple(np.shape(parts[0][0]))
            self._check_shape(path, (len(parts),) + (shape[::-1] if parts[0][2] else shape), parts[0][1])
            for x, name, _ in parts[1:]:
                if tuple(np.shape(x)) != shape:
                    raise ValueError(f"weights: {name}: shape {tuple(np.shape(x))} != its other experts' {shape}")
            jobs[path] = (tuple(x for x, _, _ in parts), self._recipe(path, parts[0][2], len(parts)))
        return self.assemble(jobs, old)

    def _recipe(self, path: tuple, transpose: bool, num_stacked: int) -> Recipe:
        spec = self.specs[path]
        scale_path = path[:-1] + ("scale",)
        quantize = spec.dtype == jnp.int8 and scale_path in self.specs  # an int8 engine: quantize again
        return Recipe(transpose, num_stacked, (1 if path[-1] == "embedding" else 0) if quantize else None,
                      "float32" if quantize else str(spec.dtype))

    def _check_shape(self, path: tuple, shape: tuple, name: str) -> None:
        if path not in self.specs:
            raise ValueError(f"weights: {name}: the engine's model has no parameter {_name(path)} "
                             "(its quantization keeps this weight in another form)")
        if shape != tuple(self.specs[path].shape):
            raise ValueError(f"weights: {name}: shape {shape} != the model's {tuple(self.specs[path].shape)}")

    # Placing a checked tree ---------------------------------------------------------------------------
    def _outputs(self, path: tuple, recipe: Recipe) -> tuple:
        return (path,) if recipe.quantize_axis is None else (path, path[:-1] + ("scale",))

    def _in_place(self, path: tuple, x, recipe: Recipe) -> bool:
        """``x`` is already the leaf (its dtype and sharding, nothing to transpose or stack)."""
        spec = self.specs[path]
        return (recipe == Recipe(False, 0, None, str(spec.dtype)) and isinstance(x, jax.Array)
                and x.dtype == spec.dtype and getattr(x, "committed", True) and is_placed(x, spec.format))

    def _source_sharding(self, path: tuple, recipe: Recipe):
        """Where a source goes on the engine's mesh before the assembly: the leaf's sharding in the
        source's orientation (a transposed kernel: the axes swapped; an expert slice: without the
        expert axis)."""
        sharding = self.specs[path].sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return sharding
        ndim = len(self.specs[path].shape)
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        if recipe.num_stacked:
            spec = spec[1:]
        if recipe.transpose:
            spec = spec[::-1]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))

    def _to_engine_devices(self, jobs: dict) -> dict:
        """The sources not yet on the engine's devices (host arrays, the trainer's mesh) moved there
        in one batched ``jax.device_put``, device to device."""
        moves = []  # (path, slice index or None, array, sharding)
        for path, (x, recipe) in jobs.items():
            devices = self.specs[path].sharding.device_set
            for i, s in enumerate(x) if recipe.num_stacked else [(None, x)]:
                if not (isinstance(s, jax.Array) and s.sharding.device_set == devices):
                    moves.append((path, i, s if isinstance(s, jax.Array) else np.asarray(s),
                                  self._source_sharding(path, recipe)))
        if not moves:
            return jobs
        moved = jax.device_put([m[2] for m in moves], [m[3] for m in moves])
        jobs = {path: (list(x) if recipe.num_stacked else x, recipe) for path, (x, recipe) in jobs.items()}
        for (path, i, _, _), y in zip(moves, moved):
            if i is None:
                jobs[path] = (y, jobs[path][1])
            else:
                jobs[path][0][i] = y
        return {path: (tuple(x) if recipe.num_stacked else x, recipe) for path, (x, recipe) in jobs.items()}

    def assemble(self, jobs: dict, old: dict | None = None) -> dict:
        """{path: leaf} of checked ``jobs`` ({path: (source, Recipe)}): leaves already in place as
        they are (then borrowed), the rest from one jitted `_assemble` onto the leaves' shardings;
        ``old`` ({path: the engine's current leaf}): those the engine owns are donated to it."""
        out = {}
        for path in [p for p in jobs if p in self.uncommitted]:  # e.g. rotary tables, a given model's
            x, recipe = jobs.pop(path)  # leaves: op by op, so that they stay uncommitted (jit keys on it)
            if recipe != Recipe(False, 0, None, str(self.specs[path].dtype)):
                x = _assemble((recipe,), [x], [])
                x = x[0] if len(x) == 1 else x
            for o, y in zip(self._outputs(path, recipe), x if isinstance(x, list) else [x]):
                out[o] = self.place(o, y, _name(o))
        for path in [p for p, (x, r) in jobs.items() if self._in_place(p, x, r)]:
            out[path] = jobs.pop(path)[0]
            self.borrowed.add(path)
        if not jobs:
            return out
        jobs = self._to_engine_devices(jobs)
        paths = tuple(jobs)
        recipes = tuple(jobs[p][1] for p in paths)
        outputs = tuple(o for p, r in zip(paths, recipes) for o in self._outputs(p, r))
        sources = {id(a) for x, _ in jobs.values() for a in (x if isinstance(x, tuple) else (x,))}
        donated = tuple(p for p in outputs if old is not None and p in old and p not in self.borrowed
                        and id(old[p]) not in sources)  # never a buffer the update also reads
        key = (recipes, outputs, donated)
        if key not in self._assemblers:
            # keep_unused: the donated old leaves are not read, and an argument jit prunes is not donated
            self._assemblers[key] = jax.jit(functools.partial(_assemble, recipes), donate_argnums=(1,),
                                            keep_unused=True, out_shardings=[self.specs[p].format for p in outputs])
        leaves = self._assemblers[key]([jobs[p][0] for p in paths], [old[p] for p in donated])
        out.update(zip(outputs, leaves))
        self.borrowed.difference_update(outputs)
        return out

    def new_leaves(self, weights, old: dict | None = None) -> dict:
        """{path: placed array} of the parameters ``weights`` gives (any of the three forms).
        ``old``: the engine's current leaves, whose buffers the new ones may take over."""
        if isinstance(weights, (str, os.PathLike)):
            return self.from_hf(read_named_weights(os.fspath(weights)), ignore_unknown=True, old=old)
        if isinstance(weights, nnx.State):
            return self.from_state(weights, old)
        if isinstance(weights, dict) and weights and all(isinstance(k, str) for k in weights) and \
                any("." in k for k in weights):
            return self.from_hf(weights, old=old)
        if isinstance(weights, dict) or hasattr(weights, "items"):
            return self.from_state(weights, old)
        raise ValueError(f"weights: expected an nnx.State, a {{hf_parameter_name: array}} dict or a path, "
                         f"got {type(weights).__name__}")
