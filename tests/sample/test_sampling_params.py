"""SamplingParams / BeamSearchParams / StructuredOutputsParams validation: bad values are ValueErrors
naming the field, raised before any device work."""
import math

import numpy as np
import pytest

from jpaged import BeamSearchParams, SamplingParams
from jpaged.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", None), ("temperature", math.nan), ("temperature", -0.1),
    ("temperature", math.inf), ("top_p", "0.9"), ("top_p", 0.0), ("top_p", math.nan), ("top_k", 2.5),
    ("top_k", True), ("top_k", -1), ("min_p", "x"), ("min_p", 1.5), ("presence_penalty", "1"),
    ("presence_penalty", math.nan), ("frequency_penalty", 3.0), ("repetition_penalty", 0),
    ("repetition_penalty", math.inf), ("repetition_penalty", "big"), ("n", 0), ("n", 2.0), ("n", True),
    ("max_tokens", 0), ("max_tokens", "8"), ("min_tokens", 1.5), ("logprobs", 21), ("logprobs", "3"),
    ("seed", 1.5), ("seed", "7"), ("stop", [""]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("ignore_eos", "yes"), ("logit_bias", {3: 101}), ("logit_bias", {3: math.nan}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"a": 1.0}), ("logit_bias", [3, 1.0]), ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -2]), ("allowed_token_ids", [True]), ("bad_words", [""]), ("bad_words", [3]),
    ("structured_outputs", "json"),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_numpy_numbers_and_string_bias_keys_are_accepted():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int32(4), logit_bias={"7": 1, 9: -2.5})
    assert p.logit_bias == {7: 1, 9: -2.5}
    assert SamplingParams(bad_words="bad").bad_words == ["bad"]


@pytest.mark.parametrize("kw,field", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=2.0), "beam_width"), (dict(max_tokens=0), "max_tokens"),
    (dict(length_penalty=math.nan), "length_penalty"), (dict(length_penalty="1"), "length_penalty"),
    (dict(length_penalty=math.inf), "length_penalty"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_beam_search_params(kw, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(**kw)


def test_vocabulary_checks():
    SamplingParams(logprobs=20).validate_for_vocab(24)
    with pytest.raises(ValueError, match="SamplingParams.logprobs=20"):
        SamplingParams(logprobs=20).validate_for_vocab(16)
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        SamplingParams(logit_bias={16: 1.0}).validate_for_vocab(16)
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 16]).validate_for_vocab(16)
    with pytest.raises(ValueError, match="SamplingParams.bad_words.*tokenizer"):
        SamplingParams(bad_words=["x"]).validate_for_vocab(16)
    BeamSearchParams(beam_width=8).validate_for_vocab(16)
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width=9"):
        BeamSearchParams(beam_width=9).validate_for_vocab(16)


@pytest.mark.parametrize("kw,match", [
    (dict(), "exactly one"), (dict(json={}, regex="a"), "exactly one"), (dict(json="{not json"), "json"),
    (dict(json=[1]), "json"), (dict(regex=""), "regex"), (dict(choice=[]), "choice"), (dict(choice="ab"), "choice"),
    (dict(choice=["a", 3]), "choice"), (dict(grammar=" "), "grammar"), (dict(json_object="yes"), "json_object"),
])
def test_structured_outputs_params(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_response_format_mapping():
    from_rf = StructuredOutputsParams.from_response_format
    assert from_rf(None) is None and from_rf({"type": "text"}) is None
    assert from_rf({"type": "json_object"}).json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert from_rf({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).json == schema
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(ValueError, match="response_format"):
            from_rf(bad)
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs.regex == "[0-9]+"
