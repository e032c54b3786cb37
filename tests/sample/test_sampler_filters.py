"""Exact-boundary unit tests of each stage of `jpaged.sample.sampler`, and of the host-side batch builder."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.sample import sampler
from jpaged.sample.sampler import SamplingTensors
from jpaged.sample.sampling_batch import banned_tokens, build_sampling_batch


def build_sampling_tensors(rows, s_pad, seed):
    return sampler.sampling_tensors(build_sampling_batch([(r.request, r.seq, r.sample_index) for r in rows], seed), s_pad)


def tensors(num_rows, **kw):
    """SamplingTensors for ``num_rows`` rows: defaults mean "no option", overridden by ``kw``."""
    f = lambda v: np.full(num_rows, v, np.float32)  # noqa: E731
    empty = np.zeros((num_rows, 0), np.int32)
    args = dict(temperature=f(1.0), top_k=np.zeros(num_rows, np.int32), top_p=f(1.0), min_p=f(0.0),
                min_tokens=np.zeros(num_rows, np.int32), seeds=np.zeros(num_rows, np.uint32),
                steps=np.zeros(num_rows, np.int32),
                presence_penalty=f(0.0), frequency_penalty=f(0.0), repetition_penalty=f(1.0),
                output_token_ids=empty, prompt_token_ids=empty, banned_token_ids=empty,
                bias_token_ids=empty, bias_values=np.zeros((num_rows, 0), np.float32),
                allowed_token_ids=empty, has_allowed=np.zeros(num_rows, bool), token_bitmask=empty,
                all_greedy=False, use_filters=True)
    args.update(kw)
    return SamplingTensors(**args)


def kept(logits):
    return [np.flatnonzero(np.isfinite(row)).tolist() for row in np.asarray(logits)]


LOGITS = np.array([[0.3, 2.0, -1.0, 1.0, 0.5, -0.2]], np.float32)  # ranks: 1, 3, 4, 0, 5, 2


def mass_before_ranks(logits):
    """The probability mass before each rank, as the sampler computes it (descending order)."""
    s = jnp.sort(jnp.asarray(logits), axis=-1)[:, ::-1]
    p = jax.nn.softmax(s, axis=-1)
    return np.asarray(jnp.cumsum(p, axis=-1) - p)[0]


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
def test_top_p_boundary_is_exclusive(rank):
    """A token whose preceding mass equals top_p is dropped (the prefix before it already reaches
    top_p); a hair above top_p keeps it."""
    order = [1, 3, 4, 0, 5, 2]
    at = np.float32(mass_before_ranks(LOGITS)[rank])
    got = kept(sampler.apply_filters(LOGITS, tensors(1, top_p=np.array([at], np.float32))))
    assert got == [sorted(order[:rank])]
    above = np.nextafter(at, np.float32(2))
    got = kept(sampler.apply_filters(LOGITS, tensors(1, top_p=np.array([above], np.float32))))
    assert got == [sorted(order[:rank + 1])]


def test_top_p_one_keeps_everything():
    assert kept(sampler.apply_filters(LOGITS, tensors(1))) == [list(range(6))]


@pytest.mark.parametrize("k,expect", [(1, [1]), (2, [1, 3]), (5, [0, 1, 3, 4, 5]), (6, list(range(6))),
                                      (7, list(range(6))), (0, list(range(6)))])
def test_top_k_keeps_exactly_k(k, expect):
    assert kept(sampler.apply_filters(LOGITS, tensors(1, top_k=np.array([k], np.int32)))) == [expect]


def test_top_k_keeps_ties_with_the_kth():
    logits = np.array([[1.0, 3.0, 1.0, 0.0]], np.float32)
    assert kept(sampler.apply_filters(logits, tensors(1, top_k=np.array([2], np.int32)))) == [[0, 1, 2]]


def test_min_p_boundary_is_inclusive():
    """A token with probability exactly min_p times the largest is kept; just above drops it."""
    half = float(jnp.log(jnp.float32(0.5)))
    logits = np.array([[0.0, half, -5.0]], np.float32)
    assert kept(sampler.apply_filters(logits, tensors(1, min_p=np.array([0.5], np.float32)))) == [[0, 1]]
    above = np.nextafter(np.float32(0.5), np.float32(1))
    assert kept(sampler.apply_filters(logits, tensors(1, min_p=np.array([above], np.float32)))) == [[0]]
    assert kept(sampler.apply_filters(logits, tensors(1, min_p=np.array([0.0], np.float32)))) == [[0, 1, 2]]


def test_filters_apply_in_order_top_k_then_top_p_over_the_survivors():
    """top-p's mass is renormalized over the top-k survivors: with k=2 the second token's preceding
    mass is p1/(p1+p2)."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    p = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    t = tensors(1, top_k=np.array([2], np.int32), top_p=np.array([p[0] - 1e-3], np.float32))
    assert kept(sampler.apply_filters(logits, t)) == [[0]]
    t = tensors(1, top_k=np.array([2], np.int32), top_p=np.array([p[0] + 1e-3], np.float32))
    assert kept(sampler.apply_filters(logits, t)) == [[0, 1]]


