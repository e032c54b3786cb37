"""The gateway in front of engine replicas (`jpaged.serve`), in one process: routing on the
replicas' prefix-cache reports, the server's limits at the front, and replica faults.

Two real engines over the tiny random Llama (byte tokenizer, a chat template), each behind its own
OpenAI app (`EngineReplicaServer`), reached in-process (`LocalReplicaClient`); the gateway app runs
under uvicorn on 127.0.0.1. Ray is not needed here (tests/serve/test_serve_ray.py runs the same on Ray
Serve). Every wait is bounded.
"""
import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from jpaged.serve.asgi_call import BODY
from jpaged.serve.gateway import Gateway, ReplicaUnavailable, create_gateway_app, prompt_tokens
from jpaged.serve.replica import EngineReplicaServer, LocalReplicaClient
from jpaged.serve.routing import Router, prompt_block_hashes

uvicorn = pytest.importorskip("uvicorn")

API_KEY = "sk-gw"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BLOCK = 16


def options(model_dir, **server):
    return {"model": model_dir, "max_queued_requests": None, "served_model_name": "tiny", "api_key": API_KEY,
            "chat_template": CHAT_TEMPLATE, "max_request_body_bytes": 64 * 1024, "allowed_origins": [],
            "enable_weight_updates": False, "tool_call_parser": None, "reasoning_parser": None,
            "enable_auto_tool_choice": False, "lora_modules": [],
            "engine_kwargs": {"num_kv_blocks": 128, "block_size": BLOCK, "max_model_len": 512, "max_num_seqs": 8,
                              "precompile": False}, **server}


class FlakyClient(LocalReplicaClient):
    """A replica that can be made to die: before its answer begins, or after ``parts`` parts."""

    def __init__(self, name, server):
        super().__init__(name, server)
        self.die_before_start = False
        self.die_after_parts = None
        self.dead_reports = False

    async def stream(self, method, path, query, headers, body):
        if self.die_before_start:
            raise ReplicaUnavailable(f"{self.name} died")
        n = 0
        async for part in self.server.stream(method, path, query, headers, body):
            if self.die_after_parts is not None and n >= self.die_after_parts:
                raise ReplicaUnavailable(f"{self.name} died")
            n += 1
            yield part

    async def report(self):
        if self.dead_reports:
            raise ReplicaUnavailable(f"{self.name} is gone")
        return await super().report()


def start_server(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def http(url, method, path, body=None, key=API_KEY, headers=None, timeout=60):
    """(status, headers, body text)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


@pytest.fixture(scope="module")
def servers(llama_dir):
    built = [EngineReplicaServer(options(llama_dir[0])) for _ in range(2)]
    yield built
    for s in built:
        s.shutdown()


@pytest.fixture()
def front(servers):
    """A fresh gateway (prefix routing) over the two replicas; yields (gateway, clients, url)."""
    clients = [FlakyClient(f"replica-{i}", s) for i, s in enumerate(servers)]
    gateway = Gateway(clients, Router([c.name for c in clients], "prefix"), tokenizer=servers[0].engine.tokenizer,
                      chat_template=CHAT_TEMPLATE, max_body_bytes=64 * 1024, poll_interval=0.05, max_failed_polls=1)
    server, thread, url = start_server(create_gateway_app(gateway, api_key=API_KEY))
    assert asyncio.run(_wait(lambda: len(gateway.router.ready()) == 2, 30))
    yield gateway, clients, url
    server.should_exit = True
    thread.join(30)
    for s in servers:  # nothing leaks: every block of both pools is free after each test
        deadline = time.time() + 20
        while (m := s.engine.call(s.engine.engine.get_metrics).result(30))["num_free_blocks"] != \
                m["num_total_blocks"] and time.time() < deadline:
            time.sleep(0.05)
        assert m["num_free_blocks"] == m["num_total_blocks"]


async def _wait(cond, timeout):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def chat(url, messages, max_tokens=4, stream=False, **extra):
    return http(url, "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                                                     "temperature": 0, "stream": stream, **extra})


def counts_of(gateway) -> dict:
    """{(replica, outcome): requests} from the gateway's counter."""
    return {(s.labels["replica"], s.labels["outcome"]): s.value for m in gateway.requests.collect()
            for s in m.samples if s.name.endswith("_total")}


def routed_to(gateway) -> dict:
    """{replica: requests ended ok} from the gateway's counter."""
    return {s.labels["replica"]: s.value for m in gateway.requests.collect() for s in m.samples
            if s.name.endswith("_total") and s.labels["outcome"] == "ok"}


def test_prompt_block_hashes_are_the_prefix_cache_keys(front, servers):
    """The router's chain equals what the replica's prefix cache registered for the prompt,
    with and without a cache_salt (one process: one PYTHONHASHSEED)."""
    gateway, clients, url = front
    tokens = list(range(3, 3 + 5 * BLOCK + 3))
    for salt in (None, "tenant-a"):
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
        status, _, text = http(url, "POST", "/v1/completions", {**body, **({"cache_salt": salt} if salt else {})})
        assert status == 200, text
        keys = prompt_block_hashes(tokens, BLOCK, salt)
        assert len(keys) == 5
        reports = [asyncio.run(c.report()) for c in clients]
        assert any(set(keys) <= set(r["block_hashes"]) for r in reports)
    assert prompt_block_hashes(tokens, BLOCK, "a") != prompt_block_hashes(tokens, BLOCK, "b")


def test_unsalted_hash_chains_are_the_same_in_every_process():
    """The gateway's router and a replica (or a multi-host engine's hosts) run in different
    processes: an unsalted chain must not hash anything whose hash is an address (None, before
    Python 3.12); a salted one is the same under one PYTHONHASHSEED."""
    import os
    import subprocess
    import sys

    tokens = list(range(3, 3 + 3 * BLOCK + 1))
    code = (f"from jpaged.serve.routing import prompt_block_hashes; "
            f"print(prompt_block_hashes({tokens}, {BLOCK}), prompt_block_hashes({tokens}, {BLOCK}, 'a'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONHASHSEED": "7"}
    outputs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                              timeout=120).stdout for _ in range(2)}
    assert len(outputs) == 1
    assert outputs.pop().split("] [")[0] == str(prompt_block_hashes(tokens, BLOCK))[:-1]


