"""The OpenAI request shapes' translation to `SamplingParams` (`jpaged.entrypoints.protocol`), without a server."""
import pytest

from jpaged.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jpaged.sampling_params import PER_ROW_OPTIONS, SamplingParams

VALUE = {"float32": 0.5, "int32": 3}


@pytest.mark.parametrize("name", list(PER_ROW_OPTIONS))
def test_every_per_row_option_is_a_request_field(name):
    """Each per-row option is a request field of its name: set, it reaches SamplingParams; unset or
    null, SamplingParams' default."""
    value = VALUE[PER_ROW_OPTIONS[name].dtype]
    default = SamplingParams.__dataclass_fields__[name].default
    assert getattr(CompletionRequest(prompt="x", **{name: value}).sampling_params(), name) == value
    assert getattr(ChatCompletionRequest(messages=[], **{name: value}).sampling_params(), name) == value
    assert getattr(CompletionRequest(prompt="x").sampling_params(), name) == default
    assert getattr(CompletionRequest(prompt="x", **{name: None}).sampling_params(), name) == default


def test_top_k_minus_one_is_every_token():
    assert CompletionRequest(prompt="x", top_k=-1).sampling_params().top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        CompletionRequest(prompt="x", top_k=-2).sampling_params()
