"""A Ray Serve replica whose engine spans two hosts (``build_app(num_hosts_per_replica=2)``): two
Ray actors with two CPU devices each (one 4-device mesh, gloo collectives), the first leading, the
other following its engine calls, behind the gateway on 127.0.0.1. Over real HTTP: greedy
completions equal a single-process run, a stream equals its non-streamed answer, a client that
disconnects mid-stream aborts its request on both hosts, and both hosts' schedulers end holding
the same; at the end the actors and their placement group are gone.

Slow (Ray, two engine processes compiling their steps); every wait is bounded; `ray.shutdown()`
stops every Ray process it started.
"""
import http.client
import json
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from test_serve_ray import API_KEY, free_port, options, request, wait_until  # noqa: E402

from jpaged import LLM, SamplingParams  # noqa: E402
from jpaged.serve.ray import build_app  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 99, 7], [3] * 20, list(range(10, 50))]


def host_states():
    handle = serve.get_deployment_handle("jpaged-replica-0", app_name="jpaged")
    return handle.engine_states.remote().result(timeout_s=60)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def stream_lines(port: int, body: dict, lines: int):
    """Opens a stream, reads ``lines`` of it, then closes the connection (the client leaves)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "Authorization": f"Bearer {API_KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    got = [response.fp.readline() for _ in range(lines)]
    conn.sock.close()
    conn.close()
    return got


def sse_text(text: str) -> tuple[str, list]:
    """(the streamed text, the finish reasons) of an SSE completion stream."""
    pieces, reasons = [], []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[len("data: "):])["choices"][0]
            pieces.append(choice["text"])
            reasons.append(choice["finish_reason"])
    return "".join(pieces), reasons


def test_a_replica_spanning_two_hosts_serves_http(llama_dir):
    model = llama_dir[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(options(model), num_replicas=1, num_hosts_per_replica=2, num_cpus=2,
                            placement_strategy="PACK", local_devices_per_host=2),
                  name="jpaged", route_prefix="/", blocking=False)
        wait_until(lambda: request(url, "GET", "/health", timeout=5)[0] == 200, 600, "the replica")
        states = host_states()
        assert [s["process_index"] for s in states] == [0, 1] and [s["devices"] for s in states] == [4, 4]
        assert states[0]["mesh"] == states[1]["mesh"] and 4 in states[0]["mesh"].values()

        status, _, text = request(url, "POST", "/v1/completions", {
            "prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert status == 200, text
        served = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
        status, _, text = request(url, "POST", "/v1/completions", {
            "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True})
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
        streamed, reasons = sse_text(text)
        assert streamed == served[2]["text"] and reasons[-1] == "length"

        stream_lines(port, {"prompt": [9] * 30, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                            "stream": True}, lines=4)
        deadline = time.monotonic() + 120
        while True:  # the abort reaches the leader, then (when it goes idle) the follower
            states = host_states()
            if all(not s["requests"] for s in states):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
        assert states[0]["num_free_blocks"] == states[1]["num_free_blocks"] == 256
        assert states[0]["cached"] == states[1]["cached"] and states[0]["cached"]
        assert all(s["following"] for s in states[1:])
        status, _, text = request(url, "GET", "/metrics", timeout=30)
        assert status == 200 and 'jpaged:router_replica_ready{replica="replica-0"} 1.0' in text

        serve.shutdown()
        wait_until(lambda: not any(process_alive(s["pid"]) for s in states), 60, "the host processes to end")
        wait_until(lambda: all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()), 60,
                   "the hosts' placement group to go")
    finally:
        serve.shutdown()
        ray.shutdown()
    single = LLM(model, num_kv_blocks=256, max_model_len=1024).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [c["text"] for c in served] == [o.outputs[0].text for o in single]
    assert all(c["finish_reason"] == "length" for c in served)
