"""Kernel microbenchmarks: paged attention on engine-like steps (old vs new CPU path), paged vs
dense attention, and the few-row matmul against XLA's dot. Each run first prints the machine (CPU
model, AVX-512 or AVX2, cores, load) and its float32 GEMM peak, measured then.

``--mode=steps`` (default) times the engine's ``xla`` attention on step shapes like the ones
``sharegpt-like`` produces (5-62 rows of ragged contexts, one long row among short ones, a long
prompt's prefill mixed with decode rows), one layer of bench-llama's attention (2 KV heads x 4,
head dim 64, block 16), against the formulation it replaced (every chunk gathers its sequence's
blocks padded to the step's power-of-two bucket, then einsum + masked softmax). Per case it
prints both times, their ratio, and the K/V bytes and attention FLOPs each formulation touches
against what the real contexts need (``attended``):

  python scripts/benchmark_kernels.py --mode=steps

``--mode=dense``: for each (batch, context) pair, builds a KV pool with shuffled block tables
and a dense ``[batch, context, num_kv_heads, head_dim]`` cache holding the
same tokens, then times one decode attention step of each (jitted,
``block_until_ready``, warmup runs, median of ``--num_runs``) and prints the
ratio paged / dense.

  python scripts/benchmark_kernels.py --mode=dense --batch=1,8,32 --context=512,2048
  python scripts/benchmark_kernels.py --mode=dense --backend=pallas   # on TPU / GPU

``--mode=matmul``: a model's weight shapes (``--model bench-llama,smollm2``: the projections of
one input in one call, as the layers make them), ``--rows`` rows each: the C++ matmul against
XLA's dot with the weights evicted from the caches before each (as a decode step finds them;
`pallas_kernels.cpu.measure.time_steps`), and against the alternatives XLA offers in the same
process: the weight stored transposed ``[N, K]`` (``xla_wT``: a layout its GEMM might read without
re-packing) and bfloat16 weights and rows with float32 results (``xla_bf16``). Each as ms, weight
GB/s, GFLOP/s and the fraction of the GEMM peak. A model whose output projection is its tied
embedding table (SmolLM2) also gets its logits: ``jpaged_matmul_t`` on the table as it lies,
``[vocab, K]``, against XLA's ``x @ table.T``, what the engine's measured dispatch compares. XLA's own
options (``XLA_FLAGS``) are compared by running it once per setting: the C++ column is the
yardstick in each process.

  python scripts/benchmark_kernels.py --mode=matmul --model=bench-llama --rows=1,2,4,8,16,32,64
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_dot python scripts/benchmark_kernels.py --mode=matmul

``--mode=layers``: the packed matmuls of a decode step as the step makes them, layer after layer in
one XLA program, each layer with its own weights (as many layers as the model has: they stream from
memory unless the model fits the caches), the projections' outputs feeding the next as in a Llama
layer; against the same program on one layer's weights repeated (warm). Per ``--rows``: ms per
layer, weight GB/s and GFLOP/s (the least of 15 runs, and the median):

  python scripts/benchmark_kernels.py --mode=layers --model=smollm2 --rows=8,16,32,64

``--backend=xla`` times the pure-jnp reference (the CPU path).
``--backend=pallas`` times the Pallas kernel for the current platform; on CPU
that is interpret mode, useful as a smoke test only.
"""

import functools
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench_common import CACHE_DIR, describe_machine, model_dir
from pallas_kernels import cpu as cpu_kernels
from pallas_kernels.cpu import measure

_MODE = flags.DEFINE_enum("mode", "steps", ["steps", "dense", "matmul", "layers"],
                          "Engine-like steps (old vs new xla path), paged vs dense decode, the matmul, or the "
                          "matmuls of every layer in turn.")
_MODEL = flags.DEFINE_list("model", ["bench-llama"], "--mode=matmul/layers: bench-llama, smollm2 or HF directories")
_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64"], "--mode=matmul/layers: rows per matmul")
_BATCH = flags.DEFINE_list("batch", ["1", "8", "32"], "Batch sizes.")
_CONTEXT = flags.DEFINE_list("context", ["256", "1024", "2048"],
                             "Context lengths (tokens per sequence).")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
