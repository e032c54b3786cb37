"""A model split into the pieces the runner jits separately on the CPU: an embedding shell, the
decoder layers in calls of up to `LAYERS_PER_CALL`, and the head.

A new step shape then traces and compiles at most six layers, not the whole model (a 30-layer
model: a fraction of the time and of the executables' memory), and calls of one layer structure
and length share one jitted function.
"""
import functools

import jax
from flax import nnx

from jpaged.models.layers import run_layers
from jpaged.sample.sampler import prompt_logprobs

LAYERS_PER_CALL = 6  # one jitted call runs up to this many layers: compile cost vs dispatches


class LayerPieces:
    """A model split into the pieces the runner jits separately: an embedding shell (the model
    without its decoder layers), and the layers, each with its own state, run in calls of up to
    `LAYERS_PER_CALL` consecutive layers of one structure (calls of one structure and length share
    one jitted function).

    A model takes part by providing ``embed_inputs(input_ids, positions) -> (x, extra)`` (``extra``:
    arrays every layer takes after ``x``, e.g. rotary cos/sin), ``norm_output(hidden)`` (the final
    norm, applied per row), ``compute_logits`` and ``DECODER_LAYERS``, the name of its list of
    layers, each called ``layer(x, *extra, kv_cache, md) -> (x, kv_cache)``. Other models run
    whole (``__call__`` in one jit).

    ``layer_fns[structure](layout, leaves_per_layer, kv_caches, x, extra, md)`` runs a call's layers:
    ``layout`` gives each its (KV-cache group, index into ``kv_caches``), see `run_layers`.
    """

    def __init__(self, model):
        name = model.DECODER_LAYERS
        layers = list(getattr(model, name))
        setattr(model, name, nnx.List([]))
        try:
            shell_graphdef, self.shell_state = nnx.split(model)
        finally:
            setattr(model, name, nnx.List(layers))
        graphdefs, treedefs, self.layer_leaves, self.layer_groups = [], [], [], []
        for layer in layers:
            graphdef, state = nnx.split(layer)
            leaves, treedef = jax.tree.flatten(state)  # a list of arrays: fast to pass to a jit
            if (graphdef, treedef) not in zip(graphdefs, treedefs):
                graphdefs.append(graphdef)
                treedefs.append(treedef)
            self.layer_groups.append(list(zip(graphdefs, treedefs)).index((graphdef, treedef)))
            self.layer_leaves.append(leaves)
        self.calls = []  # (structure, first layer, end): consecutive layers of one structure
        for i, group in enumerate(self.layer_groups):
            last = self.calls[-1] if self.calls else None
            if last and last[0] == group and last[2] == i and i - last[1] < LAYERS_PER_CALL:
                self.calls[-1] = (group, last[1], i + 1)
            else:
                self.calls.append((group, i, i + 1))

        def embed(shell_state, input_ids, positions):
            return nnx.merge(shell_graphdef, shell_state).embed_inputs(input_ids, positions)

        def layers_fn(graphdef, treedef, layout, leaves_per_layer, kv_caches, x, extra, md):
            layers = [nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)) for leaves in leaves_per_layer]
            return run_layers(layers, x, kv_caches, *extra, md, kv_layout=layout)

        def head(shell_state, hidden, prompt_hidden=None, prompt_lp=None):
            """Final norm and logits of the sampled rows (and of the prompt-logprob rows)."""
            model = nnx.merge(shell_graphdef, shell_state)
            prompt_out = None
            if prompt_lp is not None:
                logits = model.compute_logits(model.norm_output(prompt_hidden))
                prompt_out = prompt_logprobs(logits, prompt_lp)
            return model.compute_logits(model.norm_output(hidden)), prompt_out

        self.embed, self.head = embed, head
        self.layer_fns = [functools.partial(layers_fn, g, t) for g, t in zip(graphdefs, treedefs)]

    @classmethod
    def of(cls, model) -> "LayerPieces | None":
        if all(hasattr(model, a) for a in ("DECODER_LAYERS", "embed_inputs", "norm_output")):
            return cls(model)
        return None
