"""Llama 4 text beside the model-family harness (tests/models/test_model_families.py runs its greedy
parity with preemption, chunked prefill and prefix hits): chunked local attention in the jnp paged
attention against a numpy loop and in the Pallas kernels (interpret mode here) against the jnp one,
configs refused before any weight, the pallas backend equal to transformers; n > 1 and TP 2 (slow)."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_greedy, random_prompts
from jpaged import SamplingParams
from test_kernels import INTERPRET, KERNEL_BACKENDS, Case, as_np, check, decode_case, np_attention_row
from test_model_families import engine, family


def np_chunked(q, k_pages, v_pages, tables, seq_lens, qsl, num_seqs, scale, chunk):
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    group, bs = q.shape[1] // k_pages.shape[0], k_pages.shape[2]
    out = np.zeros_like(q)
    for s in range(num_seqs):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            pos = seq_lens[s] - q_len + i
            for h in range(q.shape[1]):
                slots = [(tables[s][j // bs], j % bs) for j in range(pos // chunk * chunk, pos + 1)]
                keys = [k_pages[h // group, b, o] for b, o in slots]
                values = [v_pages[h // group, b, o] for b, o in slots]
                out[qsl[s] + i, h] = np_attention_row(q[qsl[s] + i, h], keys, values, scale)
    return out


@pytest.mark.parametrize("chunk", [3, 8, 20])
def test_chunked_attention_reference_vs_numpy(chunk):
    """Chunks shorter than a block, of one block and across blocks; prefill chunks that start
    after cached tokens and decode rows."""
    import pallas_kernels as pk

    case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (30, 64)], block_size=8, max_seqs=8,
                extra_tokens=2)
    args, kw = case.build()
    out = pk.ragged_paged_attention_reference(*args, attention_chunk=chunk, num_queries_per_block=4,
                                              pages_per_compute_block=2, **kw)
    q, k, v, bt, sl, qsl, ns = args
    check(out, np_chunked(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl), np.asarray(qsl),
                          int(ns[0]), kw["scale"], chunk), jnp.float32)


BASE = dict(architectures=["Llama4ForCausalLM"], model_type="llama4_text", vocab_size=64, hidden_size=32,
            intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=8)


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(layer_types=["chunked_attention"] * 4, attention_chunk_size=None), "attention_chunk_size"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(architectures=["Llama4ForConditionalGeneration"]), "architectures"),
])
def test_configs_it_cannot_serve_are_refused_before_any_weight(tmp_path, change, field):
    from jpaged.loading import load_model

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, **change)))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="xla")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("chunk, window", [pytest.param(8, None, marks=pytest.mark.slow),
                                           pytest.param(20, None, marks=pytest.mark.slow), (20, 9)])
def test_kernels_with_chunks_match_the_reference(backend, chunk, window):
    """The Pallas decode and ragged kernels start each query at its chunk's first page and mask
    the keys before it: chunks of one block and across blocks, with a window inside a chunk too,
    prefill chunks after cached tokens, decode rows, padding (8-token blocks, 2 per step; interpret
    mode takes ~40 s a case here, so the default run has one chunk size)."""
    import pallas_kernels as pk

    knobs = dict(attention_chunk=chunk, sliding_window=window)
    kw = dict(knobs, backend=backend, interpret=INTERPRET, pages_per_compute_block=2)
    (q, k, v, bt, sl, _, _), skw = decode_case([0, 1, 8, 9, 20, 21, 47], block_size=8).build()
    out = pk.paged_attention(q, k, v, bt, sl, **kw, **skw)
    check(out, pk.paged_attention_reference(q, k, v, bt, sl, **knobs, **skw), jnp.float32)
    case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (30, 64)], block_size=8, max_seqs=8,
                extra_tokens=2)
    args, skw = case.build()
    out = pk.ragged_paged_attention(*args, num_queries_per_block=16, **kw, **skw)
    check(out, pk.ragged_paged_attention_reference(*args, **knobs, **skw), jnp.float32)
    num_real = int(args[5][int(args[6][0])])
    assert not np.any(as_np(out)[num_real:])  # padding rows are zeros


@pytest.mark.slow  # Pallas interpret mode
def test_pallas_backend_equals_transformers(tmp_path_factory):
    """Chunked layers on the Pallas kernels (interpret mode here): the ragged kernel for prompts
    longer than a chunk, the decode kernel after."""
    hf_model = family(tmp_path_factory, "llama4")[1]
    prompts = random_prompts(np.random.default_rng(4), [20, 3])
    llm = engine(tmp_path_factory, "llama4", attention_backend="pallas")
    assert llm.get_metrics()["attention_backend"] == "pallas"
    assert _tokens(llm, prompts, 6) == [[hf_greedy(hf_model, p, 6)[0]] for p in prompts]


def test_scout_deployment_config_as_transformers_reads_it():
    """configs/models/llama-4-scout.json (transcribed from the published config): the engine's
    model facts equal transformers' Llama4TextConfig's, and its llama3 rope (low and high band
    factors both 1: no medium band) gives transformers' frequencies without a numpy warning."""
    import warnings

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jpaged.loading import hf_checkpoint
    from jpaged.models.layers import rope_inv_freq
    from jpaged.models.llama4 import layer_chunk, moe_layers, uses_rope
    from run_script import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "configs", "models", "llama-4-scout.json")) as f:
        fields = json.load(f)
    mc = hf_checkpoint.model_config(fields, "llama-4-scout.json")
    # the published file's attn_temperature_tuning is 4 (an int; transformers 5 types it bool)
    theirs = transformers.Llama4TextConfig(**{k: bool(v) if k == "attn_temperature_tuning" else v
                                              for k, v in fields.items() if k != "architectures"})
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.head_dim, theirs.vocab_size) == (48, 5120, 40, 8, 128, 202048)
    assert moe_layers(mc) == theirs.moe_layers == list(range(48))
    assert [layer_chunk(mc, i) for i in range(48)] == [
        8192 if t == "chunked_attention" else None for t in theirs.layer_types]
    assert [uses_rope(mc, i) for i in range(4)] == [True, True, True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ours = rope_inv_freq(mc)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
    np.testing.assert_allclose(ours, want.numpy(), rtol=1e-6)


def _tokens(llm, prompts, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_parallel_samples_equal_transformers_greedy(tmp_path_factory):
    hf_model = family(tmp_path_factory, "llama4")[1]
    prompts = random_prompts(np.random.default_rng(3), [14, 9])
    outs = _tokens(engine(tmp_path_factory, "llama4", num_kv_blocks=24), prompts, 8, n=2)
    assert outs == [[hf_greedy(hf_model, p, 8)[0]] * 2 for p in prompts]


@pytest.mark.slow
def test_tensor_parallel_2_equals_transformers(tmp_path_factory):
    """Heads split over 2 devices; the routed and the shared experts split like MLPs."""
    hf_model = family(tmp_path_factory, "llama4")[1]
    prompts = random_prompts(np.random.default_rng(5), [30, 9])
    llm = engine(tmp_path_factory, "llama4", tensor_parallel_size=2)
    assert _tokens(llm, prompts, 8) == [[hf_greedy(hf_model, p, 8)[0]] for p in prompts]


def test_dense_forward_equals_transformers_logits(tmp_path_factory):
    """The no-cache dense view (training, the oracle) honours this family's attention too."""
    import torch

    from jpaged.loading import load_model
    from jpaged.models.training import dense_logits

    path, hf_model = family(tmp_path_factory, "llama4")
    model, _, _ = load_model(path, dtype=np.float32, attention_backend="xla")
    tokens = np.asarray(random_prompts(np.random.default_rng(9), [30, 30]))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(dense_logits(model, tokens)), want, atol=1e-4, rtol=1e-4)
