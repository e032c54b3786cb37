"""The OpenAI-compatible server, through the real `openai` client (sync and async).

One server per module (uvicorn in a thread on 127.0.0.1, a free port) over the tiny random Llama with
the byte tokenizer, given a chat template. Every wait is bounded in count and time.
"""
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jpaged import LLM  # noqa: E402
from jpaged.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from jpaged.entrypoints.openai_server import create_app  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-test"
MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def start_server(app):
    """uvicorn in a thread on a free port (the socket is bound first: no race); returns (server, thread, url)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def srv(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=512, max_model_len=1024, max_num_seqs=16)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = create_app(engine, served_model_name=MODEL, api_key=API_KEY, chat_template=CHAT_TEMPLATE)
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url, tokenizer=llm.get_tokenizer(), app=app,
                          client=openai.OpenAI(api_key=API_KEY, base_url=url + "/v1", max_retries=0, timeout=60))
    server.should_exit = True
    thread.join(30)
    assert not engine.is_running  # the app's shutdown stopped the engine loop


def metrics_of(srv) -> dict:
    return srv.engine.call(srv.engine.engine.get_metrics).result(timeout=30)


def wait_all_blocks_free(srv, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = metrics_of(srv)
        if m["num_free_blocks"] == m["num_total_blocks"] or time.time() > deadline:
            return m
        time.sleep(0.05)


def http(srv, method, path, body=None, key=API_KEY):
    """(status, parsed JSON or text) of a raw request, for what the client does not expose."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def assert_openai_error(body, status_param=None):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if status_param is not None:
        assert body["error"]["param"] == status_param


def test_health_and_models(srv):
    assert http(srv, "GET", "/health", key=None)[0] == 200
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_shapes_and_usage(srv):
    r = srv.client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 8, 13)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt as token ids, and a batch of prompts: the same greedy text.
    ids = srv.tokenizer.encode("Hello")
    r2 = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert r2.choices[0].text == r.choices[0].text
    r3 = srv.client.completions.create(model=MODEL, prompt=["Hello", "Other prompt"], max_tokens=8, **GREEDY)
    assert [c.index for c in r3.choices] == [0, 1] and r3.choices[0].text == r.choices[0].text
    echo = srv.client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, echo=True, **GREEDY)
    assert echo.choices[0].text == "Hello" + r.choices[0].text
    r4 = srv.client.completions.create(model=MODEL, prompt=[ids, srv.tokenizer.encode("Other prompt")], max_tokens=8,
                                       **GREEDY)
    assert [c.text for c in r4.choices] == [c.text for c in r3.choices]
    # a repeated 40-token prompt finds its first two 16-token blocks in the prefix cache
    long = "The same forty characters, sent twice.."
    for expected_cached in (0, 32):
        r5 = srv.client.completions.create(model=MODEL, prompt=long, max_tokens=2, **GREEDY)
        assert r5.usage.prompt_tokens_details.cached_tokens == expected_cached


