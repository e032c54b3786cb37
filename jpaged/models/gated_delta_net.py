"""Gated delta-net linear attention (Qwen3-Next, Qwen3.5): a layer that keeps a fixed-size
recurrent state per sequence instead of K/V per token.

Per token: ``qkv = in_proj_qkv(x)`` goes through a causal depthwise convolution of
``linear_conv_kernel_dim`` taps and silu; q and k (``linear_num_key_heads`` heads of
``linear_key_head_dim``) are L2-normalized, q scaled by ``head_k_dim ** -0.5``, and each serves
``linear_num_value_heads / linear_num_key_heads`` consecutive value heads. The state ``S [Hv, Dk,
Dv]`` of each value head then follows the gated delta rule::

    S = S * exp(g)                 g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    S = S + k (beta (v - k^T S))   beta = sigmoid(in_proj_b(x))
    o = q^T S

and ``o`` goes through an RMS norm gated by ``silu(in_proj_z(x))`` and ``out_proj``. This is
transformers' recurrent form (its prefill runs the equivalent chunked form; float32 results agree
to rounding).

The state of a sequence is two arrays, the convolution's last ``kernel - 1`` inputs ``[kernel - 1,
conv_dim]`` and ``S`` (float32); a layer's state pool holds ``num_slots`` of each
(`state_arrays`), and the step's metadata gives each sequence its slot (``md.state_slots``, -1 for
padding rows, whose state is neither read nor written). A sequence whose step starts at position 0
starts from zeros, whatever its slot held; any other step continues the slot's state, so chunked
prefill carries the state from chunk to chunk. The step's tokens are ragged (``query_start_loc``):
the convolution gathers each token's window from the step's tokens and its sequence's conv state;
the recurrence updates every sequence's state at once in a decode step, and otherwise runs the
step's tokens in order, each on its own sequence's state (`gated_delta_rule`). transformers'
chunked form (blocks of 64 tokens as matmuls) would prefill faster on an accelerator: not done yet.
"""
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jpaged.models.layers import activation, linear, project
from jpaged.models.model_config import ModelConfig

L2_NORM_EPS = 1e-6  # transformers' (and the FLA kernels') l2norm epsilon


@dataclass(frozen=True)
class StateArray:
    """One array of a layer's state pool: ``[num_slots, *shape]`` of ``dtype``; ``head_axis``: the
    axis of ``shape`` that tensor parallelism may split (None: replicated)."""

    shape: tuple[int, ...]
    dtype: object
    head_axis: int | None = None


def text_config(c: ModelConfig) -> dict:
    return c.hf.get("text_config") or c.hf


