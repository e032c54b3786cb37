"""The server against what a web page or a careless client can send it: cross-site "simple requests"
(a JSON body as ``text/plain``, a form, no body), CORS preflights, a body announced and never sent;
and what it says about itself: ``/health`` while draining, the one "ready" line of ``scripts/serve.py``.

One server per module (uvicorn in a thread on 127.0.0.1, no API key: the case a page can exploit)
over the tiny random Llama with the byte tokenizer; apps with ``allowed_origins`` or an API key share
its engine and are called in process (httpx's ASGI transport). The ready line is read from a real
``scripts/serve.py`` process. Every wait is bounded.
"""
import asyncio
import http.client
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

try:
    import httpx
except ImportError:  # the openai client's own dependency: httpx, or its httpx2 fork in newer releases
    httpx = pytest.importorskip("httpx2")
pytest.importorskip("uvicorn")

from jpaged import LLM  # noqa: E402
from jpaged.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from jpaged.entrypoints import openai_server  # noqa: E402
from test_server import (API_KEY, CHAT_TEMPLATE, MODEL, REPO, assert_openai_error, start_server,  # noqa: E402
                         wait_all_blocks_free)

EVIL, GOOD = "https://evil.example", "https://app.example"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
# What a page's fetch(url, {method: "POST", mode: "no-cors", body}) or a <form> sends: no preflight.
BROWSER = {"Origin": EVIL, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "empty",
           "Referer": EVIL + "/", "User-Agent": "Mozilla/5.0", "Accept": "*/*"}
SIMPLE_CONTENT_TYPES = ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                        "multipart/form-data; boundary=----WebKitFormBoundaryx8", None]


@pytest.fixture(scope="module")
def srv(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=128, max_model_len=256, max_num_seqs=4)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = openai_server.create_app(engine, served_model_name=MODEL, chat_template=CHAT_TEMPLATE)
    server, thread, url = start_server(app)
    yield SimpleNamespace(engine=engine, url=url, app=app, port=int(url.rsplit(":", 1)[1]))
    server.should_exit = True
    thread.join(30)


def post_routes(app) -> list[str]:
    return sorted(r.path for r in app.routes if "POST" in getattr(r, "methods", ()))


def raw_post(srv, path, body: bytes, headers: dict) -> tuple[int, dict, dict]:
    """(status, lower-cased headers, parsed JSON) of a POST sent with exactly ``headers`` (and
    Host, Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def in_process(app, method, path, headers=None, body=None) -> httpx.Response:
    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.request(method, path, headers=headers, content=body)
    return asyncio.run(call())


def app_with(srv, **kwargs):
    """Another app over the module's engine (never started: no lifespan, so the engine stays up)."""
    return openai_server.create_app(srv.engine, served_model_name=MODEL, chat_template=CHAT_TEMPLATE,
                                    metrics=srv.app.state.metrics, **kwargs)


@pytest.mark.parametrize("content_type", SIMPLE_CONTENT_TYPES, ids=["text", "form", "multipart", "none"])
def test_a_cross_site_simple_request_is_a_415_on_every_post_route(srv, content_type, monkeypatch):
    routes = post_routes(srv.app)
    assert {"/v1/completions", "/v1/chat/completions"} <= set(routes)
    processed = []
    monkeypatch.setattr(srv.engine, "process", lambda *a, **k: processed.append(a))
    for path in routes:
        headers = {**BROWSER, **({"Content-Type": content_type} if content_type else {})}
        status, head, body = raw_post(srv, path, json.dumps(BODIES.get(path, {})).encode(), headers)
        assert status == 415, (path, status, body)
        assert_openai_error(body)
        assert body["error"]["code"] == "unsupported_media_type" and body["error"]["param"] is None
        assert (content_type.split(";")[0] if content_type else "no Content-Type") in body["error"]["message"]
        assert not any(h.startswith("access-control-") for h in head), head
    assert processed == []  # nothing reached the engine
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", "application/vnd.openai+json"])
def test_json_content_types_are_served(srv, content_type):
    for path, request in BODIES.items():
        status, head, body = raw_post(srv, path, json.dumps(request).encode(), {"Content-Type": content_type})
        assert status == 200, body
        assert "access-control-allow-origin" not in head