def _stream_text(stream) -> tuple[dict, dict, object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streaming_equals_non_streaming(srv):
    kw = dict(model=MODEL, prompt=["Streaming test", "Second"], max_tokens=12, **GREEDY)
    full = srv.client.completions.create(**kw)
    texts, reasons, usage = _stream_text(srv.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == full.usage.completion_tokens == 24
    assert usage.prompt_tokens == full.usage.prompt_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    texts, reasons, _ = _stream_text(srv.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY))
    assert texts == {0: chat.choices[0].message.content} and reasons == {0: "length"}


def test_chat_applies_the_template(srv):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    rendered = "<|user|>What is 2+2?\n<|assistant|>"
    assert chat.usage.prompt_tokens == len(srv.tokenizer.encode(rendered))
    plain = srv.client.completions.create(model=MODEL, prompt=rendered, max_tokens=6, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text
    # OpenAI's list-of-parts content is the same text
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    again = srv.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, **GREEDY)
    assert again.choices[0].message.content == chat.choices[0].message.content


def test_n_samples_and_seed(srv):
    kw = dict(model=MODEL, prompt="Sample me", max_tokens=10, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = srv.client.completions.create(**kw)
    b = srv.client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({tuple(c.text) for c in a.choices}) > 1                   # n distinct samples
    texts, reasons, _ = _stream_text(srv.client.completions.create(**kw, stream=True))
    assert texts == {c.index: c.text for c in a.choices} and len(reasons) == 3
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=5, n=2, temperature=1.0, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings(srv):
    kw = dict(model=MODEL, prompt="Stop strings", max_tokens=40, **GREEDY)
    full = srv.client.completions.create(**kw).choices[0].text
    printable = [i for i in range(2, len(full) - 1) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    assert printable, f"no printable pair in {full!r}"
    stop = full[printable[0]:printable[0] + 2]
    expected = full[:full.find(stop)]
    r = srv.client.completions.create(**kw, stop=[stop, "never-there"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    texts, reasons, _ = _stream_text(srv.client.completions.create(**kw, stop=stop, stream=True))
    assert texts == {0: expected} and reasons == {0: "stop"}  # streamed text never overshoots the stop


def test_logprobs(srv):
    r = srv.client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens).encode("utf-8", "replace") and all(x <= 0 for x in lp.token_logprobs)
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4
        assert token_lp >= max(top.values()) - 1e-5  # greedy picks the most likely token
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    stream = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, logprobs=True, top_logprobs=2, stream=True, **GREEDY)
    streamed = [c.logprob for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content])


def test_32_concurrent_streams_complete(srv):
    async def one(client, i):
        if i % 2:  # half chat, half completions
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Concurrent chat {i}"}], max_completion_tokens=8,
                stream=True, stream_options={"include_usage": True}, **GREEDY)
        else:
            stream = await client.completions.create(model=MODEL, prompt=f"Concurrent request {i}", max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True}, **GREEDY)
        reason, usage = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                reason = c.finish_reason or reason
        assert usage.completion_tokens == 8
        return reason

    async def main():
        client = openai.AsyncOpenAI(api_key=API_KEY, base_url=srv.url + "/v1", max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 180)
        finally:
            await client.close()

    assert asyncio.run(main()) == ["length"] * 32
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_disconnected_stream_is_aborted(srv):
    before = metrics_of(srv)["num_free_blocks"]
    assert before == metrics_of(srv)["num_total_blocks"]
    stream = srv.client.completions.create(model=MODEL, prompt="A long story", max_tokens=900, stream=True,
                                           **GREEDY)
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    assert metrics_of(srv)["num_free_blocks"] < before  # running: it holds blocks
    stream.close()  # the client goes away mid-stream
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"], "a disconnected stream kept its blocks"
    assert srv.engine.num_running == srv.engine.num_waiting == 0
    families = {f.name: f for f in text_string_to_metric_families(http(srv, "GET", "/metrics")[1])}
    aborted = [s.value for s in families["jpaged:request_success"].samples
               if s.labels.get("finished_reason") == "abort"]
    assert aborted and aborted[0] >= 1


def test_disconnected_non_streaming_request_is_aborted(srv):
    body = json.dumps({"model": MODEL, "prompt": "Never read", "max_tokens": 900, "temperature": 0,
                       "ignore_eos": True}).encode()
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 20
        while srv.engine.num_running == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert srv.engine.num_running == 1
    m = wait_all_blocks_free(srv)  # the connection closed: the request was aborted, its blocks freed
    assert m["num_free_blocks"] == m["num_total_blocks"] and srv.engine.num_running == 0


