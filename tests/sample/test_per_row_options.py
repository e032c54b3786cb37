"""The per-row sampling options are declared once, in `SamplingParams`' field metadata (``"per_row"``),
and that declaration carries each of them to the jitted sampler's `SamplingTensors`."""
import dataclasses
import types

import numpy as np
import pytest

from jpaged.sample.sampler import sampling_tensors
from jpaged.sample.sampling_batch import build_sampling_batch
from jpaged.sampling_params import PER_ROW_OPTIONS, SamplingParams

# SamplingParams' fields that are not a plain scalar per sample row, and what carries each instead
SPECIAL = {
    "n": "forks the request into sequences",
    "seed": "each row's seed is derived from it, the request id and the sample index (SamplingBatch.seeds)",
    "max_tokens": "the scheduler's stop",
    "stop": "the output processor's stop strings",
    "stop_token_ids": "banned_token_ids before min_tokens; the scheduler's stop",
    "ignore_eos": "the scheduler's stop",
    "logprobs": "the batch's largest, a static of SamplingTensors (num_logprobs)",
    "skip_special_tokens": "detokenization",
    "include_stop_str_in_output": "detokenization",
    "logit_bias": "bias_token_ids and bias_values, token-id lists",
    "allowed_token_ids": "allowed_token_ids and has_allowed, token-id lists",
    "bad_words": "banned_token_ids, a token-id list",
    "structured_outputs": "token_bitmask",
    "prompt_logprobs": "PromptLogprobTensors",
}
VALUE = {"float32": 0.5, "int32": 3}  # valid for every option, unlike its default and its pad


def undeclared(params_class) -> list[str]:
    """Fields of ``params_class`` neither declared per-row nor listed in SPECIAL."""
    return [f.name for f in dataclasses.fields(params_class) if "per_row" not in f.metadata and f.name not in SPECIAL]


def test_every_field_is_per_row_or_special():
    assert undeclared(SamplingParams) == []
    assert not set(PER_ROW_OPTIONS) & set(SPECIAL)


def test_a_field_without_the_declaration_is_found():
    with_typical_p = dataclasses.make_dataclass("WithTypicalP", [("typical_p", float, dataclasses.field(
        default=1.0, metadata={"help": "Typical sampling mass"}))], bases=(SamplingParams,))
    assert undeclared(with_typical_p) == ["typical_p"]


def _rows(params):
    def row(i, p):
        request = types.SimpleNamespace(sampling_params=p, request_id=f"r{i}", eos_token_ids=(2,), grammar=None,
                                        bad_word_ids=[])
        seq = types.SimpleNamespace(seq_id=i, token_ids=[5, 6, 7], num_prompt_tokens=2, output_token_ids=[7],
                                    num_output_tokens=1, structured=None)
        return request, seq, 0
    return [row(i, p) for i, p in enumerate(params)]


@pytest.mark.parametrize("name", list(PER_ROW_OPTIONS))
def test_every_per_row_option_reaches_sampling_tensors(name):
    """Row 0 keeps the default, row 1 sets the option, rows 2-3 pad: each as the option declares."""
    option = PER_ROW_OPTIONS[name]
    value, default = VALUE[option.dtype], SamplingParams.__dataclass_fields__[name].default
    assert value not in (default, option.pad), name
    t = sampling_tensors(build_sampling_batch(_rows([SamplingParams(), SamplingParams(**{name: value})]), 0), 4)
    got = getattr(t, name)
    assert got.shape == (4,) and got.dtype == np.dtype(option.dtype), name
    assert got.tolist() == [default, value, option.pad, option.pad], name


@pytest.mark.parametrize("name", [name for name, option in PER_ROW_OPTIONS.items() if option.clamp is not None])
def test_a_value_past_the_clamp_is_the_clamp(name):
    clamp = PER_ROW_OPTIONS[name].clamp
    batch = build_sampling_batch(_rows([SamplingParams(max_tokens=None, **{name: clamp * 4})]), 0)
    assert getattr(sampling_tensors(batch, 2), name).tolist() == [clamp, PER_ROW_OPTIONS[name].pad]
