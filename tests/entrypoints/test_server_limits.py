"""The server under hostile input: text that is not Unicode, bodies past the limit, wrong token-id
types, constraints that cannot be met, a drain on SIGTERM. Each case is a 4xx naming its field
(or a well-formed end), and the server keeps serving with every block free.

One server per module (uvicorn in a thread on 127.0.0.1) over the tiny random Llama with the byte
tokenizer; the SIGTERM test runs ``scripts/serve.py`` as a process. Every wait is bounded.
"""
import gc
import http.client as httplib
import json
import logging
import os
import queue
import re
import signal
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
pytest.importorskip("uvicorn")

from jpaged import LLM  # noqa: E402
from jpaged.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from jpaged.entrypoints import openai_server  # noqa: E402
from test_server import (API_KEY, CHAT_TEMPLATE, GREEDY, MODEL, REPO, assert_openai_error, http,  # noqa: E402
                         start_server, wait_all_blocks_free)


@pytest.fixture(scope="module")
def srv(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=256, max_model_len=512, max_num_seqs=8)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = openai_server.create_app(engine, served_model_name=MODEL, api_key=API_KEY, chat_template=CHAT_TEMPLATE)
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url, app=app, port=int(url.rsplit(":", 1)[1]),
                          client=openai.OpenAI(api_key=API_KEY, base_url=url + "/v1", max_retries=0, timeout=60))
    server.should_exit = True
    thread.join(30)


def assert_clean(srv):
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"] and srv.engine.num_unfinished == 0


def post(srv, path, body: dict) -> tuple[int, dict]:
    """``body`` as JSON with non-ASCII escaped (``"\\ud800"`` travels as the six characters)."""
    return http(srv, "POST", path, json.dumps(body).encode())


LONE = "\ud800"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "prompt": f"a{LONE}b"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["fine", LONE]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "bad_words": [LONE]}, "bad_words"),
    ("/v1/completions", {**COMPLETION, "stop": LONE}, "stop"),
    ("/v1/completions", {**COMPLETION, "model": LONE}, "model"),
    ("/v1/completions", {**COMPLETION, "cache_salt": LONE}, "cache_salt"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {LONE: 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["a", LONE]}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "model": LONE}, "model"),
    ("/v1/chat/completions", {**CHAT, "bad_words": ["x", LONE]}, "bad_words"),
])
def test_lone_surrogates_are_a_400_naming_the_field(srv, path, body, param):
    status, error = post(srv, path, body)
    assert status == 400, error
    assert_openai_error(error, param)
    assert "Unicode" in error["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({**COMPLETION, "prompt": [True, 5]}, "prompt"),           # true is not token 1
    ({**COMPLETION, "prompt": [[5, 1.0]]}, "prompt"),
    ({**COMPLETION, "stop_token_ids": [True]}, "stop_token_ids"),
    ({**COMPLETION, "allowed_token_ids": ["5"]}, "allowed_token_ids"),
    ({**COMPLETION, "logit_bias": {"\u00b2": 1}}, "logit_bias"),   # "²"
    ({**COMPLETION, "logit_bias": {"\u0661": 1}}, "logit_bias"),   # an Arabic-Indic 1
    ({**COMPLETION, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
])
def test_token_ids_are_ascii_integers_only(srv, body, param):
    status, error = post(srv, "/v1/completions", body)
    assert status == 400, error
    assert_openai_error(error, param)


@pytest.mark.parametrize("text", [
    '{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",  # past int()'s digit limit
    "[" * 5000 + "]" * 5000,                                               # past the recursion limit
    '{"model": "tiny", "prompt": "x"',
    "[1, 2]",
    "\xff\xfe",
], ids=["huge int", "deep", "truncated", "array", "not utf-8"])
def test_bodies_that_are_not_a_json_object_are_a_400(srv, text):
    status, error = http(srv, "POST", "/v1/completions", text.encode("latin-1"))
    assert status == 400, error
    assert_openai_error(error)


def test_bodies_past_the_limit_are_a_413(srv):
    serving = srv.app.state.serving
    limit, serving.max_body_bytes = serving.max_body_bytes, 4096
    body = json.dumps({**COMPLETION, "prompt": "x" * 5000}).encode()
    try:
        status, error = http(srv, "POST", "/v1/completions", body)  # Content-Length says it at once
        assert status == 413 and error["error"]["code"] == "request_too_large"
        assert_openai_error(error)
        conn = httplib.HTTPConnection("127.0.0.1", srv.port, timeout=30)  # chunked: counted as it arrives
        conn.request("POST", "/v1/completions", body=iter([body[:3000], body[3000:]]), encode_chunked=True,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 413
        assert_openai_error(json.loads(response.read()))
        conn.close()
        status, _ = http(srv, "POST", "/v1/completions", json.dumps(COMPLETION).encode())
        assert status == 200
    finally:
        serving.max_body_bytes = limit
    assert_clean(srv)


def test_a_large_body_is_parsed_off_the_event_loop(srv, monkeypatch):
    """A 1 MB prompt: parsed on a worker thread, refused before tokenizing (it cannot fit 512
    tokens); a stream in flight goes on."""
    threads = []
    real = openai_server.parse_body
    monkeypatch.setattr(openai_server, "parse_body", lambda *a: threads.append(threading.current_thread()) or real(*a))
    stream = srv.client.completions.create(model=MODEL, prompt="in flight", max_tokens=30, stream=True, **GREEDY)
    it = iter(stream)
    next(it)
    status, error = post(srv, "/v1/completions", {**COMPLETION, "prompt": "y" * 1_000_000})
    assert status == 400 and error["error"]["param"] == "prompt" and "characters" in error["error"]["message"]
    loop_thread, worker = threads  # the small streaming body was parsed inline, on the event loop
    assert worker is not loop_thread
    assert [c.finish_reason for chunk in it for c in chunk.choices if c.finish_reason] == ["length"]
    assert_clean(srv)


def test_the_bearer_scheme_is_case_insensitive(srv):
    for scheme in ("bearer", "BEARER", "Bearer"):
        req = urllib.request.Request(srv.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    status, error = http(srv, "GET", "/v1/models", key="wrong")
    assert status == 401
    assert_openai_error(error)


def test_structured_output_is_satisfied_or_refused(srv):
    """Issue 29's three silent violations, through the server: each answer satisfies its constraint,
    or ends "length", or is a 400 naming the constraint."""
    jsonschema = pytest.importorskip("jsonschema")
    choices = [f"option{i}" for i in range(10_000)]
    r = srv.client.completions.create(model=MODEL, prompt="Pick:", max_tokens=32, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text in choices
    for kw, param in ((dict(extra_body={"structured_outputs": {"regex": "a{1000}{1000}"}}), "structured_outputs"),
                      (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
                          "name": "self", "schema": {"$ref": "#"}}}}), "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            srv.client.completions.create(model=MODEL, prompt="x", max_tokens=16, **kw)
        assert e.value.body["param"] == param and "not usable" in e.value.body["message"]
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}}  # recursive, but satisfiable
    r = srv.client.completions.create(model=MODEL, prompt="x", max_tokens=24, temperature=1.0, seed=0,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "tree", "schema": schema}}})
    c = r.choices[0]
    assert c.finish_reason == "length" or (c.finish_reason == "stop" and jsonschema.validate(
        json.loads(c.text), schema) is None), c
    regex = "[a-c]{2}[0-9]{1,3}"
    r = srv.client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=1.0, seed=5,
                                      extra_body={"structured_outputs": {"regex": regex}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].text)
    assert_clean(srv)