def test_engine_failure_is_a_500_or_an_error_event(srv, monkeypatch):
    engine = srv.engine.engine
    real_step = engine.step
    failures = [2]

    def failing_step():
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("simulated device failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(openai.InternalServerError) as e:
        srv.client.completions.create(model=MODEL, prompt="fail", max_tokens=4)
    assert e.value.status_code == 500 and "simulated device failure" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="simulated device failure"):
        list(srv.client.completions.create(model=MODEL, prompt="fail", max_tokens=4, stream=True))
    r = srv.client.completions.create(model=MODEL, prompt="after", max_tokens=4, **GREEDY)  # still serving
    assert r.choices[0].finish_reason == "length"
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_errors_are_openai_shaped(srv):
    bad_key = openai.OpenAI(api_key="wrong", base_url=srv.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    status, body = http(srv, "GET", "/v1/models", key=None)
    assert status == 401
    assert_openai_error(body)
    status, body = http(srv, "POST", "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400
    assert_openai_error(body)
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt="x" * 1100, max_tokens=4)  # cannot fit 1024
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model=MODEL, prompt=[5, 999999], max_tokens=4)  # outside the vocabulary
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model=MODEL, prompt="x", extra_body={"n": 0})
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    assert set(e.value.body) == {"message", "type", "param", "code"}
    status, body = http(srv, "GET", "/v1/no-such-route")
    assert status == 404
    assert_openai_error(body)
    # none of that touched the engine: the next request is served, and no block is held
    assert srv.client.completions.create(model=MODEL, prompt="fine", max_tokens=2).choices[0].finish_reason
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_admission_is_max_num_seqs_running_then_the_queue(srv):
    """vLLM's semantics: max_num_seqs (16) sequences run and max_queued_requests (2) wait; the next
    is a 503 at once. Requests that could never be admitted together are a 400, not a retryable 503."""
    gate = threading.Event()
    srv.engine.call(lambda: gate.wait(60))  # hold the engine loop: nothing runs, nothing finishes
    srv.engine.max_queued_requests = 2
    results = []

    def request():
        r = srv.client.completions.create(model=MODEL, prompt="queued", max_tokens=3, **GREEDY)
        results.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=request) for _ in range(18)]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while srv.engine.num_unfinished < 18 and time.time() < deadline:
            time.sleep(0.02)
        assert srv.engine.num_unfinished == 18 and srv.engine.num_queued == 2  # 16 run, 2 wait: none refused
        start = time.time()
        with pytest.raises(openai.InternalServerError) as e:  # the openai client's class for 5xx
            srv.client.completions.create(model=MODEL, prompt="one too many", max_tokens=3)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        assert set(e.value.body) == {"message", "type", "param", "code"}
        assert time.time() - start < 10  # at once, not after the queue drains
        with pytest.raises(openai.BadRequestError) as e:  # 19 prompts: more than 16 + 2, even when idle
            srv.client.completions.create(model=MODEL, prompt=["x"] * 19, max_tokens=3)
        assert e.value.body["param"] == "prompt" and "never" in e.value.body["message"]
    finally:
        srv.engine.max_queued_requests = None
        gate.set()
        for t in threads:
            t.join(60)
    assert results == ["length"] * 18
    srv.engine.max_queued_requests = 2
    try:  # idle: one request with 3 prompts fits in the running slots
        r = srv.client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2, **GREEDY)
        assert [c.finish_reason for c in r.choices] == ["length"] * 3
    finally:
        srv.engine.max_queued_requests = None


def test_metrics_endpoint_parses(srv):
    srv.client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, **GREEDY)
    status, text = http(srv, "GET", "/metrics", key=None)  # outside /v1: no key needed
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("jpaged:num_requests_running", "jpaged:num_requests_waiting", "jpaged:kv_cache_usage_perc",
                 "jpaged:prefix_cache_queries", "jpaged:prefix_cache_hits", "jpaged:num_preemptions",
                 "jpaged:prompt_tokens", "jpaged:generation_tokens", "jpaged:time_to_first_token_seconds",
                 "jpaged:inter_token_latency_seconds", "jpaged:e2e_request_latency_seconds"):
        assert name in families, name
    value = lambda name, suffix: next(s.value for s in families[name].samples if s.name == name + suffix)  # noqa
    assert value("jpaged:generation_tokens", "_total") >= 4
    assert value("jpaged:time_to_first_token_seconds", "_count") >= 1
    assert 0 <= value("jpaged:kv_cache_usage_perc", "") <= 1
    # the Gateway API Inference Extension's model-server protocol names (vLLM's), the same values
    assert value("vllm:num_requests_waiting", "") == value("jpaged:num_requests_waiting", "")
    assert value("vllm:num_requests_running", "") == value("jpaged:num_requests_running", "")
    assert value("vllm:kv_cache_usage_perc", "") == value("jpaged:kv_cache_usage_perc", "")
    config = families["vllm:cache_config_info"].samples[0].labels
    assert int(config["block_size"]) == srv.engine.engine.config.cache.block_size
    assert int(config["num_gpu_blocks"]) == value("jpaged:num_kv_blocks", "")
    assert "vllm:lora_requests_info" not in families  # no LoRA


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}


def greedy_token(srv, prompt) -> int:
    """The first greedy token of ``prompt``, from the engine front (the server returns no token ids)."""
    from jpaged import SamplingParams

    stream = srv.engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return [out for out in stream][-1].outputs[0].token_ids[0]


