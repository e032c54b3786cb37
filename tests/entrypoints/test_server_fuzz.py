"""A seeded fuzz of the OpenAI server: generated requests over every route and field, with wrong
types, extreme values and hostile strings, sent concurrently.

Asserted: no 5xx (nor a server error event in a stream); every 4xx of a JSON-object body is an
OpenAI error naming a request field; ``/metrics`` shows zero running requests and zero KV usage
afterwards; the same greedy answer before and after. The default run sends 200 requests to the
tiny model; the slow-marked one sends 2,000 over several seeds.
"""
import asyncio
import collections
import json
import random
import time
from types import SimpleNamespace

import pytest

try:
    import httpx
except ImportError:  # the openai client's own dependency: httpx, or its httpx2 fork in newer releases
    httpx = pytest.importorskip("httpx2")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jpaged import LLM  # noqa: E402
from jpaged.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from jpaged.entrypoints.openai_server import REQUEST_FIELDS, create_app  # noqa: E402
from test_server import API_KEY, CHAT_TEMPLATE, MODEL, start_server  # noqa: E402

LONE = "\ud800"
STRINGS = ["", " ", LONE, f"a{LONE}b", "\udfff", "\x00", "\u202e\u0661\u00b2", "\U0001f600" * 40, "{{ 7 * 7 }}",
           "{% raise %}", "<|assistant|>", "x" * 3000, "\ufeff", "%s%n", "null", "-1", "1e309", "\u00b2", "\u0661",
           "\\", "\n\r\t", "true"]
NUMBERS = [0, -1, 1, 2, 7, 255, 256, 2**31, 2**63, -2**63, 10**30, 0.5, -0.0, 1.5, 1e-300, 1e308, -1e308]
OTHERS = [None, True, False, [], {}, [None], [[]], {"": None}, [1] * 300, list(range(-3, 300)), {"a": {"b": [LONE]}},
          [2**63], [2**31], [-1], [255, 256], {"5": 2**63}]
VALUES = STRINGS + NUMBERS + OTHERS

VALID = {  # each field with a value the server accepts
    "model": MODEL, "max_tokens": 3, "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "n": 2, "seed": 3,
    "stop": ["zz"], "stop_token_ids": [70], "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "logit_bias": {"65": 5}, "allowed_token_ids": [65, 66, 2], "bad_words": ["ab"],
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[ab]{1,3}"}, "cache_salt": "s",
    "stream": True, "stream_options": {"include_usage": True},
}
COMPLETION = {"prompt": "Hello", "echo": True, "logprobs": 2, "prompt_logprobs": 1, "suffix": ""}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "add_generation_prompt": False}
SPECIAL = {  # hostile values for structured fields (the cheap ones: no 3-second lexer blow-up here)
    "structured_outputs": [{"choice": []}, {"choice": ["a", LONE]}, {"choice": "abc"}, {"regex": "(a"},
                           {"regex": ""}, {"json": {"$ref": "#"}}, {"json": "{"}, {"json": 5}, {"grammar": "root ::= "},
                           {"json_object": "yes"}, {"regex": "a", "choice": ["a"]}, {"nope": 1},
                           {"choice": [f"o{i}" for i in range(3000)]}, {"json": {"type": "integer", "minimum": 5,
                                                                               "maximum": 1}}],
    "response_format": [{"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
                        {"type": ["x"]}, {"type": "xml"}, {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}}}],
    "messages": [[], [{}], [{"role": "wizard", "content": "x"}], [{"role": ["user"], "content": "x"}],
                 [{"role": "user", "content": {"x": 1}}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user"}],
                 [{"role": "user", "content": LONE}], [{"role": "user", "content": "y" * 20_000}]],
    "prompt": [[], [[]], [True, 5], [5, 1.5], [[5], ["a"]], [-1], [10**6], ["a", 5], "z" * 20_000, [5] * 300],
    "logit_bias": [{"\u00b2": 1}, {"\u0661": 1}, {"5": 101}, {"5": "x"}, {"-1": 1}, {"9" * 50: 1}, {"5": None}],
}


def hostile_request(rng: random.Random) -> tuple[str, str, object]:
    """(method, path, body): a request with a few valid options and up to three fields set to
    hostile values (or dropped, or unknown), or now and then a body that is not a JSON object."""
    roll = rng.random()
    if roll < 0.04:
        return "GET", rng.choice(["/v1/models", "/health", "/metrics", "/v1/nothing"]), None
    if roll < 0.08:
        return "POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(
            [b"{", b"[]", b"\xff\xfe", b'"text"', b"null", b"[" * 50_000, b'{"a": NaN}', b"{}" * 3])
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    own = CHAT if chat else COMPLETION
    sampled = rng.random() < 0.5  # seeded: the same tokens whatever the batch
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0.8 if sampled else 0, "stream": rng.random() < 0.3,
            **({"seed": rng.randrange(1000)} if sampled else {}),
            **({"messages": CHAT["messages"]} if chat else {"prompt": COMPLETION["prompt"]})}
    for _ in range(rng.randint(0, 3)):  # some valid options
        field = rng.choice(sorted({**VALID, **own}))
        body[field] = VALID.get(field, own.get(field))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # and (two times in three) hostile ones
        field = rng.choice(sorted({**VALID, **own}) + ["unknown_field"])
        kind = rng.random()
        if kind < 0.1 and field in body:
            del body[field]
        elif field in SPECIAL and kind < 0.6:
            body[field] = rng.choice(SPECIAL[field])
        else:
            body[field] = rng.choice(VALUES)
    return "POST", path, body


