"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks each token's top-k experts,
and each expert's SwiGLU runs once over the tokens routed to it, as a grouped matmul.

Routing: the ``T * k`` (token, expert) assignments are sorted by expert, so each expert's tokens
are one run of rows; `grouped_matmul` multiplies each run by its expert's weights. On TPU that is
`jax.lax.ragged_dot` (XLA:TPU's grouped matmul, no temporaries); elsewhere a loop over the
experts, each over its rows in tiles: XLA's CPU and GPU compilers lower ``ragged_dot`` to a dense
product over every expert (on GPU with one masked copy of the rows per expert, ``[E, rows,
hidden]``: 8 GiB of temporaries per layer for Qwen3-30B-A3B's 2,048-token step), while the loop's
work, and the weights it reads, follow the tokens routed (a decode step of one token reads k
experts' weights, not all of them) and its temporaries are the routed rows. Each token's k outputs are weighted and added in expert
order, as transformers does.

Parallelism over the mesh's ``model`` axis (activations are replicated between blocks):

- tensor parallel (default): every device holds every expert's slice of the intermediate axis
  (gate/up column-parallel, down row-parallel), runs all routed tokens, and the partial outputs are
  summed (one all-reduce, as for a dense MLP);
- expert parallel (``expert_parallel=True``, `EngineConfig.enable_expert_parallel`): each device
  holds ``num_experts / N`` whole experts and runs only the assignments routed to them (every
  device routes the same replicated tokens, so no all-to-all is needed to dispatch them); the
  partial outputs are summed (one all-reduce).
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jpaged import sharding
from jpaged.models.layers import activation
from pallas_kernels.platform import target_platform

ROW_TILE = 64  # rows per matmul of the CPU grouped matmul (a run shorter than this is one tile)


def grouped_matmul(x, w, group_sizes):
    """``x [M, K]`` (rows sorted by group), ``w [G, K, N]``, ``group_sizes`` int32 ``[G]`` (sum <= M)
    -> ``[M, N]``: row r of group g is ``x[r] @ w[g]``; rows past the last group are zeros."""
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    if target_platform() == "tpu":
        out = lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
        return jnp.where((jnp.arange(m) < ends[-1])[:, None], out, 0).astype(x.dtype)
    tile = min(ROW_TILE, m)
    starts = ends - group_sizes
    rows = jnp.pad(x, ((0, tile), (0, 0)))  # a tile that starts near the end never reads past it

    def group(g, out):
        weight = lax.dynamic_index_in_dim(w, g, keepdims=False)

        def run(j, out):
            first = starts[g] + j * tile
            y = lax.dot(lax.dynamic_slice_in_dim(rows, first, tile), weight,
                        preferred_element_type=jnp.float32).astype(x.dtype)
            mine = (first + jnp.arange(tile)) < ends[g]
            keep = lax.dynamic_slice_in_dim(out, first, tile)
            return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y, keep), first, 0)

        return lax.fori_loop(0, (group_sizes[g] + tile - 1) // tile, run, out)

    out = lax.fori_loop(0, w.shape[0], group, zeros_after(group_sizes, (m + tile, w.shape[-1]), x.dtype))
    return out[:m]


def zeros_after(known, shape, dtype):
    """Zeros of ``shape`` that XLA cannot compute before ``known`` (an int array >= 0). Plain
    ``jnp.zeros`` is a broadcast of the constant 0, which XLA:GPU fuses with every other layer's
    (sibling multi-output fusion): every layer's loop buffer is then made at the step's start and
    live through it (Qwen3-30B-A3B's 2,048-token step on H100: 4.6 GiB of temporaries, against
    0.26 GiB with these; docs/tpu_gpu.md, "MoE temporaries")."""
    zero = jnp.where(jnp.min(known) < 0, 1, 0).astype(dtype)
    return jnp.broadcast_to(zero, shape)


def expert_swiglu(x, gate_proj, up_proj, down_proj, group_sizes, act):
    """Each sorted row through its expert's ``down(act(gate(x)) * up(x))``."""
    h = act(grouped_matmul(x, gate_proj, group_sizes)) * grouped_matmul(x, up_proj, group_sizes)
    return grouped_matmul(h, down_proj, group_sizes)


def routed_experts(x, expert_ids, weights, gate_proj, up_proj, down_proj, *, act, first_expert=0, expert_mlp=None):
    """``sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])`` over the experts held here
    (``first_expert ..`` + as many as ``gate_proj`` has; the others' assignments contribute 0).

    x [T, H]; expert_ids, weights [T, k]; gate_proj, up_proj [E, H, I]; down_proj [E, I, H].
    ``expert_mlp``: None (each expert's SwiGLU with ``act``), or ``f(rows [M, H], row_experts [M],
    group_sizes [E]) -> [M, H]``, the experts over the rows sorted by expert (``row_experts``: each
    row's local expert, ``E`` for rows of other devices' experts), e.g. with biases."""
    t, k = expert_ids.shape
    num_local = gate_proj.shape[0]
    local = expert_ids.reshape(-1) - first_expert
    held = (local >= 0) & (local < num_local)
    key = jnp.where(held, local, num_local)  # assignments to other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    if expert_mlp is None:
        y = expert_swiglu(x[order // k], gate_proj, up_proj, down_proj, group_sizes, act)
    else:
        y = expert_mlp(x[order // k], key[order], group_sizes)
    y = zeros_after(group_sizes, y.shape, y.dtype).at[order].set(y, unique_indices=True)  # order: a permutation
    y = y.reshape(t, k, -1)
    y = jnp.where(held.reshape(t, k, 1), y * weights[..., None].astype(y.dtype), 0)
    by_expert = jnp.argsort(expert_ids, axis=-1)  # transformers adds the experts' outputs in id order
    y = jnp.take_along_axis(y, by_expert[..., None], axis=1)
    out = jnp.zeros_like(y[:, 0])
    for j in range(k):
        out = out + y[:, j]
    return out


class Experts(nnx.Module):
    """``num_experts`` SwiGLU MLPs stacked: ``gate_proj``, ``up_proj`` ``[E, hidden, intermediate]``,
    ``down_proj`` ``[E, intermediate, hidden]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden), dtype))


class SparseMoE(nnx.Module):
    """A router (``router [hidden, E]``, kept in float: int8 weights leave it alone) and
    `Experts`; each token goes to its ``top_k`` experts with the softmax probabilities as weights,
    renormalized over the k when ``normalize`` (Mixtral always, Qwen3-MoE with ``norm_topk_prob``)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, normalize: bool,
                 hidden_act: str, dtype, rngs: nnx.Rngs, expert_parallel: bool = False):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: must be in [1, {num_experts}] (the experts)")
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (hidden, num_experts), dtype))
        self.experts = Experts(num_experts, hidden, intermediate, dtype, rngs)
        self.top_k, self.normalize, self.expert_parallel = top_k, normalize, expert_parallel
        self.act = activation(hidden_act)

    def route(self, x):
        """(expert ids [T, k], weights [T, k] float32) of each token."""
        probs = jax.nn.softmax(jnp.dot(x, self.router[...]).astype(jnp.float32), axis=-1)
        weights, expert_ids = lax.top_k(probs, self.top_k)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return expert_ids, weights

    def __call__(self, x):
        return self.run_experts(x, *self.route(x))

    def run_experts(self, x, expert_ids, weights):
        """``sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])`` (x [T, H]; ids, weights [T, k]),
        split over the mesh's ``model`` axis as the module docstring says."""
        e = self.experts
        args = (x, expert_ids, weights, e.gate_proj[...], e.up_proj[...], e.down_proj[...])
        n = sharding.model_axis_size()
        if n == 1:
            return routed_experts(*args, act=self.act)
        num_experts, _, intermediate = e.gate_proj.shape
        specs = sharding.expert_specs(num_experts, intermediate, n, self.expert_parallel)

        def part(x, expert_ids, weights, gate_proj, up_proj, down_proj):
            first = 0
            if self.expert_parallel and specs[0] != sharding.REPLICATED:
                first = lax.axis_index(sharding.MODEL_AXIS) * gate_proj.shape[0]
            out = routed_experts(x, expert_ids, weights, gate_proj, up_proj, down_proj, act=self.act,
                                 first_expert=first)
            return lax.psum(out, sharding.MODEL_AXIS) if specs != (sharding.REPLICATED,) * 3 else out

        rep = sharding.REPLICATED
        return jax.shard_map(part, in_specs=(rep, rep, rep) + specs, out_specs=rep, check_vma=False)(*args)
