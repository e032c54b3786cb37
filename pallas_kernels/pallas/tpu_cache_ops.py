"""TPU (Mosaic) kernels of ``write_kv`` and ``copy_blocks``: tile-granular read-modify-writes.

A TPU DMA moves whole tiles of a 16- or 8-bit array ((16, 128) of bfloat16, (32, 128) of int8 on
the last two dimensions), so one token's row of a ``[num_kv_heads, num_blocks, block_size,
head_dim]`` page cannot be written on its own, and a scale word is one lane of a 128-word row.
The write kernels therefore work on *units*: ``unit`` consecutive slots that are one aligned tile
of rows of a page (``min(block_size, 32 // itemsize)`` rows: 8 for float32, 16 for bfloat16, 32
for 8-bit pages), or one 128-word row of ``kv_scales``. Per unit touched by the write they DMA it
into VMEM for all heads at once (skipped when every slot of it is new), place the new rows, and
DMA it back.

The wrapper sorts the write by slot (``lax.sort``, keeping the last of duplicate slots), so the
slots of one unit are consecutive and each unit is visited once: the kernel runs over units with
double-buffered DMAs (unit ``r + 1`` is read while unit ``r`` is merged) and no unit is read while
it is being written. New rows are fetched token by token (a leading-axis DMA of ``[1,
num_kv_heads, head_dim]``); new scale words come from SMEM.

``copy_blocks`` copies pages with one strided DMA per block (all in flight together); with 8-bit
pages each block's scale words are rotated into their destination row, one copy after another
(rows may hold several blocks).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.pallas.common import tpu_call

_NO_SLOT = jnp.iinfo(jnp.int32).max


def _shapes(arrays):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]


def sorted_slots(slot_mapping):
    """``(slots, tokens)``: the valid slots ascending (the last of duplicates kept, padding
    ``_NO_SLOT`` at the end) and the token each came from; sorts only, no gather."""
    t = slot_mapping.shape[0]
    key = jnp.where(slot_mapping >= 0, slot_mapping, _NO_SLOT).astype(jnp.int32)
    key, tokens = lax.sort((key, jnp.arange(t, dtype=jnp.int32)), num_keys=1, is_stable=True)
    later_twin = jnp.concatenate([key[:-1] == key[1:], jnp.zeros((1,), bool)])
    key = jnp.where(later_twin, _NO_SLOT, key)
    return lax.sort((key, tokens), num_keys=1, is_stable=True)


def unit_runs(slots, unit):
    """Runs of sorted ``slots`` that share a unit of ``unit`` slots.

    Returns:
      ``(run_first [T + 1], num_runs [1])``: run ``r`` is sorted positions ``run_first[r] ..
      run_first[r + 1] - 1``; entries past ``num_runs`` hold the number of valid slots.
    """
    t = slots.shape[0]
    valid = slots != _NO_SLOT
    units = slots // unit
    starts = valid & jnp.concatenate([jnp.ones((1,), bool), units[1:] != units[:-1]])
    pos = jnp.arange(t, dtype=jnp.int32)
    first = lax.sort(jnp.where(starts, pos, t + pos))
    num_valid = jnp.sum(valid).astype(jnp.int32)
    run_first = jnp.concatenate([jnp.where(first < t, first, num_valid), num_valid[None]])
    return run_first, jnp.sum(starts).astype(jnp.int32)[None]


class _Units:
    """Reads, merges and writes back the units of one run (one ``pallas_call`` of a write)."""

    def __init__(self, slots_ref, tokens_ref, run_first_ref, unit, block_size):
        self.slots, self.tokens, self.run_first = slots_ref, tokens_ref, run_first_ref
        self.unit, self.block_size = unit, block_size

    def run(self, r):
        """``(first sorted position, number of slots, unit id)`` of run ``r``."""
        first = self.run_first[r]
        return first, self.run_first[r + 1] - first, lax.div(self.slots[first], self.unit)

    def pipeline(self, num_runs, start_in, wait_in, merge, start_out, wait_out):
        """Runs ``[0, num_runs)``, unit ``r + 1`` read while unit ``r`` is merged (slot ``r %
        2``); a slot is reused only after its previous write-back finished."""

        @pl.when(num_runs > 0)
        def _():
            start_in(0, 0)

        def body(r, carry):
            slot = r % 2

            @pl.when(r >= 1)
            def _():
                wait_out(r - 1, 1 - slot)

            @pl.when(r + 1 < num_runs)
            def _():
                start_in(r + 1, 1 - slot)

            wait_in(r, slot)
            merge(r, slot)
            start_out(r, slot)
            return carry

        lax.fori_loop(0, num_runs, body, 0)

        @pl.when(num_runs > 0)
        def _():
            wait_out(num_runs - 1, (num_runs - 1) % 2)


# ---------------------------------------------------------------------------
# write_kv: pages.
# ---------------------------------------------------------------------------


def page_unit(block_size: int, dtype) -> int:
    """Slots per unit of a page array: one native tile of rows, at most a page."""
    return min(block_size, 32 // jnp.dtype(dtype).itemsize)


def _write_pages_kernel(slots_ref, tokens_ref, run_first_ref, num_runs_ref, *refs, unit):
    # refs: 2 new-row arrays [T, H, D] float32 (HBM), 2 pools (aliased, unused), 2 output pools
    # (HBM), 2 unit buffers [2, H, unit, D], 2 row buffers [2, unit, H, D] float32, sems: DMA
    # [3, 2] (unit in, rows in, unit out).
    rows_hbm, outs, ubufs, rbufs, sems = refs[0:2], refs[4:6], refs[6:8], refs[8:10], refs[10]
    num_kv_heads, _, block_size, _ = outs[0].shape
    units = _Units(slots_ref, tokens_ref, run_first_ref, unit, block_size)
    units_per_page = block_size // unit

    def where(u):
        page, row0 = lax.div(u, units_per_page), lax.rem(u, units_per_page) * unit
        return page, pl.multiple_of(row0, unit)

    def unit_copies(r, slot, to_hbm):
        _, _, u = units.run(r)
        page, row0 = where(u)
        copies = []
        for out, ubuf in zip(outs, ubufs):
            hbm = out.at[:, page, pl.ds(row0, unit)]
            src, dst = (ubuf.at[slot], hbm) if to_hbm else (hbm, ubuf.at[slot])
            copies.append(pltpu.make_async_copy(src, dst, sems.at[2 if to_hbm else 0, slot]))
        return copies

    def row_copies(r, slot):
        first, n, _ = units.run(r)
        copies = []
        for i in range(unit):
            token = tokens_ref[jnp.minimum(first + i, tokens_ref.shape[0] - 1)]
            copies.append((i < n, [
                pltpu.make_async_copy(rows.at[pl.ds(token, 1)], rbuf.at[slot, pl.ds(i, 1)],
                                      sems.at[1, slot])
                for rows, rbuf in zip(rows_hbm, rbufs)]))
        return copies

    def each(copies, method, cond=True):
        @pl.when(cond)
        def _():
            for c in copies:
                getattr(c, method)()

    def in_flight(r, slot, method):
        _, n, _ = units.run(r)
        each(unit_copies(r, slot, False), method, n < unit)  # a full unit is not read
        for needed, copies in row_copies(r, slot):
            each(copies, method, needed)

    def merge(r, slot):
        first, n, _ = units.run(r)
        rows_iota = lax.broadcasted_iota(jnp.int32, ubufs[0].shape[2:], 0)
        for ubuf, rbuf in zip(ubufs, rbufs):
            for h in range(num_kv_heads):
                def put(i, x, h=h, rbuf=rbuf):
                    offset = lax.rem(slots_ref[first + i], unit)
                    row = rbuf[slot, i, pl.ds(h, 1), :]
                    return jnp.where(rows_iota == offset, row, x)

                x = lax.fori_loop(0, n, put, ubuf[slot, h].astype(jnp.float32))
                ubuf[slot, h] = x.astype(ubuf.dtype)

    units.pipeline(
        num_runs_ref[0],
        start_in=lambda r, slot: in_flight(r, slot, "start"),
        wait_in=lambda r, slot: in_flight(r, slot, "wait"),
        merge=merge,
        start_out=lambda r, slot: each(unit_copies(r, slot, True), "start"),
        wait_out=lambda r, slot: each(unit_copies(r, slot, True), "wait"))


def write_pages(slots, tokens, k_pages, v_pages, k_new, v_new, *, interpret):
    """Writes ``k_new``/``v_new`` ``[T, H, D]`` into the pages at the sorted ``slots`` (see
    `sorted_slots`); returns the aliased pools."""
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    unit = page_unit(block_size, k_pages.dtype)
    run_first, num_runs = unit_runs(slots, unit)
    pools = (k_pages, v_pages)
    # Rows travel as float32 (exact for every page dtype), the dtype the merge computes in.
    rows = [x.astype(p.dtype).astype(jnp.float32) for x, p in zip((k_new, v_new), pools)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = ([pltpu.VMEM((2, num_kv_heads, unit, head_dim), p.dtype) for p in pools]
               + [pltpu.VMEM((2, unit, num_kv_heads, head_dim), jnp.float32)] * 2
               + [pltpu.SemaphoreType.DMA((3, 2))])
    return tpu_call(
        functools.partial(_write_pages_kernel, unit=unit), grid=(1,), num_scalar_prefetch=4,
        in_specs=[any_spec] * 4, out_specs=[any_spec] * 2, out_shape=_shapes(pools),
        scratch_shapes=scratch, parallel=False,
        # Operand indices count the scalar-prefetch operands.
        aliases={4 + 2: 0, 4 + 3: 1}, interpret=interpret, name="write_kv_tpu",
    )(slots, tokens, run_first, num_runs, *rows, *pools)


# ---------------------------------------------------------------------------
# write_kv: scale words.
# ---------------------------------------------------------------------------


def _write_words_kernel(slots_ref, tokens_ref, run_first_ref, num_runs_ref, words_ref, _,
                        out_ref, buf, sems):
    # words_ref: the new words [T * H] (SMEM); out_ref: kv_scales [H, R, 128] (HBM, aliased);
    # buf: [2, H, 1, 128]; sems: DMA [2 (in, out), 2].
    num_kv_heads, _, lanes = out_ref.shape
    units = _Units(slots_ref, tokens_ref, run_first_ref, lanes, 0)

    def copy(r, slot, to_hbm):
        _, _, row = units.run(r)
        hbm = out_ref.at[:, pl.ds(row, 1)]
        src, dst = (buf.at[slot], hbm) if to_hbm else (hbm, buf.at[slot])
        return pltpu.make_async_copy(src, dst, sems.at[int(to_hbm), slot])

    def merge(r, slot):
        first, n, _ = units.run(r)
        lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
        for h in range(num_kv_heads):
            def put(i, x, h=h):
                offset = lax.rem(slots_ref[first + i], lanes)
                word = words_ref[tokens_ref[first + i] * num_kv_heads + h]
                return jnp.where(lane == offset, word, x)

            buf[slot, h] = lax.fori_loop(0, n, put, buf[slot, h])

    units.pipeline(
        num_runs_ref[0],
        start_in=lambda r, slot: copy(r, slot, False).start(),
        wait_in=lambda r, slot: copy(r, slot, False).wait(),
        merge=merge,
        start_out=lambda r, slot: copy(r, slot, True).start(),
        wait_out=lambda r, slot: copy(r, slot, True).wait())


def write_words(slots, tokens, kv_scales, words, *, interpret):
    """Writes scale words ``[T, H]`` into ``kv_scales`` at the sorted ``slots``."""
    num_kv_heads, _, lanes = kv_scales.shape
    run_first, num_runs = unit_runs(slots, lanes)
    flat = lax.bitcast_convert_type(words.astype(quant.SCALE_WORD_DTYPE), jnp.int32).reshape(-1)
    view = lax.bitcast_convert_type(kv_scales, jnp.int32)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = tpu_call(
        _write_words_kernel, grid=(1,), num_scalar_prefetch=5,
        in_specs=[any_spec], out_specs=any_spec, out_shape=_shapes([view])[0],
        scratch_shapes=[pltpu.VMEM((2, num_kv_heads, 1, lanes), jnp.int32),
                        pltpu.SemaphoreType.DMA((2, 2))],
        parallel=False, aliases={5: 0}, interpret=interpret, name="write_kv_scales_tpu",
    )(slots, tokens, run_first, num_runs, flat, view)
    return lax.bitcast_convert_type(out, quant.SCALE_WORD_DTYPE)


def write_kv_tpu(slot_mapping, *arrays, interpret):
    """``write_kv`` on TPU: ``arrays`` are the pools then the rows of `quant.pools_and_rows`."""
    n = len(arrays) // 2
    pools, rows = arrays[:n], arrays[n:]
    slots, tokens = sorted_slots(slot_mapping)
    out = write_pages(slots, tokens, *pools[:2], *rows[:2], interpret=interpret)
    if n > 2:
        out = (*out, write_words(slots, tokens, pools[2], rows[2], interpret=interpret))
    return tuple(out)


# ---------------------------------------------------------------------------
# copy_blocks.
# ---------------------------------------------------------------------------


def _copy_blocks_kernel(src_ref, dst_ref, *refs, quantized):
    # refs: n pools (aliased, unused), n output pools, [word buffers [2, H, 1, 128]], sems:
    # DMA [2] (pages, words).
    n = 3 if quantized else 2
    outs, sems = refs[n:2 * n], refs[-1]
    num_copies = src_ref.shape[0]
    block_size = outs[0].shape[2]

    def pairs(method):
        def body(i, carry):
            src, dst = src_ref[i], dst_ref[i]

            @pl.when((src >= 0) & (dst >= 0))
            def _():
                for pages in outs[:2]:
                    copy = pltpu.make_async_copy(pages.at[:, src], pages.at[:, dst], sems.at[0])
                    getattr(copy, method)()
            return carry
        lax.fori_loop(0, num_copies, body, 0)

    pairs("start")
    if quantized:
        _copy_words(src_ref, dst_ref, outs[2], refs[2 * n], sems.at[1], block_size)
    pairs("wait")


def _copy_words(src_ref, dst_ref, words, buf, sem, block_size):
    """Copies each pair's scale words, one pair after another: whole rows with a DMA, or (rows
    shared by several blocks) a read-rotate-write of the destination row."""
    lanes = words.shape[2]
    rows = max(1, block_size // lanes)

    def sync(src, dst):
        copy = pltpu.make_async_copy(src, dst, sem)
        copy.start()
        copy.wait()

    def body(i, carry):
        src, dst = src_ref[i], dst_ref[i]

        @pl.when((src >= 0) & (dst >= 0))
        def _():
            if block_size >= lanes:
                sync(words.at[:, pl.ds(src * rows, rows)], words.at[:, pl.ds(dst * rows, rows)])
                return
            src_row, src_lane = lax.div(src * block_size, lanes), lax.rem(src * block_size, lanes)
            dst_row, dst_lane = lax.div(dst * block_size, lanes), lax.rem(dst * block_size, lanes)
            sync(words.at[:, pl.ds(src_row, 1)], buf.at[0])
            sync(words.at[:, pl.ds(dst_row, 1)], buf.at[1])
            lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
            keep = (lane < dst_lane) | (lane >= dst_lane + block_size)
            shift = lax.rem(dst_lane - src_lane + lanes, lanes)
            for h in range(words.shape[0]):
                buf[1, h] = jnp.where(keep, buf[1, h], pltpu.roll(buf[0, h], shift, 1))
            sync(buf.at[1], words.at[:, pl.ds(dst_row, 1)])
        return carry

    lax.fori_loop(0, src_ref.shape[0], body, 0)


def copy_blocks_tpu(src, dst, *pools, interpret):
    """``copy_blocks`` on TPU: ``pools`` are ``(k_pages, v_pages[, kv_scales])``."""
    n = len(pools)
    quantized = n == 3
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    arrays = list(pools)
    if quantized:  # 32-bit words as int32, the type Mosaic rotates
        arrays[2] = lax.bitcast_convert_type(arrays[2], jnp.int32)
    scratch = [pltpu.SemaphoreType.DMA((2,))]
    if quantized:
        scratch.insert(0, pltpu.VMEM((2, pools[2].shape[0], 1, quant.LANES), jnp.int32))
    out = tpu_call(
        functools.partial(_copy_blocks_kernel, quantized=quantized), grid=(1,),
        num_scalar_prefetch=2, in_specs=[any_spec] * n, out_specs=[any_spec] * n,
        out_shape=_shapes(arrays), scratch_shapes=scratch, parallel=False,
        aliases={2 + i: i for i in range(n)}, interpret=interpret, name="copy_blocks_tpu",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *arrays)
    if quantized:
        out = (*out[:2], lax.bitcast_convert_type(out[2], quant.SCALE_WORD_DTYPE))
    return tuple(out)