async def send(client: httpx.AsyncClient, method: str, path: str, body) -> SimpleNamespace:
    """The response: status, the parsed error (a 4xx) and, for a stream, its events."""
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with client.stream(method, path, content=content, headers={"Content-Type": "application/json"}) as r:
        raw = await r.aread()
    text = raw.decode("utf-8", "replace")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    error = None
    if r.status_code >= 400:
        try:
            error = json.loads(text)
        except json.JSONDecodeError:
            error = text
    return SimpleNamespace(status=r.status_code, error=error, events=events, streamed=bool(events), text=text)


def check(method, path, body, res) -> list[str]:
    """What is wrong with one answer (empty when it is right)."""
    where = f"{method} {path} {body!r:.300}"
    if res.status >= 500:
        return [f"{res.status} for {where}: {res.text[:300]}"]
    problems = []
    if res.status >= 400:
        e = res.error.get("error") if isinstance(res.error, dict) else None
        if not (isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and e["message"]):
            return [f"{res.status} without an OpenAI error body for {where}: {res.text[:300]}"]
        names_field = isinstance(body, dict) and res.status in (400, 404) and path.startswith("/v1/") \
            and path != "/v1/nothing"
        if names_field and e["param"] not in REQUEST_FIELDS:
            problems.append(f"{res.status} naming no field ({e['param']!r}) for {where}: {e['message'][:300]}")
    elif res.streamed and isinstance(body, dict) and body.get("stream") is True:
        if res.events[-1] != "[DONE]":
            problems.append(f"stream without data: [DONE] for {where}")
        for event in res.events[:-1]:
            payload = json.loads(event)
            if "error" in payload and payload["error"].get("type") == "server_error":
                problems.append(f"server error event for {where}: {event[:300]}")
    return problems


def gauges(text: str) -> dict:
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.name in ("jpaged:num_requests_running", "jpaged:num_requests_waiting", "jpaged:kv_cache_usage_perc")}


async def fuzz(url: str, seeds, num_requests: int, concurrency: int = 8) -> list[str]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=httpx.Timeout(120.0)) as client:
        probe = {"model": MODEL, "prompt": "The same greedy answer", "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True}
        before = (await client.post("/v1/completions", json=probe)).json()["choices"][0]["text"]
        gate = asyncio.Semaphore(concurrency)
        problems, statuses = [], collections.Counter()

        async def one(method, path, body):
            async with gate:
                res = await send(client, method, path, body)
                statuses[res.status] += 1
                problems.extend(check(method, path, body, res))

        for seed in seeds:
            rng = random.Random(seed)
            cases = [hostile_request(rng) for _ in range(num_requests)]
            await asyncio.gather(*(one(*case) for case in cases))
        deadline = time.monotonic() + 30
        while True:  # every request has ended: nothing runs, waits or holds a block
            g = gauges((await client.get("/metrics")).text)
            if not any(g.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if any(g.values()):
            problems.append(f"after the fuzz: {g}")
        after = (await client.post("/v1/completions", json=probe)).json()["choices"][0]["text"]
        if after != before:
            problems.append(f"greedy answer changed: {before!r} -> {after!r}")
        return problems, statuses


@pytest.fixture(scope="module")
def server(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=128, max_model_len=128, max_num_seqs=8)
    engine = AsyncLLMEngine(llm.llm_engine, max_queued_requests=64)
    app = create_app(engine, served_model_name=MODEL, api_key=API_KEY, chat_template=CHAT_TEMPLATE,
                     max_body_bytes=256 * 1024)
    srv, thread, url = start_server(app)
    yield SimpleNamespace(url=url, engine=engine)
    srv.should_exit = True
    thread.join(30)


def run(server, seeds, num_requests):
    problems, statuses = asyncio.run(asyncio.wait_for(fuzz(server.url, seeds, num_requests), 600))
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems)"
    total = num_requests * len(seeds)
    assert statuses[200] > total // 10 and statuses[400] > total // 3, statuses  # both sides are exercised
    m = server.engine.call(server.engine.engine.get_metrics).result(timeout=30)
    assert m["num_free_blocks"] == m["num_total_blocks"] and server.engine.num_unfinished == 0


@pytest.mark.slow
def test_fuzz_200_requests(server):
    run(server, [29], 200)


@pytest.mark.slow
def test_fuzz_2000_requests(server):
    run(server, range(100, 110), 200)
