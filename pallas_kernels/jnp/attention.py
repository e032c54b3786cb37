"""The jnp paged attention: the CPU path where the C++ kernel does not run, the ``xla`` backend of
every kernel, and what the Pallas kernels are tested against.

Every function here has the same signature as its kernel, so tests and callers can swap one for the
other; ``backend="xla"`` (and the auto choice on CPU) of each kernel is the function here, and so is
the engine's ``attention_backend="xla"``. They are checked against plain numpy loops in
``tests/kernels/test_kernels.py``.

Attention does work in proportion to each sequence's real context, not to the padded batch:

* The flat batch is split into query chunks of one sequence each: every sequence with one new
  token (decode) is a chunk of width 1; a sequence with more is cut into chunks of
  ``num_queries_per_block`` tokens (prefill). The split is computed in the graph from
  ``query_start_loc`` and ``seq_lens``, so it needs no metadata beyond the kernels'.
* Chunks are sorted longest context first and processed a batch at a time: decode rows in batches
  of ``DECODE_ROWS``, prefill chunks in batches of ``PREFILL_BATCH``, in a dynamic loop over the
  real ones (with a single batch, the longest chunk runs alone, so it never makes the short ones
  loop long). For a batch, a loop walks its block tables ``pages_per_compute_block`` blocks at a
  time with an online (flash) softmax; its trip count is ``ceil(longest context in the batch /
  (pages * block_size))``, computed at run time. With a ``sliding_window`` each chunk starts at
  the block holding its first visible key, so the trip count follows the window, not the context. Both loop counts are dynamic
  (``lax.while_loop``), so padding rows, an empty prefill part and unused block-table columns cost
  nothing, and none adds a shape to compile; sorted batches make each row's work track its own
  context, not the step's longest.

Layout (shared with the kernels):
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    kv_scales (8-bit pages only, see ``quant.py``): uint32 ``[num_kv_heads, scale_rows, 128]``;
    attention dequantizes the gathered pages.
    block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
    Query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.shapes import DEFAULT_MASK_VALUE, cdiv, check_attention_chunk, check_knobs, check_sinks

# CPU defaults, measured with scripts/benchmark_kernels.py (docs/benchmarks.md, "Kernels").
PAGES_PER_STEP = 4       # blocks per online-softmax step
PREFILL_CHUNK = 16       # query tokens per prefill chunk
PREFILL_BATCH = 8        # prefill chunks per batch
DECODE_ROWS = 8          # decode rows per batch


def _attend_chunks(out, q, k_pages, v_pages, tables, first_token, first_pos,
                   length, num_chunks, *, width, rows, pages, scale,
                   kv_scales=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                   attention_chunk=None):
    """Writes the attention of ``num_chunks`` query chunks into ``out``.

    Args:
      out: float32 ``[num_tokens, num_q_heads, head_dim]``.
      q: ``[num_tokens, num_q_heads, head_dim]``.
      tables: int32 ``[C, max_blocks]``, the block table of each chunk's
        sequence.
      first_token, first_pos, length: int32 ``[C]``: chunk ``c`` is the
        ``length[c]`` flat tokens from ``first_token[c]``, at positions
        ``first_pos[c] + i``; each attends causally to keys ``0 .. position``
        (the last ``sliding_window`` of them with a window).
        Real chunks come first, longest context first.
      num_chunks: int32 scalar; chunks at/after it are not computed.
      width: static chunk width (>= every length).
      rows: most chunks per batch; pages: blocks per online-softmax step.
      kv_scales: None, or the scale words of 8-bit pages (``quant.py``).
      sliding_window, logits_soft_cap, sinks, attention_chunk: as in
        `ragged_paged_attention_reference`.

    Returns:
      ``out`` with the chunks' rows set (float32).
    """
    num_tokens, hq, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    group = hq // hkv
    bk = pages * bs
    q = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((1, hq, d), jnp.float32)])
    offsets = jnp.arange(width, dtype=jnp.int32)
    num_max = tables.shape[0]
    looped = num_max > rows
    pad = lambda x: jnp.pad(x, ((0, -num_max % rows if looped else 0),)  # noqa: E731
                            + ((0, 0),) * (x.ndim - 1))
    tables, first_token, first_pos, length = map(
        pad, (tables, first_token, first_pos, length))
    words = None if kv_scales is None else quant.block_words(kv_scales, bs)

    def batch(start, size, b, out):
        take = lambda x: lax.dynamic_slice_in_dim(x, start + b * size, size)  # noqa: E731
        table, first, pos0, n = (take(x) for x in (tables, first_token, first_pos,
                                                   length))
        valid = offsets[None, :] < n[:, None]                          # [R, W]
        tokens = jnp.where(valid, first[:, None] + offsets, num_tokens)
        q_pos = pos0[:, None] + offsets                                # [R, W]
        kv_len = jnp.where(n > 0, pos0 + n, 0)                         # [R]
        # Each chunk reads from the block holding its first visible key.
        first_page = jnp.zeros_like(kv_len)
        if sliding_window is not None:
            first_page = jnp.where(n > 0, jnp.maximum(pos0 - sliding_window + 1, 0) // bs, 0)
        if attention_chunk is not None:  # the chunk of the first query starts at or after it
            first_page = jnp.maximum(first_page, jnp.where(n > 0, pos0 // attention_chunk * attention_chunk // bs, 0))
        kv_start = first_page * bs                                     # [R]
        qb = q[tokens].reshape(size, width, hkv, group, d)
        qb = qb.transpose(2, 0, 3, 1, 4).reshape(hkv, size, group * width, d)
        q_pos = jnp.tile(q_pos, (1, group))                            # [R, G*W]
        valid = jnp.tile(valid, (1, group))

        def step(j, carry):
            m_prev, l_prev, acc_prev = carry
            cols = first_page[:, None] + j * pages + jnp.arange(pages)  # [R, P]
            ids = jnp.take_along_axis(table, jnp.minimum(cols, table.shape[1] - 1), axis=1)
            k = k_pages[:, ids].reshape(hkv, size, bk, d).astype(jnp.float32)
            v = v_pages[:, ids].reshape(hkv, size, bk, d).astype(jnp.float32)
            if words is not None:  # 8-bit pages: one scale per (head, token)
                k_scale, v_scale = quant.unpack_scales(words[:, ids].reshape(hkv, size, bk, 1))
                k, v = k * k_scale, v * v_scale
            k_pos = kv_start[:, None] + j * bk + jnp.arange(bk, dtype=jnp.int32)  # [R, K]
            seen = k_pos < kv_len[:, None]
            if sliding_window is not None:  # keys before the chunk's first query's window
                seen &= k_pos > pos0[:, None] - sliding_window
            if attention_chunk is not None:  # keys before the first query's attention chunk
                seen &= k_pos >= (pos0 // attention_chunk * attention_chunk)[:, None]
            v = jnp.where(seen[None, :, :, None], v, 0.0)
            s = jnp.einsum("hrqd,hrkd->hrqk", qb, k) * scale            # [H,R,G*W,K]
            if logits_soft_cap is not None:
                s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
            mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & valid[:, :, None]
            if sliding_window is not None:
                mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
            if attention_chunk is not None:
                mask &= k_pos[:, None, :] >= (q_pos // attention_chunk * attention_chunk)[:, :, None]
            mask = mask[None]                                            # [1,R,G*W,K]
            s = jnp.where(mask, s, DEFAULT_MASK_VALUE)
            m = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m), 0.0)
            alpha = jnp.exp(m_prev - m)
            l = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
            acc = alpha * acc_prev + jnp.einsum("hrqk,hrkd->hrqd", p, v)
            return m, l, acc

        shape = (hkv, size, group * width)
        init = (jnp.full(shape + (1,), -jnp.inf, jnp.float32),
                jnp.zeros(shape + (1,), jnp.float32),
                jnp.zeros(shape + (d,), jnp.float32))
        if sinks is not None:  # the sink: one more logit per head, whose value is zero
            rows = jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, 1, group, 1), width, axis=2)
            init = (jnp.broadcast_to(rows, shape + (1,)), jnp.ones(shape + (1,), jnp.float32), init[2])
        num_steps = cdiv(jnp.max(kv_len - kv_start), bk)
        _, l, acc = lax.fori_loop(0, num_steps, step, init)
        o = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
        o = o.reshape(hkv, size, group, width, d).transpose(1, 3, 0, 2, 4)
        o = o.reshape(size * width, hq, d)
        return out.at[tokens.reshape(-1)].set(o, mode="drop")

    if looped:  # batches of `rows` chunks
        return lax.fori_loop(0, cdiv(num_chunks, rows),
                             functools.partial(batch, 0, rows), out)
    # One batch, but the first (longest) chunk alone, so that it never makes
    # the short ones loop long and a lone chunk computes no padding.
    out = batch(0, 1, 0, out)
    return batch(1, num_max - 1, 0, out) if num_max > 1 else out


def ragged_attention(q, k_pages, v_pages, block_tables, seq_lens,
                     query_start_loc, num_seqs, *, scale,
                     prefill_chunk=PREFILL_CHUNK, pages=PAGES_PER_STEP,
                     prefill_batch=PREFILL_BATCH, kv_scales=None,
                     sliding_window=None, logits_soft_cap=None, decode_attention=None, sinks=None,
                     attention_chunk=None):
    """The work split of the module docstring; arguments as in
    `ragged_paged_attention_reference`."""
    num_tokens = q.shape[0]
    max_seqs = block_tables.shape[0]
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    real = jnp.arange(max_seqs) < num_seqs
    qsl = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32)
    q_len = jnp.where(real, qsl[1:] - qsl[:-1], 0)
    knobs = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 attention_chunk=attention_chunk)
    if decode_attention is not None:  # e.g. cpu_kernels.paged_decode
        if sinks is not None or attention_chunk is not None:
            raise ValueError("sinks, attention_chunk: not taken by decode_attention (the C++ kernel has neither)")
        set_knobs = {k: v for k, v in knobs.items() if v is not None}
        out = decode_attention(q, k_pages, v_pages, tables, seq_lens, qsl, num_seqs,
                               scale=scale, **set_knobs).astype(jnp.float32)
    else:  # one chunk of width 1 per sequence with one query, longest first
        is_decode = q_len == 1
        order = jnp.argsort(jnp.where(is_decode, -seq_lens, 1))
        out = _attend_chunks(
            jnp.zeros(q.shape, jnp.float32), q, k_pages, v_pages, tables[order],
            qsl[order], seq_lens[order] - 1, is_decode[order].astype(jnp.int32),
            jnp.sum(is_decode), width=1, rows=DECODE_ROWS, pages=pages,
            scale=scale, kv_scales=kv_scales, **knobs)

    # Prefill: chunks of `prefill_chunk` tokens, longest context first.
    # Sequence s has ceil(q_len / W) of them; the static count bounds every
    # batch of num_tokens tokens.
    w = min(prefill_chunk, num_tokens)
    counts = jnp.where(q_len > 1, cdiv(q_len, w), 0)
    ends = jnp.cumsum(counts)
    max_chunks = cdiv(num_tokens, w) + min(max_seqs, num_tokens // 2)
    c = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, c, side="right"), max_seqs - 1)
    offset = (c - (ends - counts)[seq]) * w
    length = jnp.where(c < ends[-1], jnp.clip(q_len[seq] - offset, 0, w), 0)
    first_pos = seq_lens[seq] - q_len[seq] + offset
    order = jnp.argsort(jnp.where(length > 0, -(first_pos + length), 1))
    return _attend_chunks(
        out, q, k_pages, v_pages, tables[seq][order], (qsl[seq] + offset)[order],
        first_pos[order], length[order], ends[-1], width=w, rows=prefill_batch,
        pages=pages, scale=scale, kv_scales=kv_scales, **knobs)


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    pages_per_compute_block: int | None = None,
    kv_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention: one query token per sequence.

    Args:
      q: ``[num_seqs, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[num_seqs]``; query ``s`` sits at position ``seq_lens[s] - 1`` and
        attends to positions ``0 .. seq_lens[s] - 1``. Zero gives a zero output row.
      scale: softmax scale applied to ``q @ k``.
      pages_per_compute_block: blocks per online-softmax step (default
        ``PAGES_PER_STEP``).
      kv_scales: the scale words of 8-bit pages (``quant.py``), else None.
      sliding_window: None, or a query at position ``p`` sees only keys ``j > p - sliding_window``.
      logits_soft_cap: None, or the scaled logits ``s`` become ``cap * tanh(s / cap)``.
      sinks: None, or float ``[num_q_heads]``: attention sinks (gpt-oss), one more logit per head
        in the softmax's denominator that takes no value.
      attention_chunk: None, or a query at position ``p`` sees only the keys of its chunk, ``j >=
        p // attention_chunk * attention_chunk`` (Llama 4's chunked local attention).
      backend, interpret: ignored (kernel knobs).

    Returns:
      ``[num_seqs, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    del backend, interpret
    num_seqs = q.shape[0]
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, seq_lens, qsl, num_seqs, scale=scale,
        pages_per_compute_block=pages_per_compute_block, kv_scales=kv_scales,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        attention_chunk=attention_chunk)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    num_queries_per_block: int | None = None,
    pages_per_compute_block: int | None = None,
    kv_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    decode_attention=None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Mixed prefill + decode attention over a flat batch of tokens.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``; rows
        ``query_start_loc[s]:query_start_loc[s + 1]`` belong to sequence ``s``.
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``,
        already holding the new tokens' K/V.
      block_tables: int32 ``[max_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[max_seqs]``, context length including the new tokens.
      query_start_loc: int32 ``[max_seqs + 1]``.
      num_seqs: int32 scalar or ``[1]``.
      scale: softmax scale.
      num_queries_per_block: tokens per prefill chunk (default
        ``PREFILL_CHUNK``).
      pages_per_compute_block: blocks per online-softmax step (default
        ``PAGES_PER_STEP``).
      kv_scales: the scale words of 8-bit pages (``quant.py``), else None.
      sliding_window: None, or a query at position ``p`` sees only keys ``j > p -
        sliding_window`` (as transformers' sliding-window mask); blocks wholly before a chunk's
        window are not read.
      logits_soft_cap: None, or the scaled logits ``s = scale * q.k`` become ``cap * tanh(s /
        cap)`` (Gemma 2).
      decode_attention: None (the jnp loops), or a function with this
        function's leading arguments and ``scale=`` (and the two knobs above when they are set)
        that returns every decode row's attention and zeros elsewhere
        (``cpu_kernels.paged_decode``).
      sinks: None, or float ``[num_q_heads]``: each head's attention sink (gpt-oss), a logit
        ``sinks[h]`` added to the softmax's denominator (``exp(sinks[h])`` beside the keys'
        ``exp(s_j)``) with no value: rows may attend "nowhere". In the scaled logits' units.
      attention_chunk: None, or chunked local attention (Llama 4): a row at position ``p`` sees
        only the keys ``p // attention_chunk * attention_chunk <= j <= p`` (its chunk); blocks
        before a prefill chunk's first attention chunk are not read.
      backend, interpret: ignored (kernel knobs).

    Returns:
      ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``; row ``i`` of
      sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends
      causally; padding rows are zeros.
    """
    del backend, interpret
    quant.pools_of(k_pages, v_pages, kv_scales)
    check_knobs(sliding_window, logits_soft_cap)
    check_sinks(sinks, q.shape[1])
    check_attention_chunk(attention_chunk)
    out = ragged_attention(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, num_seqs,
        scale=scale, prefill_chunk=num_queries_per_block or PREFILL_CHUNK,
        pages=pages_per_compute_block or PAGES_PER_STEP, kv_scales=kv_scales,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        decode_attention=decode_attention, sinks=sinks, attention_chunk=attention_chunk)
    return out.astype(q.dtype)