class GatedRMSNorm(nnx.Module):
    """RMS norm over the last axis (float32 statistics), times ``weight``, times ``silu(gate)``."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * x32.astype(x.dtype)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def l2_normalize(x):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def token_sequences(query_start_loc, num_tokens: int):
    """(each token's sequence [T], its index within the sequence's step [T]); padding tokens get
    the row past the last real sequence (never read)."""
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc[1:], t, side="right"), 0, query_start_loc.shape[0] - 2)
    return seq, t - query_start_loc[seq]


def causal_conv(x, conv_state, weight, query_start_loc):
    """The depthwise causal convolution of each sequence's tokens, continuing its conv state.

    x [T, C] (the step's tokens, ragged by ``query_start_loc [S + 1]``); conv_state [S, K - 1, C]
    (the inputs before each sequence's first token, oldest first); weight [C, K] (tap K - 1 on the
    newest input). Returns (output [T, C] before the activation, new conv state [S, K - 1, C]: the
    last K - 1 inputs of each sequence, those of padding rows unchanged)."""
    t, _ = x.shape
    s, width, _ = conv_state.shape  # width = K - 1
    seq, local = token_sequences(query_start_loc, t)
    # one table of every input a window can reach: the sequences' conv states, then the step's tokens
    inputs = jnp.concatenate([conv_state.reshape(s * width, -1), x], axis=0)

    def rows(seq, local, first_token):
        """Rows of ``inputs`` holding each sequence's input ``local`` (negative: from its state)."""
        return jnp.where(local >= 0, s * width + first_token + local, seq * width + width + local)

    out = jnp.zeros(x.shape, jnp.float32)
    for d in range(width + 1):  # input d steps back meets tap K - 1 - d
        row = rows(seq, local - d, query_start_loc[seq])
        out = out + inputs[row].astype(jnp.float32) * weight[:, width - d].astype(jnp.float32)
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    back = lengths[:, None] - width + jnp.arange(width)[None, :]  # [S, K - 1]: the inputs kept
    seqs = jnp.broadcast_to(jnp.arange(s)[:, None], back.shape)
    new_state = inputs[rows(seqs, back, query_start_loc[:-1, None])]
    return out.astype(x.dtype), new_state


def delta_update(state, q, k, v, g, beta):
    """One token's step of the gated delta rule (any leading axes): state [..., Hv, Dk, Dv]; q, k
    [..., Hv, Dk]; v [..., Hv, Dv]; g, beta [..., Hv]. Returns (o [..., Hv, Dv], the new state),
    as transformers' recurrent form computes them."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.sum(state * k[..., None], axis=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.sum(state * q[..., None], axis=-2), state


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc):
    """The gated delta rule over each sequence's tokens, from its state.

    q, k [T, Hv, Dk] (normalized, q scaled), v [T, Hv, Dv], g and beta [T, Hv], all float32;
    state [S, Hv, Dk, Dv] float32. Returns (o [T, Hv, Dv] float32, zeros for padding tokens, and
    the new state [S, Hv, Dk, Dv]).

    A step of one token per sequence (decode) updates every state at once; any other runs its
    real tokens in order, each reading and writing its own sequence's state only (so the work is
    the tokens', not tokens x padded rows)."""
    t, s = q.shape[0], state.shape[0]
    lengths = query_start_loc[1:] - query_start_loc[:-1]

    def one_token_each(state):
        live = lengths > 0
        token = jnp.where(live, query_start_loc[:-1], 0)
        o, new = delta_update(state, q[token], k[token], v[token], g[token], beta[token])
        out = jnp.zeros(v.shape, jnp.float32).at[jnp.where(live, token, t)].set(o, mode="drop")
        return out, jnp.where(live[:, None, None, None], new, state)

    def token_by_token(state):
        seq, _ = token_sequences(query_start_loc, t)

        def step(i, carry):
            state, out = carry
            o, new = delta_update(lax.dynamic_index_in_dim(state, seq[i], keepdims=False), q[i], k[i], v[i], g[i],
                                  beta[i])
            return lax.dynamic_update_index_in_dim(state, new, seq[i], 0), out.at[i].set(o)

        state, out = lax.fori_loop(0, query_start_loc[s], step, (state, jnp.zeros(v.shape, jnp.float32)))
        return out, state

    return lax.cond(jnp.max(lengths, initial=0) <= 1, one_token_each, token_by_token, state)


class GatedDeltaNet(nnx.Module):
    """A linear-attention layer (the module docstring). Parameters in Qwen3.5's layout:
    ``in_proj_qkv`` (q, k and v of every head, in that order), ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``conv1d`` ``[conv_dim, 1, K]`` (transformers' shape), ``dt_bias``, ``A_log``,
    ``norm`` and ``out_proj``. Call with x [T, hidden], the layer's state pool ``(conv_states
    [slots, K - 1, conv_dim], recurrent_states [slots, Hv, Dk, Dv])`` and the step's metadata;
    returns (out [T, hidden], the updated pool)."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs):
        text = text_config(c)
        self.num_k_heads, self.num_v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
        self.head_k_dim, self.head_v_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
        self.kernel_size = text.get("linear_conv_kernel_dim", 4)
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = linear(c.hidden_size, self.conv_dim, False, dtype, rngs)
        self.in_proj_z = linear(c.hidden_size, value_dim, False, dtype, rngs)
        self.in_proj_b = linear(c.hidden_size, self.num_v_heads, False, dtype, rngs)
        self.in_proj_a = linear(c.hidden_size, self.num_v_heads, False, dtype, rngs)
        self.conv1d = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (self.conv_dim, 1, self.kernel_size),
                                                                dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((self.num_v_heads,), dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, c.norm_eps, dtype)
        self.out_proj = linear(value_dim, c.hidden_size, False, dtype, rngs)
        self.act = activation(c.hidden_act)
        self.dtype = dtype

    def state_arrays(self) -> tuple[StateArray, StateArray]:
        """The state of one sequence: the conv inputs (model dtype) and the recurrent state
        (float32, split by value heads under tensor parallelism)."""
        return (StateArray((self.kernel_size - 1, self.conv_dim), self.dtype),
                StateArray((self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32, head_axis=0))

    def __call__(self, x, state, md):
        t = x.shape[0]
        conv_pool, recurrent_pool = state
        qkv, z, b, a = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        slots = md.state_slots
        num_slots = conv_pool.shape[0]
        read = jnp.clip(slots, 0, num_slots - 1)
        first = md.positions[jnp.clip(md.query_start_loc[:-1], 0, t - 1)]
        fresh = (first == 0) | (slots < 0)  # a step from position 0 starts from zeros
        conv_state = jnp.where(fresh[:, None, None], 0, conv_pool[read]).astype(x.dtype)
        recurrent = jnp.where(fresh[:, None, None, None], 0, recurrent_pool[read])
        mixed, conv_state = causal_conv(qkv, conv_state, self.conv1d[...][:, 0, :], md.query_start_loc)
        # as transformers: the activation's output in the model dtype, the rule in float32
        mixed = self.act(mixed.astype(jnp.float32)).astype(x.dtype).astype(jnp.float32)
        key_dim = self.num_k_heads * self.head_k_dim
        groups = self.num_v_heads // self.num_k_heads
        q = l2_normalize(mixed[:, :key_dim].reshape(t, self.num_k_heads, self.head_k_dim))
        k = l2_normalize(mixed[:, key_dim:2 * key_dim].reshape(t, self.num_k_heads, self.head_k_dim))
        q = q * self.head_k_dim ** -0.5
        q, k = jnp.repeat(q, groups, axis=1), jnp.repeat(k, groups, axis=1)  # each serves `groups` v heads
        v = mixed[:, 2 * key_dim:].reshape(t, self.num_v_heads, self.head_v_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        o, recurrent = gated_delta_rule(q, k, v, g, beta, recurrent, md.query_start_loc)
        o = self.norm(o.astype(x.dtype), z.reshape(t, self.num_v_heads, self.head_v_dim))
        write = jnp.where(slots < 0, num_slots, slots)  # padding rows write nowhere
        conv_pool = conv_pool.at[write].set(conv_state.astype(conv_pool.dtype), mode="drop")
        recurrent_pool = recurrent_pool.at[write].set(recurrent, mode="drop")
        return self.out_proj(o.reshape(t, -1)), (conv_pool, recurrent_pool)

    @staticmethod
    def hf_weight_map(path: tuple, prefix: str):
        out = [(path + (proj, "kernel"), f"{prefix}{proj}.weight", True)
               for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
        out += [(path + (name,), f"{prefix}{name}", False) for name in ("dt_bias", "A_log")]
        return out + [(path + ("conv1d",), f"{prefix}conv1d.weight", False),
                      (path + ("norm", "weight"), f"{prefix}norm.weight", False)]
