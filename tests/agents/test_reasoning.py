"""Reasoning output (issue #41): the ``<think>`` split of each parser, whole and streamed, tool calls
read from the answer only, the grammar that starts at ``</think>``, and reasoning_content through
LLM.chat and the server (streamed and not, with the openai client)."""
import pytest

from agents_helpers import CONVERSATION, HERMES_TEMPLATE, TOOLS, accumulate, as_message, assert_valid_calls
from conftest import byte_tokenizer
from jpaged.agents.chat_output import ChatOutputStream, parse_chat_output
from jpaged.agents.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from jpaged.agents.tool_parsers import get_tool_parser
from jpaged.agents.tools import parse_tool_request

# per parser: text -> (reasoning_content, content)
CASES = {
    "deepseek_r1": {"I think.</think>\n\nThe answer.": ("I think.", "The answer."),
                    "<think>I think.</think>The answer.": ("I think.", "The answer."),
                    "Still thinking when cut off": ("Still thinking when cut off", ""),
                    "</think>Direct": ("", "Direct")},
    "qwen3": {"<think>\nweigh it\n</think>\n\nYes.": ("\nweigh it\n", "Yes."),
              "Yes, no thinking.": (None, "Yes, no thinking."),
              "<think>cut off <": ("cut off <", ""),
              "  <thin": (None, "  <thin")},
}


def stream_all(text, reasoning, tool_parser=None, request=None):
    """Reasoning and content the deltas add up to when ``text`` arrives one character at a time (the
    tool-call deltas left out)."""
    stream, got = ChatOutputStream(reasoning, tool_parser, request), {}
    deltas = [stream.feed(ch) for ch in text]
    last, calls, finish = stream.finish("stop")
    for d in deltas + [last]:
        for k, v in d.items():
            if k != "tool_calls":  # the calls are checked apart (test_tool_calls)
                got[k] = got.get(k, "") + v
    return got, calls, finish


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_split_whole_and_streamed(name):
    parser = get_reasoning_parser(name)
    for text, (reasoning, content) in CASES[name].items():
        message = parse_chat_output(text, "stop", parser)
        assert (message.reasoning_content, message.content) == (reasoning, content), text
        got, _, _ = stream_all(text, parser)
        assert got.get("reasoning_content", None if reasoning is None else "") == reasoning
        assert got.get("content", "") == content


def test_tool_calls_are_read_from_the_answer_only():
    reasoning, hermes, auto = get_reasoning_parser("qwen3"), get_tool_parser("hermes"), parse_tool_request(TOOLS)
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    text = f"<think>maybe {call}?</think>\n{call}"
    message = parse_chat_output(text, "stop", reasoning, hermes, auto)
    assert message.reasoning_content == f"maybe {call}?" and message.finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1 and message.content is None
    got, calls, finish = stream_all(text, reasoning, hermes, auto)
    assert got == {"reasoning_content": f"maybe {call}?"} and len(calls) == 1 and finish == "tool_calls"
    only_thought = parse_chat_output(f"<think>{call}</think>Done.", "stop", reasoning, hermes, auto)
    assert only_thought.tool_calls == [] and only_thought.content == "Done."


def test_forced_grammar_starts_at_the_end_of_thinking():
    from jpaged.sample.structured_output import compile_grammar

    tok = byte_tokenizer()
    request = parse_tool_request(TOOLS, "required")
    for name, thought in (("deepseek_r1", "hmm, </thin ok"), ("qwen3", "<think>hmm, </thin ok")):
        grammar = compile_grammar(request.structured_outputs(get_reasoning_parser(name)), tok, 256)

        def accepts(text):
            state = grammar.new_state()
            ok = state.matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
            return ok and not state.matcher.is_error() and state.matcher.is_accepting()

        good = thought + '</think>\n[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
        assert accepts(good)
        assert not accepts(thought + "</think>\nSure, the weather!")               # prose after thinking
        assert not accepts(thought + '</think>[{"name": "get_time", "arguments": {"zone": "utc"}}]')  # schema
        assert not accepts(good.replace("</think>\n", ""))                          # never ends thinking


@pytest.fixture(scope="module")
def llm(llama_dir):
    from jpaged import LLM

    return LLM(llama_dir[0], num_kv_blocks=256, max_model_len=1024, max_num_seqs=8)


def test_llm_chat_returns_reasoning_content(llm):
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.chat(CONVERSATION, params, chat_template=HERMES_TEMPLATE, use_tqdm=False)[0].outputs[0]
    assert plain.reasoning_content is None and plain.content == plain.text
    c = llm.chat(CONVERSATION, params, chat_template=HERMES_TEMPLATE, reasoning_parser="deepseek_r1",
                 use_tqdm=False)[0].outputs[0]
    reasoning, content = get_reasoning_parser("deepseek_r1").split(c.text)
    assert (c.reasoning_content, c.content) == (reasoning, content) and c.text == plain.text
    with pytest.raises(ValueError, match="reasoning_parser"):
        llm.chat(CONVERSATION, params, chat_template=HERMES_TEMPLATE, reasoning_parser="o1")


openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(llm):
    from types import SimpleNamespace

    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.openai_server import create_app
    from test_server import start_server

    engine = AsyncLLMEngine(llm.llm_engine)
    app = create_app(engine, served_model_name="tiny", chat_template=HERMES_TEMPLATE, tool_call_parser="hermes",
                     enable_auto_tool_choice=True, reasoning_parser="deepseek_r1")
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url,
                          client=openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0, timeout=120))
    server.should_exit = True
    thread.join(30)


def test_server_reasoning_streamed_and_not(srv):
    kwargs = dict(model="tiny", messages=CONVERSATION, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    whole = srv.client.chat.completions.create(**kwargs)
    message = as_message(whole.choices[0].message)
    assert message["reasoning_content"]  # deepseek_r1: the output reasons from its first token
    streamed, finish = accumulate(srv.client.chat.completions.create(**kwargs, stream=True))
    assert streamed == message and finish == whole.choices[0].finish_reason == "length"


def test_server_required_call_after_reasoning_is_never_invalid(srv):
    """A random model rarely ends its thinking: the reply is then reasoning cut off by max_tokens,
    never a call; a call, when there is one, satisfies its schema."""
    reply = srv.client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=TOOLS, temperature=0,
                                               tool_choice="required", max_tokens=24)
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        assert_valid_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert (choice.message.model_extra or {}).get("reasoning_content")
    m = srv.engine.call(srv.engine.engine.get_metrics).result(timeout=30)
    assert m["num_free_blocks"] == m["num_total_blocks"]
