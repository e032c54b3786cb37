"""Tool calling (issue #41): the request checks, every parser's format (whole and streamed), the
template round trip, and forced calls (required / named) end to end through LLM.chat and the
server with the real openai client, each returned call validated with jsonschema."""
import json
import random

import pytest

from agents_helpers import (CONVERSATION, HERMES_TEMPLATE, PLAIN_TEMPLATE, TIME, TOOLS, WEATHER,
                            accumulate, as_message, assert_valid_calls, without_ids)
from conftest import byte_tokenizer
from jpaged.agents.chat_output import ChatOutputStream, parse_chat_output
from jpaged.agents.tool_parsers import TOOL_PARSERS, get_tool_parser
from jpaged.agents.tools import parse_tool_request
from jpaged.engine.chat_template import apply_chat_template

AUTO = parse_tool_request(TOOLS, "auto")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}'
# per parser: (text, content, [(name, arguments)])
CASES = {
    "hermes": [
        (f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{ROME}</tool_call>", "Let me look.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 1})]),
        (f"<tool_call>{PARIS}", "", [("get_weather", {"city": "Paris", "days": 3})]),  # EOS before the close
        ("No tools needed: <tool_ca", "No tools needed: <tool_ca", []),
    ],
    "llama3_json": [
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
         '{"city": "Oslo", "days": 2}}', "",
         [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "", [("get_time", {"zone": "CET"})]),
        ("It is {sunny} today", "It is {sunny} today", []),
    ],
    "mistral": [
        (f"Sure. [TOOL_CALLS] [{PARIS}, {ROME}]", "Sure.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 1})]),
        ('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "", [("get_time", {"zone": "UTC"})]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), get_time(zone="UTC")]', "",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ],
}
MALFORMED = {"hermes": "<tool_call>{not json}</tool_call>", "llama3_json": '{"name": "get_time", "parameters": ',
             "mistral": "[TOOL_CALLS] [{]", "pythonic": "[get_weather(city=Paris)]"}


def add_up(deltas, calls=None):
    """Tool-call delta pieces accumulated as the openai client does: {index: [id, name, arguments]}."""
    calls = {} if calls is None else calls
    for d in deltas:
        call = calls.setdefault(d["index"], [None, "", ""])
        call[0] = d.get("id") or call[0]
        call[1] += d["function"].get("name") or ""
        call[2] += d["function"].get("arguments") or ""
    return calls


def streamed(text, parser, request, pieces, finish_reason="stop"):
    """The message the deltas of ``text`` cut into ``pieces`` add up to (asserted equal to the calls
    `finish` returns), and how many argument pieces came before the end."""
    stream = ChatOutputStream(None, parser, request)
    content, cuts = "", sorted(random.Random(pieces).sample(range(1, max(2, len(text))), min(pieces, len(text) - 1)))
    calls, early = {}, 0
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        delta = stream.feed(text[a:b])
        content += delta.get("content", "")
        add_up(delta.get("tool_calls", []), calls)
        early += sum(bool(d["function"].get("arguments")) for d in delta.get("tool_calls", []))
    last, final, finish = stream.finish(finish_reason)
    add_up(last.get("tool_calls", []), calls)
    assert [calls[i] for i in sorted(calls)] == [[c.id, c.name, c.arguments] for c in final]
    return content + last.get("content", ""), [(c.name, json.loads(c.arguments)) for c in final], finish, early


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_each_parser_whole_and_streamed(name):
    parser = get_tool_parser(name)
    for text, content, calls in CASES[name]:
        message = parse_chat_output(text, "stop", None, parser, AUTO)
        assert (message.content or "") == content, text
        assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == calls
        assert message.finish_reason == ("tool_calls" if calls else "stop")
        if calls:
            assert_valid_calls([c.to_openai() for c in message.tool_calls])
        for pieces in (1, 3, len(text)):  # whole, a few chunks, one character at a time
            got = streamed(text, parser, AUTO, pieces)
            assert got[:3] == (content, calls, message.finish_reason)
            if pieces == len(text) and calls:  # the arguments arrive in pieces as they are generated
                assert got[3] > len(calls), (name, text)
    malformed = parse_chat_output(MALFORMED[name], "stop", None, parser, AUTO)
    assert malformed.tool_calls == [] and malformed.content == MALFORMED[name] and malformed.finish_reason == "stop"


def test_calls_outside_the_request_stay_text():
    parser = get_tool_parser("hermes")
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'  # an unknown function is never sent as a call
    message = parse_chat_output(text, "stop", None, parser, AUTO)
    assert message.tool_calls == [] and message.content == text
    # a known function's call streams from its name on; arguments that then fail the schema leave it
    # in tool_calls (it was sent), but never with finish_reason "tool_calls"
    lima = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 3}}</tool_call>'
    for pieces in (1, len(lima)):
        content, calls, finish, _ = streamed(lima, parser, AUTO, pieces)
        assert (content, calls, finish) == ("", [("get_weather", {"city": "Lima", "days": 3})], "stop")
    message = parse_chat_output(lima, "stop", None, parser, AUTO)
    assert message.finish_reason == "stop" and message.tool_calls[0].arguments == '{"city": "Lima", "days": 3}'

    single = parse_tool_request(TOOLS, "auto", parallel_tool_calls=False)
    two = f"<tool_call>{PARIS}</tool_call><tool_call>{ROME}</tool_call>"
    first = parse_chat_output(two, "stop", None, parser, single)  # without parallel calls: the first one
    assert [c.arguments for c in first.tool_calls] == ['{"city": "Paris", "days": 3}']
    assert first.finish_reason == "tool_calls"
    assert len(parse_chat_output(two, "stop", None, parser, AUTO).tool_calls) == 2
    assert parse_chat_output(two, "length", None, parser, AUTO).finish_reason == "length"