def test_multi_turn_chat_stays_on_its_replica(front):
    """Each conversation's later turns go where its earlier ones are cached; a salted copy of the
    same conversation does not count the unsalted blocks as its own."""
    gateway, clients, url = front
    conversations = [[{"role": "user", "content": f"{i}" * 20 + ": tell me a long story " * 4}]
                     for i in range(4)]
    homes = {}
    for turn in range(3):
        for i, messages in enumerate(conversations):
            before = routed_to(gateway)
            status, _, text = chat(url, messages)
            assert status == 200, text
            after = routed_to(gateway)
            home = next(r for r in after if after[r] != before.get(r, 0))
            if turn == 0:
                homes[i] = home
            else:
                assert home == homes[i], (i, turn)
            messages += [{"role": "assistant", "content": json.loads(text)["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"and then? ({turn})"}]
        asyncio.run(gateway.poll_once())
    assert len(set(homes.values())) == 2  # the new conversations were spread by load
    # a salted request with a cached conversation's prompt matches nothing
    ids, salt = prompt_tokens("/v1/chat/completions", {"messages": conversations[0], "cache_salt": "x"},
                              gateway.tokenizer, CHAT_TEMPLATE)
    assert salt == "x" and ids
    assert gateway.router.choose(ids, "x")[1] == 0
    assert gateway.router.choose(ids, None)[1] > 0


def test_front_keeps_the_servers_limits(front):
    gateway, clients, url = front
    assert http(url, "POST", "/v1/completions", {"prompt": "hi"}, key=None)[0] == 401
    assert http(url, "POST", "/v1/completions", {"prompt": "hi"}, key="wrong")[0] == 401
    status, _, text = http(url, "POST", "/v1/completions", b"x" * (65 * 1024))
    assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"
    status, _, text = http(url, "POST", "/v1/completions", b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    assert status == 415
    status, _, text = http(url, "POST", "/v1/completions", {"prompt": "hi", "temperature": -1})
    assert status == 400 and json.loads(text)["error"]["param"] == "temperature"  # the replica's own check
    status, _, text = http(url, "POST", "/v1/completions", {"model": "other", "prompt": "hi"})
    assert status == 404
    status, _, text = http(url, "POST", "/pause", {})
    assert status == 501
    assert http(url, "GET", "/v1/models")[0] == 200
    assert http(url, "GET", "/health", key=None)[0] == 200


def test_a_request_whose_replica_dies_before_it_began_is_resent(front):
    gateway, clients, url = front
    before = counts_of(gateway)
    gateway.router.replicas["replica-1"].in_flight += 100  # so that the router tries replica-0 first
    clients[0].die_before_start = True
    status, _, text = http(url, "POST", "/v1/completions", {"prompt": "hello there", "max_tokens": 3, "temperature": 0})
    gateway.router.replicas["replica-1"].in_flight -= 100
    assert status == 200, text
    after = counts_of(gateway)
    assert after.get(("replica-0", "resent"), 0) - before.get(("replica-0", "resent"), 0) == 1
    assert after[("replica-1", "ok")] - before.get(("replica-1", "ok"), 0) == 1
    # a dead replica's failed report keeps it out; once it answers again it is back
    clients[0].die_before_start = False
    clients[0].dead_reports = True
    asyncio.run(gateway.poll_once())
    assert not gateway.router.replicas["replica-0"].ready
    clients[0].dead_reports = False
    assert asyncio.run(_wait(lambda: gateway.router.replicas["replica-0"].ready, 10))
    # none left: a 503 with an OpenAI body, never a hang
    clients[0].die_before_start = clients[1].die_before_start = True
    status, _, text = http(url, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert status == 503 and json.loads(text)["error"]["code"] == "no_replica"
    clients[0].die_before_start = clients[1].die_before_start = False


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done(front):
    gateway, clients, url = front
    for c in clients:
        c.die_after_parts = 3  # the start, then two chunks
    status, headers, text = http(url, "POST", "/v1/completions", {"prompt": "once upon a time", "max_tokens": 32,
                                                                  "temperature": 0, "stream": True,
                                                                  "ignore_eos": True})
    for c in clients:
        c.die_after_parts = None
    assert status == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"
    assert len(events) >= 3 and "choices" in json.loads(events[0])
    counts = counts_of(gateway)
    assert sum(v for (r, o), v in counts.items() if o == "error") == 1


def test_metrics_merge_the_replicas_and_name_the_gateway_protocol_series(front):
    gateway, clients, url = front
    status, _, text = http(url, "GET", "/metrics", key=None)
    assert status == 200
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["replica"] for s in families["jpaged:num_requests_waiting"].samples} == {"replica-0", "replica-1"}
    assert {s.labels["replica"] for s in families["jpaged:router_replica_ready"].samples} == {"replica-0", "replica-1"}
    assert "jpaged:router_requests" in families


def test_asgi_call_closes_like_a_disconnect(servers):
    """A caller that stops reading a stream aborts its request: the engine frees its blocks."""
    server = servers[0]

    async def leave_early():
        body = json.dumps({"prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
        parts = server.stream("POST", "/v1/completions", b"", [(b"content-type", b"application/json"),
                                                             (b"authorization", f"Bearer {API_KEY}".encode())], body)
        kinds = []
        async for part in parts:
            kinds.append(part[0])
            if kinds.count(BODY) == 2:
                break
        await parts.aclose()
        return kinds

    assert asyncio.run(leave_early())[0] == "start"
    deadline = time.time() + 20
    while server.engine.num_unfinished and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.num_unfinished == 0


def _report(hashes=(), running=0, waiting=0, usage=0.0):
    return {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage": usage,
            "block_size": BLOCK, "block_hashes": list(hashes)}


def test_router_policies():
    tokens = list(range(100, 100 + 4 * BLOCK + 1))
    keys = prompt_block_hashes(tokens, BLOCK)
    with pytest.raises(ValueError, match="routing"):
        Router(["a"], "random")
    router = Router(["a", "b", "c"], "prefix", max_imbalance=4)
    assert router.choose(tokens) == (None, 0)  # nothing reported yet
    router.replicas["a"].update(_report(keys[:1], running=1))
    router.replicas["b"].update(_report(keys[:3], running=2))
    router.replicas["c"].update(_report((), running=0))
    chosen, matched = router.choose(tokens)
    assert (chosen.name, matched) == ("b", 3)  # the longest cached prefix, although busier
    assert router.choose(tokens, exclude={"b"})[0].name == "a"
    assert router.choose(tokens, cache_salt="t")[0].name == "c"  # a salt matches none: least loaded
    assert router.choose(tokens)[0].name == "a"  # just sent all 4 blocks there: they count until a report
    hot = Router(["a", "b"], "prefix", max_imbalance=4)
    hot.replicas["a"].update(_report(keys, running=9))
    hot.replicas["b"].update(_report((), running=0))
    assert hot.choose(tokens)[0].name == "b"  # 9 > 0 + 4: the hot prefix does not pile on
    unknown = list(range(5000, 5000 + 3 * BLOCK))
    first = router.choose(unknown)[0]
    assert router.choose(unknown)[0] is first  # just routed: counts as cached there until reports say so
    least = Router(["a", "b"], "least_loaded")
    least.replicas["a"].update(_report(keys, running=3))
    least.replicas["b"].update(_report((), running=1))
    assert least.choose(tokens) == (least.replicas["b"], 0)
    turns = Router(["a", "b"], "round_robin")
    for name in ("a", "b"):
        turns.replicas[name].update(_report())
    assert [turns.choose(tokens)[0].name for _ in range(4)] == ["a", "b", "a", "b"]