_GROUP = flags.DEFINE_integer("group", 4, "Query heads per KV head.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_PAGES_PER_COMPUTE_BLOCK = flags.DEFINE_integer(
    "pages_per_compute_block", 8, "Kernel knob (pallas backend).")
_BACKEND = flags.DEFINE_enum("backend", "xla", ["xla", "pallas"],
                             "Paged implementation to time.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Activation and cache dtype.")
_NUM_RUNS = flags.DEFINE_integer("num_runs", 10, "Timed runs (median).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed runs after compiling.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


def dense_attention(q, k, v, seq_lens, *, scale):
    """q [B, Hq, D]; k, v [B, T, KVH, D]; attends to the first seq_lens[b]."""
    b, hq, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, kvh, hq // kvh, d)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, k,
                        preferred_element_type=jnp.float32) * scale
    mask = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgt,btkd->bkgd", w.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def run_times(fn, *args, runs=None) -> list[float]:
    """Seconds of each of ``runs`` (default ``--num_runs``) calls of ``fn(*args)``, after compiling
    and ``--warmup`` untimed calls."""
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(_WARMUP.value):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs or _NUM_RUNS.value):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def time_fn(fn, *args):
    return statistics.median(run_times(fn, *args))


def make_inputs(rng, batch, context, dtype):
    kvh, d, bs = _NUM_KV_HEADS.value, _HEAD_DIM.value, _BLOCK_SIZE.value
    hq = kvh * _GROUP.value
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    dense_k = rng.standard_normal((batch, blocks_per_seq * bs, kvh, d),
                                  np.float32)
    dense_v = rng.standard_normal(dense_k.shape, np.float32)
    tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq)
    k_pages = np.zeros((kvh, num_blocks, bs, d), np.float32)
    v_pages = np.zeros_like(k_pages)
    # Block j of sequence b holds dense tokens [j * bs, (j + 1) * bs).
    k_blocks = dense_k.reshape(batch, blocks_per_seq, bs, kvh, d)
    v_blocks = dense_v.reshape(batch, blocks_per_seq, bs, kvh, d)
    k_pages[:, tables] = k_blocks.transpose(3, 0, 1, 2, 4)
    v_pages[:, tables] = v_blocks.transpose(3, 0, 1, 2, 4)
    q = rng.standard_normal((batch, hq, d), np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    paged = (cast(q), cast(k_pages), cast(v_pages),
             jnp.asarray(tables, jnp.int32), seq_lens)
    dense = (cast(q), cast(dense_k), cast(dense_v), seq_lens)
    return paged, dense


# ---------------------------------------------------------------------------
# --mode=steps
# ---------------------------------------------------------------------------

STEP_CASES = {  # name: (q_len, context) per sequence
    "decode 62 rows, one 1,188-token": [(1, 1188)] + [(1, 150 + 11 * i) for i in range(61)],
    "decode 5 rows, one 740-token": [(1, 740), (1, 90), (1, 210), (1, 64), (1, 330)],
    "decode 32 rows x 200-256 (fixed)": [(1, 200 + 2 * i) for i in range(32)],
    "decode 1 row, 500 (single stream)": [(1, 500)],
    "2,048-token prompt + 20 decode rows": [(2048, 2048)] + [(1, 100 + 40 * i) for i in range(20)],
    "512-token chunk at 1,536 + 30 decode": [(512, 2048)] + [(1, 120 + 20 * i) for i in range(30)],
}


def bucket(n, minimum=1):
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def padded_gather_attention(q, k_pages, v_pages, block_tables, positions,
                            groups, token_to_row, *, scale):
    """The replaced formulation: each chunk (one sequence's decode row, or 16 of
    its prompt tokens) gathers the sequence's blocks padded to the bucket."""
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    q_padded = jnp.concatenate([q, jnp.zeros((1, hq, d), q.dtype)])
    pos_padded = jnp.concatenate([positions, jnp.full((1,), -1, jnp.int32)])
    outs = []
    for chunk_seq, chunk_rows in groups:
        c, qw = chunk_rows.shape
        tables = block_tables[chunk_seq]
        k = k_pages[:, tables].reshape(hkv, c, -1, d)
        v = v_pages[:, tables].reshape(hkv, c, -1, d)
        qc = q_padded[chunk_rows].reshape(c, qw, hkv, hq // hkv, d)
        s = jnp.einsum("cqhgd,hckd->chgqk", qc, k) * scale
        mask = (jnp.arange(k.shape[2])[None, None, :]
                <= pos_padded[chunk_rows][:, :, None])[:, None, None]
        p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        outs.append(jnp.einsum("chgqk,hckd->cqhgd", p, v).reshape(c * qw, hq, d))
    return jnp.concatenate(outs)[token_to_row]


def old_layout(seqs, t_pad):
    """The replaced runner's chunk groups (power-of-two chunk counts)."""
    decode, prefill, first = [], [], 0
    for row, (n, _) in enumerate(seqs):
        if n == 1:
            decode.append((row, first, 1))
        else:
            prefill += [(row, first + c, min(16, n - c)) for c in range(0, n, 16)]
        first += n
    token_to_row = np.zeros(t_pad, np.int32)
    groups, offset = [], 0
    for chunks, width in ((decode, 1), (prefill, 16)):
        if not chunks:
            continue
        c_pad = bucket(len(chunks))
        chunk_seq = np.zeros(c_pad, np.int32)
        rows = np.full((c_pad, width), t_pad, np.int32)
        for i, (row, f, n) in enumerate(chunks):
            chunk_seq[i] = row
            rows[i, :n] = np.arange(f, f + n)
            token_to_row[f:f + n] = offset + i * width + np.arange(n)
        groups.append((chunk_seq, rows))
        offset += c_pad * width
    return tuple(groups), token_to_row


def work(seqs, t_pad, b_pad, groups, bs, hkv, group, d):
    """(K/V bytes, attention FLOPs) for attended / old / new, one layer, float32.

    Keys read per query row: attended = its causal context; old = every chunk
    reads b_pad blocks; new = its batch's trip count x pages x bs, with the
    batches of pallas_kernels.jnp rebuilt here on the host."""
    from pallas_kernels.jnp import attention as ref
    kv_bytes = lambda keys: keys * hkv * d * 2 * 4  # noqa: E731
    flops = lambda q_keys: q_keys * hkv * group * d * 4  # noqa: E731
    step = ref.PAGES_PER_STEP * bs
    keys = lambda n: -(-n // step) * step  # noqa: E731
    attended_keys = sum(ctx for _, ctx in seqs)  # each sequence's K/V read once
    attended_qk = sum(ctx - n + i + 1 for n, ctx in seqs for i in range(n))
    old_keys = sum(len(cs) * b_pad * bs for cs, _ in groups)
    old_qk = sum(rows.size * b_pad * bs for _, rows in groups)

    def batches(lens, num_max, rows):
        """(rows, keys) per executed batch of chunks sorted longest first."""
        lens = sorted(lens, reverse=True)
        if not lens:
            return []
        if num_max <= rows:  # the longest alone, then the rest in one batch
            return [(1, keys(lens[0]))] + ([(num_max - 1, keys(lens[1]))]
                                           if len(lens) > 1 else [])
        return [(rows, keys(lens[i])) for i in range(0, len(lens), rows)]

    s_pad = bucket(len(seqs), 8)
    dec = batches([ctx for n, ctx in seqs if n == 1], s_pad, s_pad)
    w = ref.PREFILL_CHUNK
    chunks = [ctx - n + c + min(w, n - c) for n, ctx in seqs if n > 1
              for c in range(0, n, w)]
    pre = batches(chunks, -(-t_pad // w) + min(s_pad, t_pad // 2),
                  ref.PREFILL_BATCH)
    new_keys = sum(r * k for r, k in dec + pre)
    new_qk = sum(r * k for r, k in dec) + sum(r * w * k for r, k in pre)
    return {name: (kv_bytes(k), flops(f)) for name, k, f in
            (("attended", attended_keys, attended_qk), ("old", old_keys, old_qk),
             ("new", new_keys, new_qk))}


def run_steps():
    hkv, group, d, bs = 2, 4, 64, 16
    scale = d ** -0.5
    rng = np.random.default_rng(_SEED.value)
    new_fn = jax.jit(functools.partial(pk.ragged_paged_attention_reference,
                                       scale=scale))
    old_fn = jax.jit(functools.partial(padded_gather_attention, scale=scale))
    cpp = cpu_kernels.available() and jax.default_backend() == "cpu"
    cpp_fn = jax.jit(functools.partial(cpu_kernels.paged_attention, scale=scale)) if cpp else None
    print(f"platform={jax.default_backend()} one layer: {hkv} kv heads x {group}, "
          f"head_dim {d}, block {bs}, float32; median of {_NUM_RUNS.value}; cpp_ms: the C++ kernel "
          f"(pallas_kernels/cpu/), every row")
    print(f"{'case':<38} {'old_ms':>8} {'new_ms':>8} {'speed-up':>8} {'cpp_ms':>8} "
          f"{'KV MB att/old/new':>20} {'MFLOP att/old/new':>20} {'max_diff':>9}")
    for name, seqs in STEP_CASES.items():
        t = sum(n for n, _ in seqs)
        t_pad, s_pad = bucket(t, 16), bucket(len(seqs), 8)
        blocks = [-(-ctx // bs) for _, ctx in seqs]
        b_pad = bucket(max(blocks), 4)
        num_blocks = sum(blocks) + 1
        perm = rng.permutation(num_blocks)
        tables = np.zeros((s_pad, b_pad), np.int32)
        nxt = 0
        for i, nb in enumerate(blocks):
            tables[i, :nb] = perm[nxt:nxt + nb]
            nxt += nb
        k = jnp.asarray(rng.standard_normal((hkv, num_blocks, bs, d), np.float32))
        v = jnp.asarray(rng.standard_normal((hkv, num_blocks, bs, d), np.float32))
        q = jnp.asarray(rng.standard_normal((t_pad, hkv * group, d), np.float32))
        qsl = np.full(s_pad + 1, t, np.int32)
        qsl[1:len(seqs) + 1] = np.cumsum([n for n, _ in seqs])
        qsl[0] = 0
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:len(seqs)] = [ctx for _, ctx in seqs]
        positions = np.zeros(t_pad, np.int32)
        positions[:t] = np.concatenate([np.arange(ctx - n, ctx) for n, ctx in seqs])
        groups, token_to_row = old_layout(seqs, t_pad)
        new_args = (q, k, v, tables, seq_lens, qsl, np.int32(len(seqs)))
        old_args = (q, k, v, tables, positions, groups, token_to_row)
        t_old, t_new = time_fn(old_fn, *old_args), time_fn(new_fn, *new_args)
        new_out = new_fn(*new_args)[:t]
        diff = float(jnp.max(jnp.abs(old_fn(*old_args)[:t] - new_out)))
        t_cpp = float("nan")
        if cpp:
            t_cpp = time_fn(cpp_fn, *new_args)
            diff = max(diff, float(jnp.max(jnp.abs(cpp_fn(*new_args)[:t] - new_out))))
        w = work(seqs, t_pad, b_pad, groups, bs, hkv, group, d)
        mb = "/".join(f"{w[x][0] / 1e6:.1f}" for x in ("attended", "old", "new"))
        mf = "/".join(f"{w[x][1] / 1e6:.0f}" for x in ("attended", "old", "new"))
        print(f"{name:<38} {t_old * 1e3:>8.2f} {t_new * 1e3:>8.2f} "
              f"{t_old / t_new:>7.2f}x {t_cpp * 1e3:>8.2f} {mb:>20} {mf:>20} {diff:>9.1e}", flush=True)


def model_config(path: str):
    """The `ModelConfig` of the Hugging Face directory at ``path``."""
    from jpaged.loading.hf_checkpoint import read_config
    from jpaged.models.model_config import ModelConfig

    return ModelConfig.from_hf(read_config(path))


def weight_groups(path: str) -> tuple[list[tuple[int, tuple]], tuple | None]:
    """(K, widths) of each call a decode step of the model at ``path`` makes: q/k/v, o, gate/up,
    down, and the output projection; and a tied embedding's table shape ``(vocab, K)`` (None where
    the output projection is its own weight): its logits are ``jpaged_matmul_t``'s, on the table as it lies."""
    c = model_config(path)
    h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    groups = [(h, (q, kv, kv)), (q, (h,)), (h, (inter, inter)), (inter, (h,))]
    if c.tie_word_embeddings:
        return groups, (c.vocab_size, h)
    return groups + [(h, (c.vocab_size,))], None


def _columns(labels, seconds, flops: float, gbytes: float, peak: float, scales=None) -> str:
    cols = []
    for label, t, scale in zip(labels, seconds, scales or [1] * len(labels)):
        cols.append(f"{label} {t * 1e3:7.3f} ms {gbytes * scale / t:5.1f} GB/s {flops / t / 1e9:6.1f} "
                    f"GFLOP/s {flops / t / 1e9 / peak:5.1%}")
    return " | ".join(cols)


def run_matmul(peak: float):
    print("cold weights (evicted before each call), the least of 3 runs; ms / weight GB/s / GFLOP/s / % of the "
          "GEMM peak; ratios: time / the C++ kernel's")
    for name in _MODEL.value:
        groups, table = weight_groups(model_dir(name, CACHE_DIR))
        for k, widths in groups:
            weights = [measure.filled((k, n)) for n in widths]
            transposed = [np.ascontiguousarray(w.T) for w in weights]
            half = [w.astype(jnp.bfloat16) for w in weights]
            size, width = len(widths), sum(widths)
            for rows in map(int, _ROWS.value):
                x = measure.filled((rows, k), 0.1)
                args = [*weights, *transposed, *half, x, x.astype(jnp.bfloat16)]
                ws = lambda a, i: a[i * size:(i + 1) * size]  # noqa: E731
                steps = [(lambda *a: cpu_kernels.matmuls(a[-2], ws(a, 0)), 3 * size),
                         (lambda *a: [a[-2] @ w for w in ws(a, 0)], 3 * size),
                         (lambda *a: [a[-2] @ w.T for w in ws(a, 1)], 3 * size),
                         (lambda *a: [jnp.dot(a[-1], w, preferred_element_type=jnp.float32) for w in ws(a, 2)],
                          3 * size + 1)]
                seconds = measure.time_steps(steps, args, evict=range(3 * size))
                flops, gbytes = 2 * rows * k * width, k * width * 4 / 1e9
                cols = _columns(("C++", "xla", "xla_wT", "xla_bf16"), seconds, flops, gbytes, peak, (1, 1, 1, 0.5))
                ratios = " ".join(f"{t / seconds[0]:.2f}" for t in seconds[1:])
                print(f"{name} [{rows:2d}, {k}] x [{k}, {'+'.join(map(str, widths))}]: {cols}"
                      f" | xla, xla_wT, xla_bf16 / C++: {ratios}", flush=True)
        if table is None:
            continue
        vocab, k = table
        weight = measure.filled(table)
        for rows in map(int, _ROWS.value):  # the tied logits: jpaged_matmul_t against XLA's x @ table.T
            steps = [(lambda w, x: cpu_kernels.matmul_t(x, w), 1), (lambda w, x: x @ w.T, 1)]
            seconds = measure.time_steps(steps, [weight, measure.filled((rows, k), 0.1)], evict=(0,))
            cols = _columns(("C++", "xla"), seconds, 2 * rows * k * vocab, k * vocab * 4 / 1e9, peak)
            print(f"{name} [{rows:2d}, {k}] x [{vocab}, {k}]^T (tied logits): {cols}"
                  f" | xla / C++: {seconds[1] / seconds[0]:.2f}", flush=True)


def run_layers():
    for name in _MODEL.value:
        path = model_dir(name, CACHE_DIR)
        groups = weight_groups(path)[0][:4]  # q/k/v, o, gate/up, down (not an untied output projection)
        num_layers = model_config(path).num_layers
        layers = [tuple(tuple(cpu_kernels.pack_weight(measure.filled((k, n), 0.02 + 0.001 * i)) for n in widths)
                        for k, widths in groups) for i in range(num_layers)]

        def step(x, layers):  # a Llama layer's projections, each call's outputs feeding the next
            for qkv, o, gate_up, down in layers:
                q = cpu_kernels.matmuls_packed(x, qkv)[0]
                x = x + cpu_kernels.matmuls_packed(q, o)[0]
                gate, up = cpu_kernels.matmuls_packed(x, gate_up)
                x = x + 0.1 * cpu_kernels.matmuls_packed(gate * up, down)[0]
            return x

        run = jax.jit(step)
        gbytes = sum(k * sum(widths) for k, widths in groups) * 4 / 1e9
        for rows in map(int, _ROWS.value):
            flops = 2 * rows * gbytes / 4 * 1e9
            x = measure.filled((rows, groups[0][0]), 0.1)
            for label, ws in (("own weights", layers), ("one layer's weights", [layers[0]] * num_layers)):
                seconds = [t / num_layers for t in run_times(run, x, ws, runs=15)]
                least, median = min(seconds), statistics.median(seconds)
                print(f"{name} {num_layers} layers, {rows:3d} rows, {label}: {least * 1e3:.3f} ms a layer "
                      f"({gbytes / least:.1f} GB/s, {flops / least / 1e9:.0f} GFLOP/s), median {median * 1e3:.3f}",
                      flush=True)


def main(argv):
    del argv
    peak = describe_machine()
    if _MODE.value == "matmul":
        return run_matmul(peak)
    if _MODE.value == "layers":
        return run_layers()
    if _MODE.value == "steps":
        return run_steps()
    dtype = jnp.dtype(_DTYPE.value)
    scale = 1.0 / _HEAD_DIM.value ** 0.5
    platform = jax.default_backend()
    if _BACKEND.value == "xla":
        paged_fn = functools.partial(pk.paged_attention_reference, scale=scale)
    else:
        paged_fn = functools.partial(
            pk.paged_attention, scale=scale,
            pages_per_compute_block=_PAGES_PER_COMPUTE_BLOCK.value,
            interpret=platform == "cpu")
    paged_fn = jax.jit(paged_fn)
    dense_fn = jax.jit(functools.partial(dense_attention, scale=scale))
    rng = np.random.default_rng(_SEED.value)
    print(f"platform={platform} backend={_BACKEND.value} dtype={_DTYPE.value} "
          f"kv_heads={_NUM_KV_HEADS.value} group={_GROUP.value} "
          f"head_dim={_HEAD_DIM.value} block_size={_BLOCK_SIZE.value}")
    print(f"{'batch':>6} {'context':>8} {'paged_ms':>10} {'dense_ms':>10} "
          f"{'paged/dense':>12} {'max_abs_diff':>13}")
    for batch in map(int, _BATCH.value):
        for context in map(int, _CONTEXT.value):
            paged_args, dense_args = make_inputs(rng, batch, context, dtype)
            t_paged = time_fn(paged_fn, *paged_args)
            t_dense = time_fn(dense_fn, *dense_args)
            diff = jnp.max(jnp.abs(paged_fn(*paged_args).astype(jnp.float32)
                                   - dense_fn(*dense_args).astype(jnp.float32)))
            print(f"{batch:>6} {context:>8} {t_paged * 1e3:>10.3f} "
                  f"{t_dense * 1e3:>10.3f} {t_paged / t_dense:>12.2f} "
                  f"{float(diff):>13.2e}", flush=True)


if __name__ == "__main__":
    app.run(main)