FORCED = parse_tool_request(TOOLS, "required")


def test_forced_calls_stream_their_arguments_and_equal_the_whole_message():
    """The grammar's JSON array streams call by call, arguments in pieces; cut by max_tokens, the
    calls sent so far stay (finish_reason "length"), streamed or not."""
    from jpaged.agents.tool_parsers import JsonListToolParser

    text = f'[{PARIS}, {{"name": "get_time", "arguments": {{"zone": "UTC"}}}}]'
    whole = parse_chat_output(text, "stop", None, None, FORCED)
    assert whole.finish_reason == "tool_calls" and [c.arguments for c in whole.tool_calls] == [
        '{"city": "Paris", "days": 3}', '{"zone": "UTC"}']
    for pieces in (1, 7, len(text)):
        content, calls, finish, early = streamed(text, JsonListToolParser(), FORCED, pieces)
        assert (content, finish) == ("", "tool_calls") and calls == [(c.name, json.loads(c.arguments))
                                                                    for c in whole.tool_calls]
        assert pieces < len(text) or early >= 20
    cut = text[:52]  # inside the first call's arguments
    message = parse_chat_output(cut, "length", None, None, FORCED)
    assert message.finish_reason == "length" and message.tool_calls[0].arguments == cut[cut.index('{"city"'):]
    stream = ChatOutputStream(None, None, FORCED)
    pieces = [stream.feed(ch).get("tool_calls", []) for ch in cut]
    last, calls, finish = stream.finish("length")
    got = add_up([p for ps in pieces for p in ps] + last.get("tool_calls", []))
    assert finish == "length" and got[0][1:] == ["get_weather", message.tool_calls[0].arguments]


def test_partial_calls_only_grow():
    """On every prefix of a text, each parser's calls are a prefix of the next prefix's calls, each
    call's arguments a prefix of its later arguments: what makes them stream deltas."""
    from jpaged.agents.tool_parsers import JsonListToolParser

    samples = [(get_tool_parser(name), text) for name in sorted(CASES) for text, _, _ in CASES[name]]
    samples.append((JsonListToolParser(), f"[{PARIS}, {ROME}]"))
    for parser, text in samples:
        before = []
        for n in range(len(text) + 1):
            now = parser.partial_calls(text[:n])
            assert len(now) >= len(before), (text, n)
            for old, new in zip(before, now):
                assert new.name == old.name and new.arguments.startswith(old.arguments), (text, n)
            before = now


