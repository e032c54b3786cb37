"""Paged attention as a layer: write this step's K/V into the block pool, then attend through it.

`AttentionMetadata` is the per-step batch description every layer shares; the model runner pads
the step's arrays to its buckets and `make_attention_metadata` turns them into it for a backend.
`PagedAttention` is an NNX module without parameters that a Flax model calls in place of dense
attention; researchers can import it into their own decoder blocks.

KV pool layout, per layer: ``k_pages`` and ``v_pages`` of shape
``[num_kv_heads, num_blocks, block_size, head_dim]``; slot ``s`` is block ``s // block_size``,
offset ``s % block_size``. Heads lead so the pool shards on its first axis. With an 8-bit KV cache
(``kv_cache_dtype`` "int8" or "fp8") a layer's cache is ``(k_pages, v_pages, kv_scales)``: int8 /
float8_e4m3fn pages and one uint32 word per (slot, kv head) holding its bfloat16 K and V scales
(`pallas_kernels.quant`); the write quantizes and attention dequantizes, on every backend. The
cache tuple alone says which: a layer needs no setting of its own.

A layer may have a ``sliding_window`` (a query at position p sees keys ``p - sliding_window < j
<= p``) and a ``logits_soft_cap`` (each scaled score s becomes ``cap * tanh(s / cap)``, Gemma 2),
passed to whichever attention function serves it; only the keys in a window are read, so its work
and the blocks it needs follow the window, not the context. ``sinks`` (gpt-oss: a learned logit per
query head in the softmax's denominator, with no value) is an array the layer's caller passes at
call time (a parameter of the model); the xla backend then runs the jnp loops (the C++ kernel has
no sinks). ``attention_chunk`` (Llama 4's chunked local attention: a query at position p sees the
keys of its chunk, ``p // chunk * chunk <= j <= p``) runs on the Pallas kernels and, on the xla
backend, on the jnp loops (the C++ kernel has no chunks).

Models with several KV-cache groups (layers of different windows: `jpaged.core.kv_cache_layout`)
give each group its own block table and slot mapping: ``group_block_tables`` and
``group_slot_mappings`` hold those of groups 1, 2, ...; ``kv_layout`` says which group and pool
tensor each layer uses (`run_layers` follows it), and ``for_group`` is the metadata a layer of a
group reads. Recurrent layers (`RECURRENT` in `attention_windows`) take a state pool instead of a
pool tensor and read each sequence's slot in it from ``state_slots``.

Backends:
- ``xla`` (the CPU default): on a CPU with float32 pages, the C++ kernel
  `pallas_kernels.cpu.paged_attention` (decode rows and 16-token prompt chunks, each reading
  its own blocks); elsewhere `pallas_kernels.ragged_paged_attention_reference`, the package's one
  jnp paged attention: decode rows and prefill chunks loop over their own blocks with an online
  softmax. Either way the work tracks each sequence's real context, and no extra metadata is needed.
- ``pallas``: the Pallas kernels over the flat token batch (TPU/GPU; interpret mode elsewhere): the
  decode kernel `pallas_kernels.paged_attention` when every row of the step has one query
  (``decode_only``), the ragged kernel otherwise.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from jpaged import sharding
from jpaged.core.kv_cache_layout import RECURRENT, RECURRENT_GROUP
from pallas_kernels import cpu
from pallas_kernels.platform import target_platform


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                                "num_seqs", "positions", "group_slot_mappings", "group_block_tables", "lora",
                                "state_slots"],
                   meta_fields=["decode_only", "kv_layout"])
@dataclasses.dataclass
class AttentionMetadata:
    """Per-step arrays (all int32). T = padded token count, S = padded sequence count, B = padded
    blocks per sequence; every shape is a function of (T, S, B) alone.

    slot_mapping[T]: pool slot each token's K/V is written to (-1 for padding).
    block_tables[S, B], seq_lens[S] (context incl. this step's tokens),
    query_start_loc[S+1], num_seqs[]: the ragged layout the kernels read.
    positions[T]: each token's position in its sequence.
    decode_only (static): every real sequence has one query token, so the pallas backend runs the
      decode kernel. Only the pallas backend sets it: the xla path's run-time loops already skip an
      empty prefill part, so it needs no second compilation per bucket.
    group_slot_mappings[G-1, T], group_block_tables[G-1, S, B]: those of KV-cache groups 1.. (None
      with one group; group 0's are ``slot_mapping`` and ``block_tables``).
    kv_layout (static): (group, pool tensor) of each layer, or None: layer i uses group 0 and
      tensor i.
    lora: each token's adapter slot and the slot grouping (`jpaged.models.lora.LoRAInputs`), or None.
    state_slots[S]: each sequence's recurrent-state slot (-1 for padding rows), or None: a model with
      recurrent layers (`jpaged.models.gated_delta_net`) reads and writes its state pools there.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array
    positions: jax.Array
    group_slot_mappings: jax.Array | None = None
    group_block_tables: jax.Array | None = None
    lora: object = None  # a `jpaged.models.lora.LoRAInputs` when the model serves adapters
    state_slots: jax.Array | None = None
    decode_only: bool = False
    kv_layout: tuple[tuple[int, int], ...] | None = None

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of KV-cache group ``group`` reads (its block tables and slots); a
        recurrent layer (`RECURRENT_GROUP`) and group 0 read the step's own."""
        if group in (0, RECURRENT_GROUP):
            return self
        return dataclasses.replace(self, slot_mapping=self.group_slot_mappings[group - 1],
                                   block_tables=self.group_block_tables[group - 1])


def make_attention_metadata(backend: str, *, positions, slot_mapping, query_start_loc, seq_lens,
                            block_tables, num_seqs, group_slot_mappings=None, group_block_tables=None,
                            kv_layout=None, lora=None, state_slots=None) -> AttentionMetadata:
    """The step's metadata for ``backend`` from host arrays the runner already padded.

    Padding: slot -1, seq_len 0, query_start_loc repeating the real token count, block-table rows 0.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {sorted(BACKENDS)}")
    num_seqs = int(num_seqs)
    qsl = np.asarray(query_start_loc, np.int32)
    decode_only = backend == "pallas" and bool(np.all(np.diff(qsl[:num_seqs + 1]) == 1))
    i32 = lambda x: None if x is None else np.asarray(x, np.int32)  # noqa: E731
    return AttentionMetadata(slot_mapping=i32(slot_mapping), block_tables=i32(block_tables),
                             seq_lens=i32(seq_lens), query_start_loc=qsl,
                             num_seqs=np.array(num_seqs, np.int32), positions=i32(positions),
                             group_slot_mappings=i32(group_slot_mappings),
                             group_block_tables=i32(group_block_tables), lora=lora, state_slots=i32(state_slots),
                             decode_only=decode_only,
                             kv_layout=None if kv_layout is None else tuple(map(tuple, kv_layout)))


def attention_windows(model) -> list:
    """Each layer's kind, in layer order: the sliding window (None: global) of its `PagedAttention`,
    or `RECURRENT` for a layer that keeps a recurrent state instead (one with ``state_arrays``,
    e.g. `jpaged.models.gated_delta_net.GatedDeltaNet`)."""
    windows = [RECURRENT if hasattr(node, "state_arrays") else node.sliding_window for _, node in nnx.iter_graph(model)
               if isinstance(node, PagedAttention) or hasattr(node, "state_arrays")]
    if len(windows) != model.config.num_layers:
        raise ValueError(f"{type(model).__name__}: {len(windows)} PagedAttention or recurrent layers for "
                         f"num_layers={model.config.num_layers} (one per layer, each with its own cache)")
    return windows


def recurrent_state_arrays(model) -> list[tuple]:
    """The ``state_arrays()`` of each recurrent layer of ``model``, in layer order (empty without)."""
    return [node.state_arrays() for _, node in nnx.iter_graph(model) if hasattr(node, "state_arrays")]


def attention_backend_of(model) -> str:
    """The backend of the first `PagedAttention` in ``model`` ("xla" when it has none)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, PagedAttention):
            return node.backend
    return "xla"


def _set(**knobs) -> dict:
    """The attention knobs that are set (the kernels' defaults stand for the others)."""
    return {k: v for k, v in knobs.items() if v is not None}


def xla_paged_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale, sliding_window=None,
                        logits_soft_cap=None, sinks=None, attention_chunk=None, **scales):
    """The C++ CPU kernel where it runs (float32 pages, no sinks or chunks), else the jnp loops."""
    knobs = _set(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if sinks is not None or attention_chunk is not None:
        return pallas_kernels.ragged_paged_attention_reference(
            q, k_pages, v_pages, md.block_tables, md.seq_lens, md.query_start_loc, md.num_seqs, scale=scale,
            **_set(sinks=sinks, attention_chunk=attention_chunk), **knobs, **scales)
    if cpu.runs("paged_attention", q, k_pages, kv_scales=scales.get("kv_scales")):
        return cpu.paged_attention(q, k_pages, v_pages, md.block_tables, md.seq_lens, md.query_start_loc,
                                   md.num_seqs, scale=scale, **knobs).astype(q.dtype)
    return pallas_kernels.ragged_paged_attention_reference(
        q, k_pages, v_pages, md.block_tables, md.seq_lens, md.query_start_loc, md.num_seqs, scale=scale,
        **knobs, **scales)


def _interpret() -> bool:
    return target_platform() not in ("tpu", "gpu")


def pallas_paged_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale, sliding_window=None,
                           logits_soft_cap=None, sinks=None, attention_chunk=None, **scales):
    """The decode kernel for a decode-only step, else the ragged kernel (interpret mode off TPU/GPU)."""
    scales = dict(scales, **_set(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                                 attention_chunk=attention_chunk))
    if md.decode_only:  # token s is sequence s's one query; rows past num_seqs are padding
        t, s = q.shape[0], md.seq_lens.shape[0]
        q_rows = q[:s] if t >= s else jnp.pad(q, ((0, s - t), (0, 0), (0, 0)))
        out = pallas_kernels.paged_attention(q_rows, k_pages, v_pages, md.block_tables, md.seq_lens,
                                             scale=scale, interpret=_interpret(), **scales)
        return out[:t] if s >= t else jnp.pad(out, ((0, t - s), (0, 0), (0, 0)))
    return pallas_kernels.ragged_paged_attention(q, k_pages, v_pages, md.block_tables, md.seq_lens,
                                                 md.query_start_loc, md.num_seqs, scale=scale,
                                                 interpret=_interpret(), **scales)


