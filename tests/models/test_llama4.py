"""Llama 4 text beside the model-family harness (tests/models/test_model_families.py runs its greedy
parity with preemption, chunked prefill and prefix hits): chunked local attention in the jnp paged
attention against a numpy loop, configs refused before any weight, the pallas backend refused by
name; n > 1 and TP 2 (slow)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_greedy, random_prompts
from jpaged import SamplingParams
from test_kernels import Case, as_np, check, np_attention_row
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


def test_chunked_layers_on_the_pallas_backend_are_refused_by_name(tmp_path):
    from jpaged.loading import load_model

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(ValueError, match="attention_chunk_size=8"):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="pallas")


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
