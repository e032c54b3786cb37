"""Shared fixtures: small random Hugging Face checkpoints and the transformers greedy oracle.

The tests are laid out like the package (``tests/core/`` for ``jpaged/core/``, ``tests/runner/``,
``tests/kernels/`` for ``pallas_kernels/``, ...). Test hooks: a running engine's internals are
reached through `jpaged.testing` (``model_state``, ``device_kv``, ``block_pool``, ``swap_space``);
shared helpers through this file's fixtures and functions (``from conftest import byte_tokenizer``), ``run_script``
(the scripts as a user runs them), ``agents_helpers`` (chat conversations and tools), and the
helpers a test module defines for its neighbours (``from test_server import start_server``): every
test folder is on ``sys.path`` (below), so such a module is imported by its name from any folder.
"""
import os
import sys

import numpy as np
import logging

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(TESTS_DIR)):
    if not _folder.startswith((".", "_")) and os.path.isdir(os.path.join(TESTS_DIR, _folder)):
        if os.path.join(TESTS_DIR, _folder) not in sys.path:
            sys.path.append(os.path.join(TESTS_DIR, _folder))


def byte_tokenizer():
    """A 256-token byte-level tokenizer (token i is byte i), so random models can have text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def bytes_to_unicode():  # GPT-2's printable stand-ins for the 256 bytes
        printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
        others = [b for b in range(256) if b not in printable]
        mapping = {b: chr(b) for b in printable}
        mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
        return mapping

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=bytes_to_unicode()[2],
                                   bos_token=bytes_to_unicode()[1])


def _save(tmp_path_factory, name, config, with_tokenizer=False):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path)
    if with_tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path, model


COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=256, max_position_embeddings=2048, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    return _save(tmp_path_factory, "llama", LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **COMMON),
                 with_tokenizer=True)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from transformers import Qwen2Config

    return _save(tmp_path_factory, "qwen2", Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False,
                                                         **COMMON))


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      **COMMON)
    return _save(tmp_path_factory, "tied", cfg)


def hf_greedy(model, prompt: list[int], max_new_tokens: int):
    """transformers' greedy tokens and their log-probabilities (float32).

    ``min_new_tokens`` makes transformers ban EOS; compare with ``SamplingParams(min_tokens=...)``.
    """
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


def random_prompts(rng: np.random.Generator, lengths, vocab=256):
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


_oracle_cache = {}


def assert_greedy_parity(name, hf_model, llm, prompts, max_tokens: int = 24):
    """Every greedy token equals transformers', logprobs within 1e-4, and no block leaks.

    ``min_tokens`` bans EOS as transformers' ``min_new_tokens`` does, so both pick from the same logits.
    """
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        key = (name, tuple(prompt), max_tokens)
        if key not in _oracle_cache:
            _oracle_cache[key] = hf_greedy(hf_model, prompt, max_tokens)
        ref_tokens, ref_logprobs = _oracle_cache[key]
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{name}: prompt of {len(prompt)} tokens"
        got_lps = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(got_lps, ref_logprobs, atol=1e-4)
        assert got.finish_reason == "length"
    metrics = llm.get_metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"], "blocks leaked"
    return metrics


@pytest.fixture
def jpaged_caplog(caplog):
    """``caplog`` that also sees the "jpaged" logger, which stops propagating once an engine has
    configured it (``jpaged/logger.py``)."""
    import logging
    logger = logging.getLogger("jpaged")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="jpaged")
    yield caplog
    logger.removeHandler(caplog.handler)


class JpagedLog(logging.Handler):
    """The "jpaged" logger's messages while it is attached, at INFO and up (the logger does not
    propagate once an engine has configured it)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("jpaged")
        self.level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("jpaged")
        logger.removeHandler(self)
        logger.setLevel(self.level)