def test_tool_request_checks_name_the_field():
    assert parse_tool_request(None) is None and parse_tool_request([], "none") is None
    assert parse_tool_request(TOOLS).choice == "auto"
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "named" and [f.name for f in named.callable_functions()] == ["get_time"]
    assert parse_tool_request(TOOLS, "none").template_tools is None
    bad = [((None, "required"), "tool_choice"), (("x",), "tools"), (([{"type": "retrieval"}],), r"tools\[0\]"),
           (([WEATHER, {"type": "function", "function": {"name": "get weather!"}}],), r"tools\[1\].function.name"),
           (([WEATHER, WEATHER],), r"tools\[1\].function.name='get_weather': the same name as tools\[0\]"),
           (([{"type": "function", "function": {"name": "f", "parameters": []}}],), r"parameters \(f\)"),
           (([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],), "'object'"),
           (([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],),
            "not a valid JSON schema"),
           ((TOOLS, "sometimes"), "tool_choice"),
           ((TOOLS, {"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
           ((TOOLS, "auto", "yes"), "parallel_tool_calls"),
           (([{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)],), "at most 128")]
    for args, field in bad:
        with pytest.raises(ValueError, match=field):
            parse_tool_request(*args)


def test_template_renders_tools_and_the_tool_round_trip():
    tok = byte_tokenizer()
    history = CONVERSATION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = apply_chat_template(tok, history, HERMES_TEMPLATE, tools=TOOLS)["prompt"]
    assert '"name": "get_weather"' in prompt and '"maxLength": 6' in prompt  # the tools, as JSON
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>' in prompt
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="tools: the chat template cannot render tools"):
        apply_chat_template(tok, CONVERSATION, PLAIN_TEMPLATE, tools=TOOLS)
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        apply_chat_template(tok, bad, HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def llm(llama_dir):
    from jpaged import LLM

    return LLM(llama_dir[0], num_kv_blocks=256, max_model_len=1024, max_num_seqs=8)


def test_llm_chat_forced_calls_are_schema_valid(llm):
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=160)
    for choice, parallel, names in (("required", True, {"get_weather", "get_time"}),
                                    ({"type": "function", "function": {"name": "get_time"}}, True, {"get_time"}),
                                    ("required", False, {"get_weather", "get_time"})):
        c = llm.chat(CONVERSATION, params, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice=choice,
                     parallel_tool_calls=parallel, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "tool_calls", c.text
        assert_valid_calls(c.tool_calls)
        assert {t["function"]["name"] for t in c.tool_calls} <= names
        if not parallel or isinstance(choice, dict):
            assert len(c.tool_calls) == 1
        assert c.content is None and json.loads(c.text)  # the grammar's JSON array
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=160, n=3)
    outs = llm.chat(CONVERSATION, seeded, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice="required",
                    use_tqdm=False)[0].outputs
    for c in outs:  # sampled, not greedy: still valid calls (or cut off by max_tokens, then no call)
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            assert_valid_calls(c.tool_calls)
    with pytest.raises(ValueError, match="tools: the chat template cannot render tools"):
        llm.chat(CONVERSATION, params, chat_template=PLAIN_TEMPLATE, tools=TOOLS, tool_choice="required")
    with pytest.raises(ValueError, match="tool_call_parser"):
        llm.chat(CONVERSATION, params, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_call_parser="nope")
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


# The server -------------------------------------------------------------------------------------------
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(llm):
    from types import SimpleNamespace

    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.openai_server import create_app
    from test_server import start_server

    engine = AsyncLLMEngine(llm.llm_engine)
    app = create_app(engine, served_model_name="tiny", chat_template=HERMES_TEMPLATE, tool_call_parser="hermes",
                     enable_auto_tool_choice=True)
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url, app=app,
                          client=openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0, timeout=120))
    server.should_exit = True
    thread.join(30)


def test_server_required_calls_stream_and_not(srv):
    for extra in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                  {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        kwargs = dict(model="tiny", messages=CONVERSATION, tools=TOOLS, temperature=0, max_tokens=160, **extra)
        whole = srv.client.chat.completions.create(**kwargs)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        if extra.get("parallel_tool_calls") is False or isinstance(extra["tool_choice"], dict):
            assert len(choice.message.tool_calls) == 1
        message, finish = accumulate(srv.client.chat.completions.create(**kwargs, stream=True))
        assert finish == "tool_calls"
        assert_valid_calls(message["tool_calls"])
        assert without_ids(message) == without_ids(as_message(choice.message))


# what each parser reads, written by the model under a regex (the random model would write noise)
AUTO_OUTPUTS = {
    "hermes": f"I will check.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{ROME}</tool_call>",
    "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    "mistral": f"[TOOL_CALLS] [{PARIS}, {ROME}]",
    "pythonic": '[get_weather(city="Oslo", days=2), get_time(zone="CET")]',
}


@pytest.mark.parametrize("name", sorted(AUTO_OUTPUTS))
def test_server_auto_calls_stream_their_arguments(srv, name):
    """tool_choice="auto" with each parser: the real openai client's stream carries each call's
    index, id and name first, then its arguments in several pieces, and adds up to exactly the
    non-streamed message (ids aside)."""
    import re

    serving = srv.app.state.serving
    text = AUTO_OUTPUTS[name]
    kwargs = dict(model="tiny", messages=CONVERSATION, tools=TOOLS, temperature=0, max_tokens=len(text) + 8,
                  extra_body={"structured_outputs": {"regex": re.escape(text)}})
    try:
        serving.tool_parser = get_tool_parser(name)
        whole = srv.client.chat.completions.create(**kwargs)
        chunks = list(srv.client.chat.completions.create(**kwargs, stream=True))
    finally:
        serving.tool_parser = get_tool_parser("hermes")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message.tool_calls)
    message, finish = accumulate(chunks)
    assert finish == "tool_calls" and without_ids(message) == without_ids(as_message(choice.message))
    pieces = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()]
    for i, call in enumerate(message["tool_calls"]):
        mine = [t for t in pieces if t.index == i]
        assert mine[0].id == call["id"] and mine[0].type == "function" and mine[0].function.name == call["function"]["name"]
        assert all(t.id is None and not t.function.name for t in mine[1:])
        if name != "pythonic" or i == 0:  # pythonic: a keyword at a time (get_time has one)
            assert len([t for t in mine if t.function.arguments]) > 1, (name, mine)  # streamed in pieces


