"""The engine with attention_backend="pallas" (interpret mode on CPU) gives the xla backend's tokens;
per-backend attention metadata."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, SamplingParams
from jpaged.models.attention import BACKENDS, make_attention_metadata


@pytest.mark.slow
def test_pallas_backend_matches_xla(llama_dir):
    prompts = random_prompts(np.random.default_rng(0), [1, 20, 37, 5])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(llama_dir[0], attention_backend=backend, num_kv_blocks=24, max_model_len=128, block_size=8,
                  max_num_batched_tokens=32)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_metrics()["attention_backend"] == backend
    assert tokens["xla"] == tokens["pallas"]


def _step(q_lens, contexts, t_pad, s_pad, b_pad, block_size=8, seed=0):
    """Padded host arrays of one step (as the runner builds them) and random pools."""
    rng = np.random.default_rng(seed)
    s = len(q_lens)
    blocks = [-(-c // block_size) for c in contexts]
    tables = np.zeros((s_pad, b_pad), np.int32)
    perm = rng.permutation(sum(blocks) + 1)
    for i, n in enumerate(blocks):
        tables[i, :n], perm = perm[:n], perm[n:]
    qsl = np.full(s_pad + 1, sum(q_lens), np.int32)
    qsl[0], qsl[1:s + 1] = 0, np.cumsum(q_lens)
    positions = np.zeros(t_pad, np.int32)
    positions[:sum(q_lens)] = np.concatenate([np.arange(c - n, c) for n, c in zip(q_lens, contexts)])
    slots = np.full(t_pad, -1, np.int32)
    slots[:sum(q_lens)] = np.concatenate(
        [tables[i, p // block_size] * block_size + p % block_size
         for i, (n, c) in enumerate(zip(q_lens, contexts)) for p in [np.arange(c - n, c)]])
    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[:s] = contexts
    arrays = dict(positions=positions, slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                  block_tables=tables, num_seqs=s)
    pool = rng.standard_normal((2, sum(blocks) + 1, block_size, 16)).astype(np.float32)
    q = rng.standard_normal((t_pad, 4, 16)).astype(np.float32)
    return arrays, q, jnp.asarray(pool), jnp.asarray(pool[::-1])


def test_metadata_shapes_depend_only_on_buckets():
    """Different steps in one (T, S, B) bucket give the same shapes (xla: the same treedef too)."""
    steps = [([1, 1, 1], [9, 30, 2]), ([5, 1], [40, 6]), ([12], [12])]
    for backend in ("xla", "pallas"):
        mds = [make_attention_metadata(backend, **_step(q, c, 16, 4, 8)[0]) for q, c in steps]
        shapes = [[np.shape(x) for x in jax.tree.leaves(md)] for md in mds]
        assert all(s == shapes[0] for s in shapes)
        assert [md.decode_only for md in mds] == [backend == "pallas", False, False]
        if backend == "xla":
            assert len({jax.tree.structure(md) for md in mds}) == 1
    with pytest.raises(ValueError, match="attention backend"):
        make_attention_metadata("cuda", **_step([1], [3], 16, 4, 8)[0])


@pytest.mark.slow
def test_pallas_decode_only_step_matches_xla():
    """A decode-only step runs the decode kernel (interpret mode here) and gives the xla path's output."""
    arrays, q, k, v = _step([1, 1, 1], [9, 30, 2], 16, 4, 8)
    outs = {}
    for backend in ("xla", "pallas"):
        md = make_attention_metadata(backend, **arrays)
        outs[backend] = np.asarray(BACKENDS[backend][1](jnp.asarray(q), k, v, md, scale=0.25))
    assert md.decode_only
    np.testing.assert_allclose(outs["pallas"], outs["xla"], atol=2e-5, rtol=2e-5)
    assert not outs["pallas"][3:].any()  # padding tokens