def test_structured_output_and_logit_bias(srv):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Give me JSON"}]
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    chat = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                              response_format=rf)
    assert chat.choices[0].finish_reason == "stop"  # the grammar ended, then only EOS was allowed
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    # json_object: a random model would write one endless key; a bias on "}" closes the object at once
    obj = srv.client.completions.create(model=MODEL, prompt="JSON:", max_tokens=16, temperature=0,
                                        logit_bias={str(ord("}")): 100},
                                        extra_body={"response_format": {"type": "json_object"}})
    assert json.loads(obj.choices[0].text) == {} and obj.choices[0].finish_reason == "stop"
    # vLLM's structured_outputs: a choice (chat, sampled, n=3) and a regex (completions, streamed)
    choices = ["red", "green", "blue"]
    picked = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, n=3, seed=3,
                                                extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in picked.choices)
    texts, _, _ = _stream_text(srv.client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=16, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}}))
    assert re.fullmatch("[a-c]{3}-[0-9]", texts[0]), texts

    # logit_bias: -100 on the greedy first token changes it; +100 on "A" forces it
    prompt = "Bias me"
    first = greedy_token(srv, prompt)
    base = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=0, **GREEDY)
    biased = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=0,
                                           logit_bias={str(first): -100}, **GREEDY)
    assert base.choices[0].logprobs.tokens[0] == srv.tokenizer.decode([first])
    assert biased.choices[0].logprobs.tokens[0] != base.choices[0].logprobs.tokens[0]
    forced = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                logit_bias={str(ord("A")): 100}, **GREEDY)
    assert forced.choices[0].message.content == "AAAA"
    # allowed_token_ids with bad_words; include_stop_str_in_output
    only_y = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={
        "allowed_token_ids": [ord("x"), ord("y")], "bad_words": ["x"], "ignore_eos": True}, temperature=1.0, seed=0)
    assert only_y.choices[0].text == "yyyyy"
    for include, expected in ((True, "AA"), (False, "")):
        r = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop="AA", logit_bias={
            str(ord("A")): 100}, extra_body={"include_stop_str_in_output": include, "ignore_eos": True}, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")


def test_echo_logprobs_and_prompt_logprobs(srv):
    r = srv.client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, logprobs=2,
                                      extra_body={"prompt_logprobs": 1, "ignore_eos": True}, temperature=0)
    c = r.choices[0]
    lp, prompt_lps = c.logprobs, c.model_extra["prompt_logprobs"]
    assert c.text.startswith("Echo me") and len(lp.tokens) == 7 + 3 and "".join(lp.tokens[:7]) == "Echo me"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert prompt_lps[0] is None and len(prompt_lps) == 7
    for i in range(1, 7):
        token = str(ord("Echo me"[i]))
        assert lp.token_logprobs[i] == pytest.approx(prompt_lps[i][token]["logprob"]) and lp.token_logprobs[i] <= 0
        assert 1 <= len(lp.top_logprobs[i]) <= 3 and len(prompt_lps[i]) <= 2
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[7] == len("Echo me")
    texts, _, _ = _stream_text(srv.client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True,
                                                             stream=True, **GREEDY))
    assert texts == {0: c.text}
    # streamed without echo: the choice's first chunk carries prompt_logprobs
    chunks = list(srv.client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, stream=True,
                                                extra_body={"prompt_logprobs": 1, "ignore_eos": True}, temperature=0))
    streamed = [ch.choices[0].model_extra.get("prompt_logprobs") for ch in chunks if ch.choices]
    assert len(streamed) >= 2 and all(x is None for x in streamed[1:]) and streamed[0][0] is None
    assert [sorted(e) for e in streamed[0][1:]] == [sorted(e) for e in prompt_lps[1:]]