def pallas_write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, **scales):
    return pallas_kernels.write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, interpret=_interpret(),
                                   **scales)


# name -> (write(k_pages, v_pages, k, v, slot_mapping, **scales), attend(q, k_pages, v_pages, md, *,
# scale, sliding_window=None, logits_soft_cap=None, sinks=None, attention_chunk=None, **scales)); ``scales`` is ``kv_scales=`` with
# 8-bit pages, else empty.
BACKENDS = {"xla": (pallas_kernels.write_kv_reference, xla_paged_attention),
            "pallas": (pallas_write_kv, pallas_paged_attention)}


def resolve_backend(backend: str, platform: str) -> str:
    """The attention backend (a key of `BACKENDS`) for ``attention_backend`` (``"auto"``,
    ``"pallas"`` or ``"xla"``) on ``platform``: ``"auto"`` is ``"pallas"`` on TPU and GPU, ``"xla"``
    elsewhere. With `BACKENDS` this is the one place that picks the attention code; below it the
    kernels only pick their lowering (Mosaic on TPU, Triton on GPU, interpret mode elsewhere) and
    `xla_paged_attention` the C++ CPU kernel where `pallas_kernels.cpu.runs` says it serves."""
    if backend == "auto":
        return "pallas" if platform in ("tpu", "gpu") else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected 'auto' or one of {sorted(BACKENDS)}")
    return backend


