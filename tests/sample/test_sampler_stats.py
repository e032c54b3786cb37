"""Statistical tests of sampling through the public API: sampled tokens against the distribution a
setting defines.

The model is a tiny Llama whose layers are all zero, every embedding row is ones and each lm_head
row is constant, so at every position the next-token logits are the fixed vector ``LOGITS`` (up to
the RMSNorm factor ``1/sqrt(1 + eps)``), whatever the context. The expected distribution of each
setting is computed here in float64 (a reference written independently of `jpaged.sample.sampler`), and
``N`` seeded samples (one request with ``n=N``) are compared with it by Pearson's chi-square test;
a p-value below ``ALPHA`` fails. The seeds are fixed, so each test is deterministic; with a correct
sampler the chance that any one of them fails for a new seed is ``ALPHA``.
"""
import numpy as np
import pytest
from scipy import stats

from jpaged import LLM, SamplingParams

V = 24
EPS = 1e-6
LOGITS = np.array([2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.3, 0.1, -0.2, -0.5, -0.8, -1.1, -1.5, -2.0, -2.6, -3.3,
                   0.9, -0.4, 1.45, -1.3, 0.2, -2.3, -0.65, -4.0])
N = 4000
ALPHA = 1e-4
PROMPT = [3, 0, 9, 3]


@pytest.fixture(scope="module")
def fixed_logits_dir(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      rms_norm_eps=EPS, tie_word_embeddings=False, bos_token_id=22, eos_token_id=23,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(torch.tensor(LOGITS, dtype=torch.float32)[:, None].expand(V, 16) / 16)
    path = str(tmp_path_factory.mktemp("fixed_logits"))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(fixed_logits_dir):
    return LLM(fixed_logits_dir, num_kv_blocks=3 * N, block_size=16, max_model_len=64, max_num_seqs=N,
               max_num_batched_tokens=2 * N, dtype="float32")


def model_logits():
    return LOGITS / np.sqrt(1.0 + EPS)


def reference_probs(history=(), prompt=PROMPT, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                    logit_bias=None, allowed_token_ids=None, banned=()):
    """The next-token distribution a setting defines (float64), given the tokens generated so far."""
    x = model_logits().copy()
    for t, b in (logit_bias or {}).items():
        x[t] += b
    if allowed_token_ids is not None:
        x[[t for t in range(V) if t not in allowed_token_ids]] = -np.inf
    x[list(banned)] = -np.inf
    counts = np.bincount(np.asarray(history, int), minlength=V)
    seen = (counts + np.bincount(np.asarray(prompt, int), minlength=V)) > 0
    x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    x = x - frequency_penalty * counts - presence_penalty * (counts > 0)
    x = x / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.isfinite(x)
    if top_k:
        keep &= x >= x[order[top_k - 1]]
    p = np.exp(x - x[keep].max()) * keep
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    assert top_p == 1.0 or np.all(np.abs(mass_before - top_p) > 1e-4), "a top-p boundary too close to call"
    keep[order[mass_before >= top_p]] = False
    if min_p:
        ratio = np.exp(x - x.max())
        assert np.all(np.abs(ratio - min_p) > 1e-4), "a min-p boundary too close to call"
        keep &= ratio >= min_p
    p = np.exp(x - x[keep].max()) * keep
    return p / p.sum()


def assert_fits(tokens, expected_counts, what):
    """Pearson's chi-square on the tokens' counts (cells expecting < 5 pooled); excluded tokens never drawn."""
    counts = np.bincount(np.asarray(tokens), minlength=V).astype(float)
    expected = np.asarray(expected_counts, float)
    never = expected == 0
    assert counts[never].sum() == 0, f"{what}: drew excluded tokens {np.nonzero(counts * never)[0].tolist()}"
    small = ~never & (expected < 5)
    obs = np.append(counts[~never & ~small], counts[small].sum())
    exp = np.append(expected[~never & ~small], expected[small].sum())
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        assert obs[0] == len(tokens), what
        return
    p_value = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value >= ALPHA, \
        f"{what}: chi-square p={p_value:.2e}, counts {counts.tolist()} vs {expected.round(1).tolist()}"


def sample_tokens(llm, max_tokens=1, **kw):
    params = SamplingParams(n=N, max_tokens=max_tokens, ignore_eos=True, **kw)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    tokens = np.array([c.token_ids for c in out.outputs])
    assert tokens.shape == (N, max_tokens)
    return tokens


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.45),
    dict(temperature=2.2),
    dict(top_k=5),
    dict(top_k=1, temperature=3.0),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=1.7),
    dict(min_p=0.2),
    dict(min_p=0.02, temperature=0.7),
    dict(top_k=9, top_p=0.85, temperature=1.3),
    dict(top_k=10, top_p=0.95, min_p=0.1, temperature=1.5),
    dict(top_p=0.8, min_p=0.25, temperature=0.9),
    dict(repetition_penalty=1.9),        # prompt tokens 3 (positive logit), 0, 9 (negative logit)
    dict(repetition_penalty=0.6, temperature=1.2, top_k=12),
    dict(logit_bias={0: -1.5, 7: 2.0, 13: 3.0, 2: -100}),
    dict(logit_bias={15: 4.0, 1: -0.5}, top_p=0.75, temperature=0.8, repetition_penalty=1.3),
    dict(allowed_token_ids=[1, 4, 6, 13], temperature=1.3),
    dict(allowed_token_ids=[0, 2, 3, 5, 8, 11], logit_bias={11: 2.5}, top_k=3),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_first_token_distribution(llm, setting):
    seed = 1000 + SETTINGS.index(setting)
    tokens = sample_tokens(llm, seed=seed, **setting)[:, 0]
    assert_fits(tokens, N * reference_probs(**setting), str(setting))