def test_output_control_errors_are_400_before_the_engine(srv, monkeypatch):
    """A bad regex, schema or bias is a 400 naming the field; the engine never sees the request, and a
    request in flight is not disturbed."""
    stream = srv.client.completions.create(model=MODEL, prompt="In flight", max_tokens=40, stream=True, **GREEDY)
    it = iter(stream)
    next(it)
    engine = srv.engine.engine
    real_add, added = engine.add_request, []
    monkeypatch.setattr(engine, "add_request", lambda request_id, *a, **kw: (added.append(request_id),
                                                                            real_add(request_id, *a, **kw))[1])
    messages = [{"role": "user", "content": "x"}]
    cases = [
        ("structured_outputs", dict(extra_body={"structured_outputs": {"regex": "([a-z"}})),
        ("structured_outputs", dict(extra_body={"structured_outputs": {"choice": []}})),
        ("structured_outputs", dict(extra_body={"structured_outputs": {"json": "{", "regex": "a"}})),
        ("response_format", dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "nonsense"}}}})),
        ("response_format", dict(extra_body={"response_format": {"type": "xml"}})),
        ("logit_bias", dict(logit_bias={"5": 150})),
        ("logit_bias", dict(logit_bias={"999999": 1})),   # outside the 256-token vocabulary
        ("logit_bias", dict(logit_bias={"x": 1})),
        ("allowed_token_ids", dict(extra_body={"allowed_token_ids": [300]})),
        ("bad_words", dict(extra_body={"bad_words": [" "]})),
    ]
    for param, kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client.completions.create(model=MODEL, prompt="x", max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        assert e.value.body["type"] == "invalid_request_error" and set(e.value.body) == {
            "message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=MODEL, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/missing"}}})
    assert e.value.body["param"] == "response_format"
    assert added == []  # none reached the engine
    assert [c.finish_reason for chunk in it for c in chunk.choices if c.finish_reason] == ["length"]
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_metrics_running_and_waiting_are_the_schedulers(srv):
    """With more requests than max_num_seqs (16), the gauges are the scheduler's queue lengths."""
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    streams = [srv.engine.add_request(None, f"gauge {i}", params) for i in range(20)]
    try:
        for s in streams:
            s.added.result(timeout=30)
        families = {f.name: f for f in text_string_to_metric_families(http(srv, "GET", "/metrics", key=None)[1])}
        gauge = lambda name: families[name].samples[0].value  # noqa: E731
        running, waiting = gauge("jpaged:num_requests_running"), gauge("jpaged:num_requests_waiting")
        assert running + waiting == 20 and running <= 16 and waiting >= 4, (running, waiting)
    finally:
        for s in streams:
            srv.engine.abort(s.request_id)
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_http_benchmark_smoke(srv):
    """benchmark_serving.py's HTTP mode against this server (alpaca-like shrunk to a few tokens a request)."""
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "benchmark_serving.py"),
                             f"--base_url={srv.url}/v1", f"--api_key={API_KEY}", "--workload=alpaca-like",
                             "--length_scale=0.1", "--num_requests=6", "--request_rates=20", "--http_vocab_size=256",
                             "--warmup_requests=0"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "requests/s" in result.stdout and "output tok/s" in result.stdout and "TTFT" in result.stdout


def test_async_engine_front_directly(srv):
    """AsyncLLMEngine alone: deltas add up to the cumulative output; a plain thread can add and read."""
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    async def both():
        finals = [out async for out in srv.engine.generate("direct", params)]
        deltas = [out async for out in srv.engine.generate("direct", params, delta=True)]
        return finals[-1], deltas

    final, deltas = asyncio.run(both())
    assert final.finished and deltas[-1].finished
    assert "".join(c.text for d in deltas for c in d.outputs) == final.outputs[0].text
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == final.outputs[0].token_ids
    assert [lp for d in deltas for c in d.outputs for lp in c.logprobs] == final.outputs[0].logprobs
    stream = srv.engine.add_request(None, "direct", params)  # from this (non-async) thread
    assert stream.added.result(timeout=30) is None
    assert [out for out in stream][-1].outputs[0].token_ids == final.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt"):
        srv.engine.add_request(None, "", params).added.result(timeout=30)
    assert srv.engine.num_waiting == srv.engine.num_running == 0


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    """vllm:lora_requests_info's labels: the adapters of the scheduler's running and waiting requests."""
    from jpaged.entrypoints.metrics import _lora_adapters

    def req(name):
        return SimpleNamespace(lora_request=None if name is None else SimpleNamespace(lora_name=name))

    scheduler = SimpleNamespace(running=[req("b"), req(None), req("a"), req("b")], waiting=[req("c"), req(None)])
    engine = SimpleNamespace(lora=SimpleNamespace(max_loras=4), scheduler=scheduler)
    assert _lora_adapters(engine) == {"max_lora": 4, "running": ["a", "b"], "waiting": ["c"]}
    assert _lora_adapters(SimpleNamespace(lora=None, scheduler=scheduler)) is None