class PagedAttention(nnx.Module):
    """Writes K/V for this step's tokens into the paged cache and attends through block tables.

    Call with q [T, Hq, D], k and v [T, Hkv, D], this layer's ``(k_pages, v_pages)`` (or, 8-bit,
    ``(k_pages, v_pages, kv_scales)``) and the step's `AttentionMetadata` (its group's); returns
    the attention output [T, Hq, D] and the updated cache tuple.

    ``sliding_window``: a query at position p attends the keys ``p - sliding_window < j <= p`` only;
    ``logits_soft_cap``: each scaled score s becomes ``cap * tanh(s / cap)``.
    ``attention_chunk``: a query at position p attends the keys ``p // chunk * chunk <= j <= p``.
    ``sinks`` (a call argument, float ``[Hq]``): each head's attention sink, a logit in the
    softmax's denominator with no value (gpt-oss).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 backend: str = "xla", sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attention_chunk: int | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r}: expected one of {sorted(BACKENDS)}")
        pallas_kernels.shapes.check_knobs(sliding_window, logits_soft_cap)
        pallas_kernels.shapes.check_attention_chunk(attention_chunk)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.backend = backend
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.attention_chunk = attention_chunk

    def __call__(self, q, k, v, kv_cache, md: AttentionMetadata, sinks=None):
        write, attend = BACKENDS[self.backend]
        knobs = dict(sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        if self.attention_chunk is not None:
            knobs["attention_chunk"] = self.attention_chunk

        def write_and_attend(q, k, v, kv_cache, md, *sink):
            scales_of = pallas_kernels.quant.scales_of
            kv_cache = tuple(write(*kv_cache[:2], k, v, md.slot_mapping, **scales_of(kv_cache)))
            extra = {"sinks": sink[0]} if sink else {}
            return attend(q, *kv_cache[:2], md, scale=self.scale, **knobs, **extra, **scales_of(kv_cache)), kv_cache

        sink = () if sinks is None else (sinks,)
        if sharding.model_axis_size() > 1:  # each device attends with its own heads and pool slice
            heads, pool, replicated = sharding.HEADS, sharding.POOL, sharding.REPLICATED
            write_and_attend = sharding.shard_heads(write_and_attend,
                                                    (heads, heads, heads, pool, replicated) + (pool,) * len(sink),
                                                    (heads, pool))
        return write_and_attend(q, k, v, tuple(kv_cache), md, *sink)