def test_a_grammar_failing_mid_output_is_a_400_not_a_stop(srv, monkeypatch):
    from jpaged.sample import structured_output

    monkeypatch.setattr(structured_output, "PROBE_TOKENS", 0)  # let it through to fail while decoding
    body = {**COMPLETION, "max_tokens": 8, "structured_outputs": {"regex": "b{1000}{1000}"}}
    status, error = post(srv, "/v1/completions", body)
    assert status == 400 and error["error"]["param"] == "structured_outputs", error
    assert "lexer" in error["error"]["message"]
    with urllib.request.urlopen(urllib.request.Request(
            srv.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}), timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["param"] == "structured_outputs"
    assert_clean(srv)


def test_a_client_disconnect_leaves_no_unretrieved_exception(srv):
    """A non-streaming client that leaves: its request is aborted, and asyncio logs no "exception
    was never retrieved" for the gathered outputs."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("asyncio").addHandler(handler)
    try:
        for i in range(3):
            body = json.dumps({**COMPLETION, "prompt": f"Never read {i}", "max_tokens": 400, "ignore_eos": True})
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
                deadline = time.time() + 20
                while srv.engine.num_running == 0 and time.time() < deadline:
                    time.sleep(0.02)
            assert_clean(srv)
        gc.collect()
        time.sleep(0.2)
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not [r for r in records if "never retrieved" in r.getMessage()], [r.getMessage() for r in records]


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def sse_reasons(stream) -> tuple[list, bool]:
    """(finish reasons, whether data: [DONE] came) of a raw event stream."""
    reasons, done = [], False
    for raw in stream:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            reasons += [c["finish_reason"] for c in json.loads(line[6:]).get("choices", []) if c["finish_reason"]]
    return reasons, done


@pytest.fixture(scope="module")
def long_context_llama_dir(tmp_path_factory):
    """The tiny llama with 64k positions: a stream of 60,000 tokens that no CPU finishes in seconds."""
    from transformers import LlamaConfig

    from conftest import COMMON, _save
    return _save(tmp_path_factory, "llama_64k", LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False,
                                                             **{**COMMON, "max_position_embeddings": 65536}),
                 with_tokenizer=True)


def test_sigterm_drains_then_exits_0(long_context_llama_dir):
    """scripts/serve.py as a process, SIGTERM with two streams in flight: new requests get a 503,
    the short stream finishes, the long one ends at the grace period with finish_reason "abort"
    and data: [DONE]; the process exits 0. It is up when it prints its ready line (and /health is
    a 200), and /health is a 503 shutting_down while it drains."""
    port = free_port()
    llama_dir = long_context_llama_dir
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), f"--model={llama_dir[0]}",
                             f"--port={port}", "--num_kv_blocks=3800", "--max_model_len=60100", "--noprecompile",
                             "--max_num_batched_tokens=128", "--max_num_seqs=4", "--log_level=warning",
                             "--shutdown_timeout=6"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [log.put(line) for line in proc.stdout] + [log.put(None)], daemon=True).start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, lines = time.time() + 180, []
        while not (lines and lines[-1].startswith("jpaged: ready on")):  # the one line that says it is up
            lines.append(log.get(timeout=max(0.1, deadline - time.time())))
            assert lines[-1] is not None, "".join(lines[:-1])[-3000:]
        assert lines[-1].startswith(f"jpaged: ready on {url} ({llama_dir[0]}, 3800 blocks of "), lines[-1]
        assert urllib.request.urlopen(url + "/health", timeout=5).status == 200

        def open_stream(max_tokens):
            body = {"model": llama_dir[0], "prompt": "drain", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            r = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                                              headers={"Content-Type": "application/json"}),
                                       timeout=120)
            r.readline()  # the first event: the request runs
            return r

        short, long = open_stream(20), open_stream(60000)  # 60,000 tokens cannot finish in 6 s on a CPU
        proc.send_signal(signal.SIGTERM)
        results = {}
        readers = [threading.Thread(target=lambda k, r: results.__setitem__(k, sse_reasons(r)), args=(k, r))
                   for k, r in (("short", short), ("long", long))]
        for t in readers:
            t.start()
        time.sleep(0.5)
        status, error = None, None
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=json.dumps(
                {"model": llama_dir[0], "prompt": "late", "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"}), timeout=30)
        except urllib.error.HTTPError as e:
            status, error = e.code, json.loads(e.read())
        assert status == 503 and error["error"]["code"] == "shutting_down"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert health.value.code == 503 and json.loads(health.value.read())["error"]["code"] == "shutting_down"
        for t in readers:
            t.join(60)
        assert results["short"] == (["length"], True)
        assert results["long"] == (["abort"], True)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_many_prompts_never_admitted_together_are_a_400(srv):
    srv.engine.max_queued_requests = 1
    try:
        status, error = post(srv, "/v1/completions", {**COMPLETION, "prompt": ["p"] * 10})  # > 8 running + 1
        assert status == 400 and error["error"]["param"] == "prompt" and "never" in error["error"]["message"]
        status, _ = post(srv, "/v1/completions", {**COMPLETION, "prompt": ["p"] * 9})
        assert status == 200
    finally:
        srv.engine.max_queued_requests = None
    assert_clean(srv)


def test_async_engine_admission_counts(srv):
    """add_requests is all or nothing; num_queued counts only what waits beyond max_num_seqs."""
    from jpaged import SamplingParams
    from jpaged.entrypoints.async_engine import QueueFullError

    gate = threading.Event()
    srv.engine.call(lambda: gate.wait(60))
    srv.engine.max_queued_requests = 2
    params = SamplingParams(temperature=0, max_tokens=2, n=3)
    try:
        requests = [srv.engine.process(f"adm-{i}", [5, 6], params) for i in range(4)]  # 3 x 3 = 9 > 8 slots
        streams = srv.engine.add_requests(requests[:3])
        assert srv.engine.num_queued == 1  # two run (6 sequences), the third waits
        with pytest.raises(QueueFullError):
            srv.engine.add_requests([srv.engine.process("adm-x", [5], params),
                                     srv.engine.process("adm-y", [5], params)])
        assert srv.engine.num_unfinished == 3  # none of the refused pair was added
        streams += srv.engine.add_requests(requests[3:])
        assert srv.engine.num_queued == 2
    finally:
        srv.engine.max_queued_requests = None
        gate.set()
    assert all(list(s)[-1].finished for s in streams)
    assert_clean(srv)