def test_server_tool_result_round_trip(srv):
    first = srv.client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=TOOLS,
                                               tool_choice="required", temperature=0, max_tokens=160)
    calls = first.choices[0].message.tool_calls
    history = CONVERSATION + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21})} for c in calls]
    second = srv.client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0,
                                                max_tokens=8, extra_body={"ignore_eos": True})
    # auto: a random model writes random text, which stays content
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_server_tool_errors_are_400s(srv):
    from test_server import http

    def post(**body):
        return http(srv, "POST", "/v1/chat/completions", {"model": "tiny", "messages": CONVERSATION, **body})

    status, body = post(tools=[WEATHER, TIME, WEATHER], tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tools" and "tools[2]" in body["error"]["message"]
    unsupported = {"type": "function", "function": {"name": "lookbehind", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}, "required": ["a"]}}}
    status, body = post(tools=[WEATHER, unsupported], tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tools", body
    assert "tools[1].function.parameters (lookbehind)" in body["error"]["message"]
    status, body = post(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = post(tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tool_choice"
    m = srv.engine.call(srv.engine.engine.get_metrics).result(timeout=30)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_server_without_auto_tool_choice_refuses_auto(srv):
    """A server started without --enable_auto_tool_choice, and one whose template has no tools."""
    from test_server import http

    serving = srv.app.state.serving
    try:
        serving.auto_tool_choice = False
        status, body = http(srv, "POST", "/v1/chat/completions", {"messages": CONVERSATION, "tools": TOOLS})
        assert status == 400 and body["error"]["param"] == "tool_choice"
        assert "--enable_auto_tool_choice" in body["error"]["message"]
        serving.chat_template = PLAIN_TEMPLATE
        status, body = http(srv, "POST", "/v1/chat/completions",
                            {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "required"})
        assert status == 400 and body["error"]["param"] == "tools" and "cannot render tools" in body["error"]["message"]
    finally:
        serving.auto_tool_choice, serving.chat_template = True, HERMES_TEMPLATE


@pytest.mark.slow
def test_embedded_smollm2_forced_and_auto_calls():
    """The default model (real weights): its own template has no tool support (a clear ValueError);
    with the ChatML tools template a required call is schema-valid, streamed or not, on a server too."""
    pytest.importorskip("gguf")
    from jpaged import LLM, SamplingParams
    from jpaged.agents.templates import CHATML_TOOLS_TEMPLATE
    from jpaged.loading.gguf_loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(max_num_seqs=4, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=96)
    with pytest.raises(ValueError, match="tools: the chat template cannot render tools"):
        llm.chat(CONVERSATION, params, tools=TOOLS, tool_choice="required", use_tqdm=False)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        c = llm.chat(CONVERSATION, params, chat_template=CHATML_TOOLS_TEMPLATE, tools=TOOLS, tool_choice=choice,
                     use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "tool_calls", c.text
        assert_valid_calls(c.tool_calls)
    auto = llm.chat(CONVERSATION, params, chat_template=CHATML_TOOLS_TEMPLATE, tools=TOOLS, use_tqdm=False)[0]
    c = auto.outputs[0]  # whatever SmolLM2 writes: valid calls, or text
    assert (c.finish_reason == "tool_calls") == bool(c.tool_calls)
    if c.tool_calls:
        assert_valid_calls(c.tool_calls)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