def test_penalties_exact_values():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], np.float32)
    t = tensors(1, repetition_penalty=np.array([2.0], np.float32), frequency_penalty=np.array([0.5], np.float32),
                presence_penalty=np.array([0.25], np.float32), prompt_token_ids=np.array([[0, -1]], np.int32),
                output_token_ids=np.array([[1, 2, 2, -1]], np.int32))
    got = np.asarray(sampler.apply_penalties(logits, t))[0]
    np.testing.assert_allclose(got, [2.0 / 2, -2.0 * 2 - 0.5 - 0.25, 1.0 / 2 - 2 * 0.5 - 0.25, 0.5])


def test_logit_bias_and_masks():
    logits = jnp.zeros((3, 40), jnp.float32)
    t = tensors(3, bias_token_ids=np.array([[5, 7], [-1, -1], [39, -1]], np.int32),
                bias_values=np.array([[1.5, -3.0], [0, 0], [100.0, 0]], np.float32))
    biased = np.asarray(sampler.apply_logit_bias(logits, t))
    assert biased[0, 5] == 1.5 and biased[0, 7] == -3.0 and biased[2, 39] == 100.0
    assert np.count_nonzero(biased) == 3
    words = np.zeros((3, 2), np.uint32)
    for tok in (0, 31, 32, 39):
        words[0, tok // 32] |= np.uint32(1 << (tok % 32))
    words[1:] = 0xFFFFFFFF
    t = tensors(3, token_bitmask=words.view(np.int32),
                allowed_token_ids=np.array([[-1, -1], [3, 33], [-1, -1]], np.int32),
                has_allowed=np.array([False, True, False]),
                banned_token_ids=np.array([[-1], [-1], [0]], np.int32))
    got = kept(sampler.apply_masks(logits, t))
    assert got == [[0, 31, 32, 39], [3, 33], list(range(1, 40))]


def test_a_ban_that_would_leave_nothing_gives_way():
    logits = jnp.zeros((2, 40), jnp.float32)
    only_eos = np.zeros((2, 2), np.uint32)
    only_eos[:, 0] = 1 << 2
    t = tensors(2, token_bitmask=only_eos.view(np.int32), banned_token_ids=np.array([[2], [-1]], np.int32))
    assert kept(sampler.apply_masks(logits, t)) == [[2], [2]]


def test_masked_tokens_never_sampled_and_bias_can_force_a_token():
    logits = jnp.zeros((2, 64), jnp.float32)
    t = tensors(2, all_greedy=False, use_filters=False, temperature=np.array([1.0, 1.0], np.float32),
                bias_token_ids=np.array([[-1], [17]], np.int32), bias_values=np.array([[0], [100.0]], np.float32),
                allowed_token_ids=np.array([[4, 9], [-1, -1]], np.int32), has_allowed=np.array([True, False]))
    for step in range(50):
        t.steps = np.full(2, step, np.int32)
        tokens = np.asarray(sampler.sample(logits, t)[0])
        assert tokens[0] in (4, 9) and tokens[1] == 17


def test_each_step_draws_new_noise_and_a_step_repeats_exactly():
    logits = np.zeros((1, 1000), np.float32)
    draw = lambda step, seed=3: int(sampler.sample(logits, tensors(  # noqa: E731
        1, use_filters=False, seeds=np.array([seed], np.uint32), steps=np.array([step], np.int32)))[0][0])
    assert len({draw(s) for s in range(8)}) >= 6
    assert draw(5) == draw(5)
    assert draw(0, seed=3) != draw(0, seed=4)


def test_num_logprobs_bucket_wider_than_vocabulary():
    """The logprobs count is bucketed to a power of two; on a 24-token vocabulary 20 -> 32 is capped."""
    logits = np.random.default_rng(0).normal(size=(2, 24)).astype(np.float32)
    tokens, lp, top_ids, top_lps = sampler.sample(logits, tensors(2, all_greedy=True, num_logprobs=32))
    assert top_ids.shape == (2, 24)


def _row(output, prompt=(1, 2), *, min_tokens=0, bad=(), eos=(9,), stop_ids=()):
    p = types.SimpleNamespace(min_tokens=min_tokens, stop_token_ids=list(stop_ids))
    request = types.SimpleNamespace(sampling_params=p, eos_token_ids=eos, bad_word_ids=[list(w) for w in bad])
    seq = types.SimpleNamespace(output_token_ids=list(output), num_output_tokens=len(output))
    return request, seq


def test_bad_words_ban_the_last_token_only_after_the_rest():
    bad = [(7,), (3, 4, 5)]
    assert banned_tokens(*_row([], bad=bad)) == [7]
    assert banned_tokens(*_row([3], bad=bad)) == [7]
    assert banned_tokens(*_row([1, 3, 4], bad=bad)) == [7, 5]
    assert banned_tokens(*_row([3, 4, 6], bad=bad)) == [7]
    assert banned_tokens(*_row([4], prompt=(3,), bad=bad)) == [7]  # only the output counts
    assert banned_tokens(*_row([1], min_tokens=2, stop_ids=(8,))) == [9, 8]
    assert banned_tokens(*_row([1, 2], min_tokens=2, stop_ids=(8,))) == []


def test_build_sampling_tensors_pads_and_skips_unused_options():
    from jpaged import SamplingParams

    def row(params, i=0):
        request = types.SimpleNamespace(sampling_params=params, request_id=f"r{i}", eos_token_ids=(2,), grammar=None,
                                        bad_word_ids=[])
        seq = types.SimpleNamespace(seq_id=i, token_ids=[5, 6, 7], num_prompt_tokens=2, output_token_ids=[7],
                                    num_output_tokens=1, structured=None)
        return types.SimpleNamespace(request=request, seq=seq, sample_index=0)

    plain = build_sampling_tensors([row(SamplingParams())], 8, 0)
    for name in ("bias_token_ids", "allowed_token_ids", "token_bitmask", "output_token_ids", "banned_token_ids"):
        assert getattr(plain, name).shape == (8, 0), name
    rich = SamplingParams(logit_bias={3: 1.0, "5": -2.0}, allowed_token_ids=[1, 2, 3], temperature=0.5)
    t = build_sampling_tensors([row(SamplingParams(), 0), row(rich, 1)], 8, 0)
    assert t.bias_token_ids.shape == (8, 2) and t.bias_token_ids[1].tolist() == [3, 5]
    assert t.bias_values[1].tolist() == [1.0, -2.0] and t.bias_token_ids[0].tolist() == [-1, -1]
    assert t.has_allowed.tolist() == [False, True] + [False] * 6
    assert t.allowed_token_ids[1, :3].tolist() == [1, 2, 3]
    assert t.temperature[1] == 0.5 and t.temperature[2] == 0.0 and not t.all_greedy
