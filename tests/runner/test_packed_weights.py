"""Packed copies of the projections for the C++ CPU matmul (`jpaged.runner.packed_weights`): made
at start, used by the decode steps, made again whenever the kernels change (update_weights,
sleep / wake_up), and never made for a model the caller owns (``LLM.from_model``).

The C++ kernels are forced on (``JPAGED_CPU_KERNELS=1``), so that the tiny test model's decode
steps run them whatever this machine would measure.
"""
import jax
import numpy as np
import pytest

from conftest import hf_greedy
from jpaged import LLM, SamplingParams
from jpaged.runner import packed_weights
from pallas_kernels import cpu
from pallas_kernels.cpu import library
from test_training import second_llama  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(library.compiler() is None, reason="no C++ compiler on this machine")

ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
PROMPT = list(range(5, 30))


@pytest.fixture
def forced_on(monkeypatch):
    monkeypatch.setenv("JPAGED_CPU_KERNELS", "1")


def packed_leaves(llm) -> dict:
    runner = llm.llm_engine.runner
    return {p: x for p, x in zip(runner.weight_targets.paths, jax.tree.leaves(runner.state))
            if packed_weights.is_packed(p)}


def assert_serves(llm, hf_model):
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 8)[0]
    return out


def assert_packed_from_kernels(llm):
    """Every packed copy equals its kernel packed now."""
    runner = llm.llm_engine.runner
    flat = dict(zip(runner.weight_targets.paths, jax.tree.leaves(runner.state)))
    packed = packed_leaves(llm)
    assert packed
    for path, x in packed.items():
        weight = packed_weights.source(path, flat)
        expected = flat[weight].T if weight[-1] == "embedding" else flat[weight]
        np.testing.assert_array_equal(np.asarray(x), np.asarray(cpu.pack_weight(expected)))


def test_decode_steps_read_the_packed_copies(forced_on, llama_dir, monkeypatch):
    """Every projection of the tiny Llama as wide as whole packed panels (q and o: 64, gate and up:
    128, down: 64, lm_head: 256) gets a packed copy, k and v (32) none; the decode steps call the
    packed matmul for gate and up together, for o, for down and for the logits (q, k and v: the
    plain matmul, since not all three have a copy), and the tokens are transformers' and those of an
    engine without copies."""
    traced, real = [], cpu.matmuls_packed
    monkeypatch.setattr(cpu, "matmuls_packed", lambda x, packed: traced.append(len(packed)) or real(x, packed))
    llm = LLM(llama_dir[0], **ENGINE)
    runner = llm.llm_engine.runner
    kernels = {p[:-1]: x for p, x in zip(runner.weight_targets.paths, jax.tree.leaves(runner.state))
               if p[-1] == "kernel" and p[-2] not in ("k_proj", "v_proj")}
    assert len(kernels) == 2 * 5 + 1 and {p[:-1] for p in packed_leaves(llm)} == set(kernels)
    assert runner.packed_bytes == sum(x.nbytes for x in kernels.values())
    assert_packed_from_kernels(llm)
    with_copies = assert_serves(llm, llama_dir[1])
    assert set(traced) == {1, 2}
    without = LLM(llama_dir[0], cpu_packed_weights=False, **ENGINE)
    assert without.llm_engine.runner.packed_bytes == 0 and not packed_leaves(without)
    plain = assert_serves(without, llama_dir[1])
    def logprobs(out):
        return [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    np.testing.assert_allclose(logprobs(with_copies), logprobs(plain), atol=1e-5)


def test_copies_follow_update_weights_and_sleep(forced_on, llama_dir, second_llama):
    """update_weights makes the copies again from the new kernels, sleep drops them and wake_up
    makes them again, whether sleep kept the weights (level 1) or update_weights brought them."""
    llm = LLM(llama_dir[0], **ENGINE)
    assert_serves(llm, llama_dir[1])
    llm.update_weights(second_llama[0])
    assert_packed_from_kernels(llm)
    assert_serves(llm, second_llama[1])
    llm.sleep(level=1)
    assert not any(packed_weights.is_packed(p) for p in llm.llm_engine.runner.sleeping_leaves)
    llm.wake_up()
    assert_packed_from_kernels(llm)
    assert_serves(llm, second_llama[1])
    llm.sleep(level=2)
    llm.update_weights(llama_dir[0])
    llm.wake_up()
    assert_packed_from_kernels(llm)
    assert_serves(llm, llama_dir[1])
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_a_tied_embedding_gets_its_transpose_packed(forced_on, tied_llama_dir, monkeypatch):
    """A model whose logits come from its embedding table (no lm_head) gets the table ``[vocab, H]``
    packed as the logits' weight ``[H, vocab]``: the decode steps' logits call the packed matmul on
    it, the tokens are transformers', and sleep / update_weights / wake_up make it again."""
    traced, real = [], cpu.matmuls_packed
    monkeypatch.setattr(cpu, "matmuls_packed", lambda x, packed: traced.append(packed[0].shape) or real(x, packed))
    llm = LLM(tied_llama_dir[0], **ENGINE)
    assert ("embed_tokens", packed_weights.PACKED) in packed_leaves(llm)
    assert_packed_from_kernels(llm)
    assert_serves(llm, tied_llama_dir[1])
    assert (256 // cpu.PACKED_PANEL, 64, cpu.PACKED_PANEL) in traced
    llm.sleep(level=2)
    llm.update_weights(tied_llama_dir[0])
    llm.wake_up()
    assert_packed_from_kernels(llm)
    assert_serves(llm, tied_llama_dir[1])


def test_no_copies_of_a_model_the_caller_owns(forced_on, llama_dir):
    """``LLM.from_model``: the caller's modules get no attribute; the unpacked matmul serves."""
    from flax import nnx

    first = LLM(llama_dir[0], cpu_packed_weights=False, **ENGINE)
    model = nnx.merge(first.llm_engine.runner.graphdef, first.llm_engine.runner.state)
    llm = LLM.from_model(model, **ENGINE)
    assert llm.llm_engine.runner.packed_bytes == 0
    assert not any(hasattr(node, packed_weights.PACKED) for _, node in nnx.iter_graph(model))
