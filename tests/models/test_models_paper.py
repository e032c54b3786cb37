"""The paper's models, OPT and GPT-2: greedy tokens equal transformers' exactly (float32) through
preemption, with logprobs within 1e-4 and every block back in the pool at the end."""
import os

import numpy as np
import pytest

from conftest import _save, assert_greedy_parity, random_prompts
from jpaged import LLM

PROMPT_LENS = [1, 7, 16, 33, 100, 64, 90, 5]
SMALL = dict(vocab_size=256, bos_token_id=1, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="session")
def opt_dir(tmp_path_factory):
    from transformers import OPTConfig

    cfg = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256, init_std=0.1, **SMALL)
    return _save(tmp_path_factory, "opt", cfg)


@pytest.fixture(scope="session")
def opt350m_style_dir(tmp_path_factory):
    """LayerNorm after each sub-block, no final LayerNorm, project_in/out (word_embed_proj_dim)."""
    from transformers import OPTConfig

    cfg = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256, init_std=0.1, do_layer_norm_before=False,
                    word_embed_proj_dim=32, **SMALL)
    return _save(tmp_path_factory, "opt350m", cfg)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    from transformers import GPT2Config

    cfg = GPT2Config(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256,
                     initializer_range=0.1, **SMALL)
    return _save(tmp_path_factory, "gpt2", cfg)


@pytest.mark.parametrize("model_fixture,block_size,num_blocks", [
    ("opt_dir", 16, 16),
    ("opt350m_style_dir", 8, 32),
    ("gpt2_dir", 16, 16),
    ("gpt2_dir", 8, 32),
])
def test_greedy_parity_with_preemption(request, model_fixture, block_size, num_blocks):
    path, hf_model = request.getfixturevalue(model_fixture)
    llm = LLM(path, block_size=block_size, num_kv_blocks=num_blocks, max_model_len=256,
              max_num_batched_tokens=128)
    prompts = random_prompts(np.random.default_rng(0), PROMPT_LENS)
    metrics = assert_greedy_parity(model_fixture, hf_model, llm, prompts)
    assert metrics["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert metrics["peak_kv_cache_usage"] > 0.8


def test_model_config_from_hf(opt_dir, gpt2_dir, opt350m_style_dir):
    """The KV pool's shape comes from these: heads, kv heads, head_dim, layers, positions."""
    from jpaged.loading import hf_checkpoint
    from jpaged.models import ModelConfig, model_class
    from jpaged.models.gpt2 import GPT2LMHeadModel
    from jpaged.models.opt import OPTForCausalLM

    for (path, _), cls, act, ffn in [(opt_dir, OPTForCausalLM, "relu", 128),
                                     (opt350m_style_dir, OPTForCausalLM, "relu", 128),
                                     (gpt2_dir, GPT2LMHeadModel, "gelu_new", 128)]:
        c = ModelConfig.from_hf(hf_checkpoint.read_config(path))
        assert model_class(c) is cls
        assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 4, 16)
        assert (c.max_position_embeddings, c.intermediate_size, c.hidden_act) == (256, ffn, act)
        assert c.norm_eps == 1e-5 and c.tie_word_embeddings and c.eos_token_ids == ()


def _hub_style_names(path, strip: str):
    """Tensor names as the original Hub files spell them (GPT2Model / OPTModel dumps)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return {n[len(strip):] if n.startswith(strip) else n: f.get_tensor(n) for n in f.keys()}


@pytest.mark.parametrize("model_fixture,strip", [("gpt2_dir", "transformer."), ("opt_dir", "model.")])
def test_hub_tensor_names_map_to_the_same_weights(request, model_fixture, strip, tmp_path):
    """A directory whose safetensors use the original Hub names (``h.0.attn.c_attn.weight``,
    OPT's ``decoder.*``) loads, through the loader, into the same parameters as save_pretrained's
    names (``transformer.h.0...``, ``model.decoder.*``)."""
    import shutil

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from jpaged.loading import load_model

    path, _ = request.getfixturevalue(model_fixture)
    hub = _hub_style_names(path, strip)
    assert sum(not n.startswith(strip) for n in hub) > 5  # names the loader must map, not pass through
    if model_fixture == "gpt2_dir":
        hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, 256, 256), bool))  # a buffer the Hub file has
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    shutil.copy(os.path.join(path, "config.json"), hub_dir / "config.json")
    save_file(hub, str(hub_dir / "model.safetensors"))
    ref, _, _ = load_model(path, dtype=jnp.float32, attention_backend="xla")
    model, _, _ = load_model(str(hub_dir), dtype=jnp.float32, attention_backend="xla")
    ref_params = jax.tree_util.tree_leaves_with_path(nnx.state(ref, nnx.Param))
    got_params = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    assert [p for p, _ in ref_params] == [p for p, _ in got_params] and len(ref_params) > 10
    for (name, a), (_, b) in zip(ref_params, got_params):
        assert np.ndim(a) < 2 or np.abs(np.asarray(a)).sum() > 0, name  # matrices were filled (biases start at 0)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(name))