@pytest.mark.parametrize("setting", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.9, temperature=0.8),
    dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=1.4, top_k=10),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_penalties_on_later_steps(llm, setting):
    """Output-count penalties change each step's distribution; the expected counts of step k are the
    sum over samples of the distribution given that sample's earlier tokens."""
    tokens = sample_tokens(llm, max_tokens=3, seed=77, **setting)
    for step in range(3):
        expected = sum(reference_probs(history=row[:step], **setting) for row in tokens)
        assert_fits(tokens[:, step], expected, f"{setting} step {step}")


def test_later_steps_draw_fresh_randomness(llm):
    """Each step of a request draws new noise: consecutive tokens of one sample agree only as often as
    two independent draws would (the logits are the same at every step)."""
    tokens = sample_tokens(llm, max_tokens=4, seed=5)
    p = reference_probs()
    for step in range(4):
        assert_fits(tokens[:, step], N * p, f"step {step}")
    for a, b in ((0, 1), (1, 2), (0, 3)):
        same = int((tokens[:, a] == tokens[:, b]).sum())
        test = stats.binomtest(same, N, float((p ** 2).sum()))
        assert test.pvalue >= ALPHA, f"steps {a} and {b} agree in {same}/{N} samples"


def test_samples_of_one_request_are_independent(llm):
    """The n samples of a request draw different noise (sample i vs sample i+1 at the first step)."""
    tokens = sample_tokens(llm, seed=6)[:, 0]
    same = int((tokens[:-1] == tokens[1:]).sum())
    p = reference_probs()
    assert stats.binomtest(same, N - 1, float((p ** 2).sum())).pvalue >= ALPHA


def test_logprobs_on_a_24_token_vocabulary(llm):
    """logprobs=20 on a 24-token vocabulary (its bucket, 32, is wider than the vocabulary) returns
    the exact top 20; a beam width whose 2 * width exceeds the vocabulary is refused before any
    device work, and the engine goes on serving."""
    from jpaged import BeamSearchParams

    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=20, seed=0), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs[0]
    x = model_logits()
    exact = x - np.log(np.exp(x).sum())
    top = np.argsort(-exact)[:20]
    assert set(top) <= set(lps)
    np.testing.assert_allclose([lps[t] for t in top], exact[top], atol=1e-5)
    with pytest.raises(ValueError, match="beam_width=13"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=13, max_tokens=2))
    assert len(llm.beam_search([PROMPT], BeamSearchParams(beam_width=12, max_tokens=2))[0].sequences) == 12