def test_no_cors_preflight_is_answered_by_default(srv):
    for path in post_routes(srv.app) + ["/v1/models", "/health"]:
        req = urllib.request.Request(srv.url + path, method="OPTIONS", headers={
            "Origin": EVIL, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type", "Sec-Fetch-Mode": "cors"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, head = r.status, r.headers
        except urllib.error.HTTPError as e:
            status, head = e.code, e.headers
        assert status >= 400 and not any(h.lower().startswith("access-control-") for h in head), (path, status)
    with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/models", headers={"Origin": EVIL}),
                                timeout=30) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


def preflight(app, origin, method="POST", path="/v1/chat/completions") -> httpx.Response:
    return in_process(app, "OPTIONS", path, {"Origin": origin, "Access-Control-Request-Method": method,
                                             "Access-Control-Request-Headers": "authorization,content-type"})


def test_allowed_origins_get_preflights_and_cors_headers_others_do_not(srv):
    app = app_with(srv, api_key=API_KEY, allowed_origins=[GOOD, "http://localhost:3000"])
    for path in post_routes(app):
        r = preflight(app, GOOD, path=path)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
        assert "POST" in r.headers["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= set(r.headers["access-control-allow-headers"].lower().split(", "))
        bad = preflight(app, EVIL, path=path)
        assert bad.status_code >= 400 and "access-control-allow-origin" not in bad.headers
    assert preflight(app, GOOD, method="DELETE").status_code >= 400
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = in_process(app, "POST", "/v1/completions", {**auth, "Origin": GOOD}, json.dumps(COMPLETION).encode())
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    r = in_process(app, "POST", "/v1/completions", {**auth, "Origin": EVIL}, json.dumps(COMPLETION).encode())
    assert "access-control-allow-origin" not in r.headers
    # a page of an allowed origin may read its errors: 401 and 415 carry the header too
    r = in_process(app, "POST", "/v1/completions", {"Origin": GOOD, "Content-Type": "application/json"},
                   json.dumps(COMPLETION).encode())
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == GOOD
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = in_process(app, "POST", "/v1/completions", {**auth, "Content-Type": "text/plain", "Origin": GOOD},
                   json.dumps(COMPLETION).encode())
    assert r.status_code == 415 and r.headers["access-control-allow-origin"] == GOOD


def test_allowed_origins_star(srv):
    app = app_with(srv, allowed_origins="*")
    r = preflight(app, EVIL)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = in_process(app, "POST", "/v1/completions", {"Origin": EVIL, "Content-Type": "text/plain"},
                   json.dumps(COMPLETION).encode())
    assert r.status_code == 415  # even for any origin, a JSON body needs a JSON content type


@pytest.mark.parametrize("origins", [["https://app.example/"], ["app.example"], ["https://a.example", ""],
                                     ["https://a.example/path"]])
def test_an_allowed_origin_that_is_not_one_is_a_value_error(srv, origins):
    with pytest.raises(ValueError, match="allowed_origins"):
        app_with(srv, allowed_origins=origins)


def test_the_api_key_still_applies_with_a_json_content_type(srv):
    app = app_with(srv, api_key=API_KEY)
    body = json.dumps(COMPLETION).encode()
    assert in_process(app, "POST", "/v1/completions", {"Content-Type": "application/json"}, body).status_code == 401
    r = in_process(app, "POST", "/v1/completions", {"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {API_KEY}"}, body)
    assert r.status_code == 200 and r.json()["choices"]


def test_health_while_draining_says_shutting_down(srv):
    serving = srv.app.state.serving
    assert urllib.request.urlopen(srv.url + "/health", timeout=30).status == 200
    serving.draining = True
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/health", timeout=30)
        body = json.loads(e.value.read())
        assert e.value.code == 503 and body["error"]["code"] == "shutting_down"
        assert "shutting down" in body["error"]["message"]
    finally:
        serving.draining = False
    assert urllib.request.urlopen(srv.url + "/health", timeout=30).status == 200


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_body_announced_and_never_sent_logs_one_line_no_traceback(srv):
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "jpaged", "asyncio")]
    handler = Records()
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 20000000\r\n\r\n")
            time.sleep(0.3)  # the route is waiting for the body
        deadline = time.time() + 10
        while not handler.records and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # anything else it would log
        status, _, body = raw_post(srv, "/v1/completions", json.dumps(COMPLETION).encode(),
                                   {"Content-Type": "application/json"})
        assert status == 200 and body["choices"]  # still serving
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    lines = [handler.format(r) for r in handler.records]
    assert not [r for r in handler.records if r.exc_info], lines
    assert len(lines) <= 1 and not any("Traceback" in x or "ClientDisconnect" in x for x in lines), lines
    m = wait_all_blocks_free(srv)
    assert m["num_free_blocks"] == m["num_total_blocks"]


READY = re.compile(r"^jpaged: ready on http://127\.0\.0\.1:(\d+) \((\S+), (\d+) blocks of (\d+) tokens, "
                   r"max_model_len (\d+)\)$")


def test_the_ready_line_is_logged_once_health_answers(srv):
    """serve.py's server in this process, on port 0: one ready line naming the port it got, the
    model and the pool, logged when /health answers 200. (The SIGTERM test of test_server_limits.py
    reads it from a scripts/serve.py process.)"""
    from jpaged.entrypoints.server_app import draining_server

    handler = Records()
    logging.getLogger("jpaged").addHandler(handler)
    server = draining_server(app_with(srv), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not (ready := [m for r in handler.records if (m := READY.match("jpaged: " + r.getMessage()))]):
            assert time.time() < deadline and thread.is_alive(), [r.getMessage() for r in handler.records]
            time.sleep(0.01)
        port = ready[0].group(1)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
        assert ready[0].groups() == (port, MODEL, "128", str(srv.engine.engine.config.cache.block_size), "256")
    finally:
        logging.getLogger("jpaged").removeHandler(handler)
        server.force_exit = server.should_exit = True  # no drain: the module's engine serves on
        thread.join(30)
    assert len(ready) == 1


@pytest.mark.slow
def test_serve_prints_one_ready_line_when_health_answers(llama_dir):
    """scripts/serve.py as a process (precompile on, the server's default): the ready line names
    the port, the model and the pool, and /health answers 200 the moment it is printed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), f"--model={llama_dir[0]}",
                             f"--port={port}", "--served_model_name=tiny-ready", "--num_kv_blocks=48",
                             "--block_size=8", "--max_model_len=128", "--max_num_seqs=1", "--max_num_batched_tokens=16",
                             "--log_level=warning"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in proc.stderr] + [lines.put(None)],
                              daemon=True)
    reader.start()
    log, match = [], None
    try:
        deadline = time.time() + 240
        while match is None:
            line = lines.get(timeout=max(0.1, deadline - time.time()))
            assert line is not None, "\n".join(log[-40:])
            log.append(line)
            match = READY.match(line)
            assert match or not line.startswith("jpaged: ready"), line
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
        assert match.groups() == (str(port), "tiny-ready", "48", "8", "128")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            assert json.loads(r.read())["data"][0]["max_model_len"] == 128
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(10)
        while (line := lines.get_nowait()) is not None:
            log.append(line)
        assert sum(x.startswith("jpaged: ready") for x in log) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
