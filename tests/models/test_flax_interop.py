"""Flax research interop: in-memory models, orbax checkpoints, custom models, the training recipe.

- An HF directory, the same weights as an in-memory NNX model (`LLM.from_model`) and as an orbax
  checkpoint (`LLM(model=dir)`) give identical greedy tokens (and match transformers).
- The custom model of `examples/custom_model.py` generates through the paged cache exactly as a
  plain full-sequence forward does (argmax each step), also after an orbax round trip.
- `scripts/train_tiny.py` with a tiny step count trains (loss drops) and serves its checkpoint.
"""
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import hf_greedy, random_prompts
from jpaged import LLM, SamplingParams
from jpaged.loading import load_model, read_checkpoint
from jpaged.loading import orbax_checkpoint
from jpaged.loading.hf_checkpoint import iter_safetensors
from jpaged.models.training import dense_view, greedy_generate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(num_kv_blocks=64, max_model_len=256, block_size=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def load_file_module(name: str, relpath: str):
    """Imports a file of examples/ or scripts/ under ``name`` (kept in sys.modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def greedy(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)]
                                                    for o in outs]


@pytest.fixture(scope="module")
def llama_orbax(llama_dir, tmp_path_factory):
    """(hf dir, hf model, in-memory jpaged model, tokenizer, orbax checkpoint dir) of one set of weights."""
    path, hf_model = llama_dir
    model, _, tokenizer = load_model(path, dtype=jnp.float32, attention_backend="xla")
    ckpt = orbax_checkpoint.save_checkpoint(model, str(tmp_path_factory.mktemp("orbax") / "ckpt"), tokenizer)
    return path, hf_model, model, tokenizer, ckpt


@pytest.mark.slow
def test_in_memory_orbax_and_hf_give_identical_greedy_tokens(llama_orbax):
    path, hf_model, model, tokenizer, ckpt = llama_orbax
    prompts = random_prompts(np.random.default_rng(0), [3, 17, 40])
    from_hf = LLM(path, **ENGINE)
    from_memory = LLM.from_model(model, tokenizer, **ENGINE)
    from_orbax = LLM(ckpt, **ENGINE)
    tokens_hf, lps_hf = greedy(from_hf, prompts)
    for llm in (from_memory, from_orbax):
        tokens, lps = greedy(llm, prompts)
        assert tokens == tokens_hf
        np.testing.assert_allclose(lps, lps_hf, atol=1e-5)
    for prompt, tokens in zip(prompts, tokens_hf):  # and all three are transformers' greedy tokens
        assert tokens == hf_greedy(hf_model, prompt, GREEDY.max_tokens)[0]
    # the tokenizer travelled with the checkpoint: text prompts work and decode the same
    text = [o.outputs[0].text for o in from_orbax.generate(["hello paged world"], GREEDY, use_tqdm=False)]
    assert text == [o.outputs[0].text for o in from_hf.generate(["hello paged world"], GREEDY, use_tqdm=False)]
    assert from_orbax.get_tokenizer() is not None


def test_from_model_serves_the_arrays_in_place(llama_orbax):
    _, _, model, _, _ = llama_orbax
    llm = LLM.from_model(model, **ENGINE)
    assert llm.get_tokenizer() is None and llm.llm_engine.dtype == jnp.float32
    runner_state = getattr(llm.llm_engine.runner, "state", None)
    if runner_state is not None:  # the engine holds the model's own device buffers, not copies
        ours = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
        theirs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(runner_state)}
        assert ours <= theirs
    tokens, _ = greedy(llm, [[5, 6, 7]])
    assert len(tokens[0]) == GREEDY.max_tokens


def test_from_model_rejects_bad_input(llama_orbax):
    with pytest.raises(ValueError, match="model"):
        LLM.from_model(object())
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM.from_model(llama_orbax[2], no_such_setting=1)


def test_orbax_layout_and_hf_view(llama_orbax):
    path, _, model, _, ckpt = llama_orbax
    marker = json.load(open(os.path.join(ckpt, orbax_checkpoint.MARKER)))
    assert marker["format"] == "jpaged-orbax" and marker["model_class"].endswith(":LlamaForCausalLM")
    assert os.path.isdir(os.path.join(ckpt, "state")) and os.path.isfile(os.path.join(ckpt, "tokenizer.json"))
    _, config = orbax_checkpoint.read_manifest(ckpt)
    assert {k: v for k, v in vars(config).items() if k != "hf"} == \
        {k: v for k, v in vars(model.config).items() if k != "hf"}
    # read_checkpoint (the path sharded loaders take) yields the HF tensors back, unchanged
    hf_config, weights, _ = read_checkpoint(ckpt)
    original = dict(iter_safetensors(path))
    restored = dict(weights)
    assert set(restored) == set(original) - {k for k in original if "rotary" in k}
    for name, array in restored.items():
        np.testing.assert_array_equal(array, original[name], err_msg=name)
    # restoring into another dtype casts on load
    bf16, _, _ = orbax_checkpoint.load_checkpoint(ckpt, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(bf16, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        orbax_checkpoint.save_checkpoint(model, ckpt)


@pytest.mark.slow
def test_custom_model_paged_matches_dense_and_survives_orbax(tmp_path):
    example = load_file_module("custom_model", "examples/custom_model.py")
    results = example.main(num_prompts=3, max_tokens=12)  # asserts paged == dense for each prompt
    assert len(results) == 3 and all(len(paged) == 12 for paged, _ in results)
    # the same custom class saved with orbax and served by path (its class recorded by module path)
    model = example.build_model(seed=1)
    ckpt = orbax_checkpoint.save_checkpoint(model, str(tmp_path / "custom"))
    prompt = [9, 8, 7, 6, 5, 4, 3]
    llm = LLM(ckpt, **ENGINE)
    served = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert served == greedy_generate(model, prompt, GREEDY.max_tokens)
    # a model without Hugging Face names takes new weights as its state, not as a name dict
    with pytest.raises(ValueError, match="hf_weight_map"):
        llm.update_weights({"model.embed_tokens.weight": np.zeros(3)})
    other = example.build_model(seed=2)
    llm.update_weights(nnx.state(other))
    served = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert served == greedy_generate(other, prompt, GREEDY.max_tokens)


def test_dense_view_needs_paged_attention():
    class NoAttention(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

    with pytest.raises(ValueError, match="PagedAttention"):
        dense_view(NoAttention())


@pytest.mark.slow
def test_train_tiny_loss_drops_and_checkpoint_serves(tmp_path):
    train_tiny = load_file_module("train_tiny", "scripts/train_tiny.py")
    lines = []
    result = train_tiny.train(steps=40, batch_size=8, seq_len=64, hidden_size=64, vocab_size=384,
                              modules=["textwrap"], max_tokens=8, log_every=10, out_dir=str(tmp_path / "tiny"),
                              log=lines.append)
    print("\n".join(lines))
    assert len(result["losses"]) == 40
    assert result["last_loss"] < result["first_loss"] - 1.0, (result["first_loss"], result["last_loss"])
    assert orbax_checkpoint.is_orbax_checkpoint(result["checkpoint"])
    assert 1 <= len(result["sample_token_ids"]) <= 8 and isinstance(result["sample"], str)
