"""Dense (non-paged) forward passes over ``[B, L]`` batches: for training and as a no-cache oracle.

The engine runs a model one flat token batch at a time through the paged KV cache. Training and
testing want the opposite: whole sequences, no cache. Rather than keep a second copy of each
architecture, this module runs *the same NNX model, unchanged*: `dense_view(model)` returns a view of
it (sharing every array) in which each `PagedAttention` layer is replaced by `DenseCausalAttention`,
a layer with the same call signature that ignores the cache and attends causally within each row
of the batch. The model's own ``__call__`` then runs over the flattened ``[B * L]`` tokens.

This works for any model with the jpaged model interface whose attention goes through
`jpaged.models.attention.PagedAttention` held as a module attribute (the built-in Llama family and
models written like `examples/custom_model.py`)::

    hidden = dense_forward(model, tokens)            # [B, L, hidden]
    logits = dense_logits(model, tokens)             # [B, L, vocab] float32
    loss = causal_lm_loss(model, tokens)             # next-token cross-entropy, differentiable
    ids = greedy_generate(model, prompt, max_tokens=8)   # argmax each step, full recompute

All of them can be traced by `jax.jit` / `nnx.jit` and differentiated with `nnx.grad`.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.attention import PagedAttention


@functools.partial(jax.tree_util.register_dataclass, data_fields=["positions"],
                   meta_fields=["batch_size", "seq_len"])
@dataclasses.dataclass
class DenseMetadata:
    """Stands in for `AttentionMetadata` in a dense forward: the batch shape and token positions."""

    batch_size: int
    seq_len: int
    positions: jax.Array  # [B * L]


class DenseCausalAttention(nnx.Module):
    """Causal attention within each row of a ``[B, L]`` batch, no KV cache.

    Same call as `PagedAttention`: ``(q [T, Hq, D], k, v [T, Hkv, D], kv_cache, md) -> (out, kv_cache)``
    with ``T = B * L`` and ``md`` a `DenseMetadata`; ``kv_cache`` is passed through untouched.
    ``sliding_window``, ``logits_soft_cap``, ``attention_chunk`` and the ``sinks`` call argument as in
    `PagedAttention`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attention_chunk: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.attention_chunk = attention_chunk

    @classmethod
    def like(cls, layer: PagedAttention) -> "DenseCausalAttention":
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, scale=layer.scale,
                   sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap,
                   attention_chunk=getattr(layer, "attention_chunk", None))

    def __call__(self, q, k, v, kv_cache, md: DenseMetadata, sinks=None):
        b, l = md.batch_size, md.seq_len
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        q = q.reshape(b, l, hkv, group, d)
        k, v = k.reshape(b, l, hkv, d), v.reshape(b, l, hkv, d)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * self.scale
        if self.logits_soft_cap is not None:
            s = self.logits_soft_cap * jnp.tanh(s / self.logits_soft_cap)
        causal = jnp.tril(jnp.ones((l, l), bool))
        if self.sliding_window is not None:
            causal &= ~jnp.tril(jnp.ones((l, l), bool), -self.sliding_window)
        if self.attention_chunk is not None:
            pos = jnp.arange(l)
            causal &= (pos[None, :] // self.attention_chunk) == (pos[:, None] // self.attention_chunk)
        s = jnp.where(causal, s, -1e30)
        if sinks is None:
            p = jax.nn.softmax(s, axis=-1)
        else:  # one more logit per head in the denominator, whose weight is dropped
            sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1), s.shape[:-1] + (1,))
            p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(b * l, self.num_heads, d).astype(q.dtype), kv_cache


def dense_view(model):
    """A view of ``model`` sharing its arrays, with every `PagedAttention` attribute made dense.

    The original model is not modified. Gradients taken through the view reach the original
    model's parameters (they are the same arrays / tracers).
    """
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)
    swapped = 0
    for _, node in list(nnx.iter_graph(view)):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in list(vars(node).items()):
            if isinstance(value, PagedAttention):
                setattr(node, name, DenseCausalAttention.like(value))
                swapped += 1
    if swapped == 0:
        raise ValueError(f"{type(model).__name__}: no PagedAttention layer found as a module attribute; "
                         "dense_view needs the model's attention to go through jpaged.models.attention.PagedAttention")
    return view


def dense_forward(model, input_ids, positions=None):
    """Final hidden states ``[B, L, hidden]`` of ``input_ids [B, L]`` (positions default 0..L-1)."""
    b, l = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    positions = positions.reshape(-1).astype(jnp.int32)
    md = DenseMetadata(b, l, positions)
    view = dense_view(model)
    hidden, _ = view(input_ids.reshape(-1), positions, [None] * model.config.num_layers, md)
    return hidden.reshape(b, l, -1)


def dense_logits(model, input_ids, positions=None):
    """Logits ``[B, L, vocab]`` (float32) of ``input_ids [B, L]``."""
    b, l = input_ids.shape
    hidden = dense_forward(model, input_ids, positions)
    return model.compute_logits(hidden.reshape(b * l, -1)).reshape(b, l, -1)


def causal_lm_loss(model, tokens, mask=None):
    """Mean next-token cross-entropy of ``tokens [B, L]`` (predicts ``tokens[:, 1:]``).

    ``mask [B, L - 1]`` (optional) weights the predicted positions, e.g. to skip padding.
    """
    logits = dense_logits(model, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    if mask is None:
        return nll.mean()
    mask = mask.astype(nll.dtype)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def greedy_generate(model, prompt_token_ids, max_tokens: int, *, max_len: int | None = None) -> list[int]:
    """Greedy decoding without any cache: each step runs the whole sequence and takes the argmax.

    The sequence is padded to ``max_len`` (default: prompt + max_tokens, rounded up to 16) so one
    compilation serves every step; causal attention keeps the padding out of real positions.
    """
    ids = list(prompt_token_ids)
    length = max_len or -(-(len(ids) + max_tokens) // 16) * 16
    if len(ids) + max_tokens > length:
        raise ValueError(f"max_len={length}: too short for {len(ids)} prompt + {max_tokens} new tokens")
    graphdef, state = nnx.split(model)  # (a GraphDef holding a ModelConfig is not hashable: close over it)
    last_logits = jax.jit(lambda state, ids, n: dense_logits(nnx.merge(graphdef, state), ids[None])[0, n - 1])
    buf = np.zeros(length, np.int32)
    out = []
    for _ in range(max_tokens):
        buf[:len(ids)] = ids
        token = int(jnp.argmax(last_logits(state, jnp.asarray(buf), len(ids))))
        ids.append(token)
        out.append(token)
    return out
