"""The Ray Serve application (`jpaged.serve.ray`) on a local Ray cluster: two engine replicas of
the tiny random Llama behind the gateway, over HTTP on 127.0.0.1; then one replica's process is
killed while it streams.

One Ray cluster and one application per module (Ray's start-up is slow); `ray.shutdown()` at the
end stops every Ray process it started. Every wait is bounded in time.
"""
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jpaged.serve.gateway import REPLICA_HEADER  # noqa: E402
from jpaged.serve.ray import build_app  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "sk-ray"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def options(model_dir):
    return {"model": model_dir, "max_queued_requests": None, "served_model_name": "tiny", "api_key": API_KEY,
            "chat_template": CHAT_TEMPLATE, "max_request_body_bytes": 64 * 1024, "allowed_origins": [],
            "enable_weight_updates": False, "tool_call_parser": None, "reasoning_parser": None,
            "enable_auto_tool_choice": False, "lora_modules": [],
            "engine_kwargs": {"num_kv_blocks": 256, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 8,
                              "precompile": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url, method, path, body=None, timeout=120):
    """(status, headers, text) of a whole response."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def metrics(url) -> dict:
    _, _, text = request(url, "GET", "/metrics", timeout=30)
    return {f.name: f for f in text_string_to_metric_families(text)}


def replica_pid(i: int) -> int:
    handle = serve.get_deployment_handle(f"jpaged-replica-{i}", app_name="jpaged")
    return handle.pid.remote().result(timeout_s=60)


@pytest.fixture(scope="module")
def cluster(llama_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(options(llama_dir[0]), num_replicas=2, routing="least_loaded", num_cpus=0.5,
                            poll_interval=0.25, health_check_period_s=1.0),
                  name="jpaged", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: request(url, "GET", "/health", timeout=5)[0] == 200, 300, "the app's /health")
        wait_until(lambda: all(s.value == 1 for s in metrics(url)["jpaged:router_replica_ready"].samples)
                   and len(metrics(url)["jpaged:router_replica_ready"].samples) == 2, 300, "both replicas")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_openai_routes_through_ray_serve(cluster):
    status, headers, text = request(cluster, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"
    assert headers[REPLICA_HEADER] in ("replica-0", "replica-1")
    assert request(cluster, "GET", "/v1/models")[0] == 200
    assert request(cluster, "POST", "/v1/completions", {"prompt": "hi", "temperature": -1})[0] == 400
    req = urllib.request.Request(cluster + "/v1/models")  # no key
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def stream_completion(url, prompt, max_tokens, result: dict, timeout=120):
    """Reads one streamed completion into ``result``: replica, events, when it ended."""
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}, data=json.dumps({
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            result["replica"] = r.headers[REPLICA_HEADER]
            result["events"] = []
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    result["events"].append(line[len("data: "):])
    except Exception as e:  # noqa: BLE001 -- recorded, the test reports it
        result["exception"] = repr(e)
    result["ended"] = time.monotonic()


def test_killing_a_replica_mid_stream(cluster):
    """Replica 0's process is killed while both replicas stream: its streams in flight end with an
    error event and [DONE] within seconds (one that finished first ends as usual), replica 1's
    complete, requests sent after the kill are served, Ray restarts replica 0 and it rejoins
    routing; /metrics counts what the clients saw."""
    before = metrics(cluster)["jpaged:router_requests"]
    before = {(s.labels["replica"], s.labels["outcome"]): s.value for s in before.samples
              if s.name.endswith("_total")}
    pid = replica_pid(0)
    results = [{} for _ in range(6)]
    threads = [threading.Thread(target=stream_completion, args=(cluster, f"stream {i} " * 3, 600, results[i]))
               for i in range(len(results))]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(r.get("events", ())) >= 2 or "ended" in r for r in results), 120, "streams to start")
    assert {r.get("replica") for r in results} == {"replica-0", "replica-1"}
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    late = [request(cluster, "POST", "/v1/completions", {"prompt": f"after {i}", "max_tokens": 4,
                                                         "temperature": 0}, timeout=120) for i in range(3)]
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    for r in results:
        assert "exception" not in r, r
        events = r["events"]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if r["replica"] == "replica-0" and r["ended"] > killed:  # in flight when its replica died
            assert last.get("error", {}).get("code") == "replica_failed", last
            assert r["ended"] - killed < 15
        else:  # replica 1's, or one of replica 0's that finished before the kill
            assert last["choices"][0]["finish_reason"] == "length", last
    for status, headers, text in late:
        assert status == 200, text
    # Ray restarts replica 0; it rejoins routing once its engine reports
    wait_until(lambda: replica_pid(0) != pid, 180, "replica 0's restart")
    wait_until(lambda: {s.labels["replica"]: s.value for s in metrics(cluster)["jpaged:router_replica_ready"].samples}
               == {"replica-0": 1.0, "replica-1": 1.0}, 180, "replica 0 back in routing")
    after = {(s.labels["replica"], s.labels["outcome"]): s.value for s in
             metrics(cluster)["jpaged:router_requests"].samples if s.name.endswith("_total")}

    def delta(replica, outcome):
        return after.get((replica, outcome), 0) - before.get((replica, outcome), 0)

    errors = sum(1 for r in results if r["replica"] == "replica-0" and r["ended"] > killed)
    assert errors >= 1, "no stream of replica 0 was in flight at the kill"
    assert delta("replica-0", "error") == errors
    assert delta("replica-1", "ok") >= len(results) - errors
    assert delta("replica-0", "ok") + delta("replica-1", "ok") == len(results) - errors + len(late)
