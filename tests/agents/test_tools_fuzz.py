"""Hostile ``tools`` on /v1/chat/completions (issue #41): deep schemas, 1,000 functions, names that
clash, non-object parameters, schemas the grammar engine cannot take, and seeded random mutations of
valid tools. Each answer is a 200 or a 400 naming the field (never a 5xx), a 200's calls satisfy
their schemas, and every KV block is free afterwards with the server still serving."""
import copy
import json
import random

import jsonschema
import pytest

from agents_helpers import CONVERSATION, HERMES_TEMPLATE, TIME, TOOLS, WEATHER

openai = pytest.importorskip("openai")


def fn(name, parameters=None, **extra):
    return {"type": "function", "function": {"name": name, **({} if parameters is None else
                                                                {"parameters": parameters}), **extra}}


def deep(levels):
    schema = {"type": "object", "properties": {}}
    node = schema
    for _ in range(levels):
        child = {"type": "object", "properties": {}}
        node["properties"]["a"] = child
        node = child
    return schema


HOSTILE = [  # (tools, tool_choice, the param of the 400)
    ([fn("deep", deep(200))], "required", "tools"),
    ([fn(f"f{i}") for i in range(1000)], "required", "tools"),
    ([fn(f"f{i}") for i in range(1000)], "auto", "tools"),
    ([WEATHER, fn("get_weather")], "required", "tools"),
    ([fn("list_params", [1, 2])], "required", "tools"),
    ([fn("str_params", "object")], "auto", "tools"),
    ([fn("string_schema", {"type": "string"})], "required", "tools"),
    ([fn("bad_ref", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]})],
     "required", "tools"),
    ([fn("unsat", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                   "required": ["a"]})], "required", "tools"),
    ([fn("", {"type": "object"})], "required", "tools"),
    ([fn("x" * 65)], "required", "tools"),
    ([fn("a b")], "required", "tools"),
    ([{"type": "function"}], "required", "tools"),
    ([{"type": "code_interpreter"}], "required", "tools"),
    (["get_weather"], "required", "tools"),
    ({"get_weather": WEATHER}, "required", "tools"),
    ([fn("d", description=7)], "required", "tools"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, 3, "tool_choice"),
    (None, "required", "tool_choice"),
]


@pytest.fixture(scope="module")
def srv(llama_dir):
    from types import SimpleNamespace

    from jpaged import LLM
    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.openai_server import create_app
    from test_server import start_server

    llm = LLM(llama_dir[0], num_kv_blocks=512, max_model_len=2048, max_num_seqs=8)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = create_app(engine, served_model_name="tiny", chat_template=HERMES_TEMPLATE, tool_call_parser="hermes",
                     enable_auto_tool_choice=True)
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url,
                          client=openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0, timeout=120))
    server.should_exit = True
    thread.join(30)


def post(srv, **body):
    from test_server import http

    return http(srv, "POST", "/v1/chat/completions", {"messages": CONVERSATION, "temperature": 0, **body})


def assert_all_blocks_free(srv):
    m = srv.engine.call(srv.engine.engine.get_metrics).result(timeout=30)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_hostile_tools_are_400s_naming_the_field(srv):
    for tools, tool_choice, param in HOSTILE:
        status, body = post(srv, tools=tools, tool_choice=tool_choice, max_tokens=4)
        assert status == 400, (tools if len(str(tools)) < 300 else str(tools)[:300], body)
        assert body["error"]["param"] == param and body["error"]["message"], body
    status, body = post(srv, parallel_tool_calls="maybe", tools=TOOLS)
    assert status == 400 and body["error"]["param"] == "parallel_tool_calls"
    nested = {"messages": CONVERSATION, "tools": [fn("f", {"type": "object", "properties": {}})]}
    text = json.dumps(nested).replace('"properties": {}', '"properties": ' + '{"a": ' * 5000 + "1" + "}" * 5000)
    from test_server import http
    status, body = http(srv, "POST", "/v1/chat/completions", text.encode())
    assert status == 400, body
    assert_all_blocks_free(srv)


def numbered_tools(count):
    return [fn(f"tool_{i}", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": i}},
                             "required": ["n"]}) for i in range(count)]


def test_the_most_functions_compile_into_one_grammar():
    from conftest import byte_tokenizer
    from jpaged.agents.tools import check_forced_grammar, parse_tool_request

    spec = check_forced_grammar(parse_tool_request(numbered_tools(128), "required"), byte_tokenizer(), 256)
    assert len(spec.json["items"]["anyOf"]) == 128


def test_many_functions_decode_valid_calls(srv):
    tools = numbered_tools(9)  # rendered, they fill ~1,600 tokens of the byte tokenizer
    status, body = post(srv, tools=tools, tool_choice="required", max_tokens=120)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length")
    for call in choice["message"].get("tool_calls") or ():
        i = int(call["function"]["name"].split("_")[1])
        if choice["finish_reason"] == "tool_calls":  # cut by max_tokens, the arguments are as far as they got
            jsonschema.validate(json.loads(call["function"]["arguments"]), tools[i]["function"]["parameters"])
    assert_all_blocks_free(srv)


def mutate(rng: random.Random, value, depth=0):
    """A random change somewhere in ``value``: a replaced, dropped or retyped field."""
    junk = [None, 0, -1, 1e308, "", "x" * 70, [], {}, [1], {"type": "nope"}, True, "object", {"$ref": "#"}]
    if isinstance(value, dict) and value and depth < 6:
        value = dict(value)
        key = rng.choice(sorted(value))
        roll = rng.random()
        if roll < 0.2:
            del value[key]
        elif roll < 0.5:
            value[key] = rng.choice(junk)
        else:
            value[key] = mutate(rng, value[key], depth + 1)
        return value
    if isinstance(value, list) and value and depth < 6:
        value = list(value)
        i = rng.randrange(len(value))
        value[i] = mutate(rng, value[i], depth + 1) if rng.random() < 0.7 else rng.choice(junk)
        return value
    return rng.choice(junk)


def test_random_mutations_never_5xx_and_calls_stay_valid(srv):
    rng = random.Random(41)
    statuses = []
    for _ in range(60):
        tools = mutate(rng, copy.deepcopy(TOOLS)) if rng.random() < 0.9 else mutate(rng, [TIME])
        choice = rng.choice(["required", "auto", "none", {"type": "function", "function": {"name": "get_time"}}])
        status, body = post(srv, tools=tools, tool_choice=choice, max_tokens=rng.choice([4, 60]))
        statuses.append(status)
        assert status in (200, 400), body
        if status == 400:
            assert body["error"]["param"] in ("tools", "tool_choice"), body
            continue
        for call in body["choices"][0]["message"].get("tool_calls") or ():
            schema = next(t["function"].get("parameters", {}) for t in tools
                          if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert statuses.count(400) > 10 and statuses.count(200) > 5  # both sides exercised
    assert_all_blocks_free(srv)
    ok = srv.client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=160)
    assert ok.choices[0].finish_reason == "tool_calls"
