"""`mirrored_engine`: a leader engine served by `AsyncLLMEngine` and a follower engine fed its calls
(through an in-memory channel, both in this process, one device each) end in the same state with
the same outputs: text and token-id prompts, ``n=2`` sampled without a seed, a stop string, a
request built by ``process`` (the server's path) with a cache salt, and one aborted by its reader."""
import os
import pickle
import queue
import threading
import time

import pytest

from jpaged import SamplingParams
from jpaged.config_resolution import engine_config
from jpaged.engine import create_engine
from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.serve.mirrored_engine import LeaderEngine, decode_calls, encode_call, follow

SETTINGS = dict(num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4, precompile=False)


class QueueChannel:
    """The call channel in one process (`call_channel`'s interface)."""

    def __init__(self):
        self.queue, self.sent = queue.Queue(), []

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)
        self.queue.put(payload)

    def receive(self, timeout_s: float):
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None


class RecordingEngine:
    """A follower's engine that keeps the last output of every request it stepped or aborted."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, {}

    def add_request(self, *args, **kwargs):
        return self.engine.add_request(*args, **kwargs)

    def abort_request(self, request_id):
        out = self.engine.abort_request(request_id)
        if out is not None:
            self.outputs[out.request_id] = out
        return out

    def step(self):
        outs = self.engine.step()
        self.outputs.update((o.request_id, o) for o in outs)
        return outs


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def choices(out):
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def engines(llama_dir):
    return [create_engine(engine_config(llama_dir[0], **SETTINGS)) for _ in range(2)]


def test_a_follower_fed_the_leaders_calls_ends_the_same(engines):
    leader_engine, follower_engine = engines
    channel = QueueChannel()
    leader = LeaderEngine(leader_engine, channel)
    follower = RecordingEngine(follower_engine)
    stop = threading.Event()
    steps = []
    thread = threading.Thread(target=lambda: steps.append(follow(follower, channel, stop, poll_s=0.1)), daemon=True)
    thread.start()
    async_engine = AsyncLLMEngine(leader)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        streams = [
            async_engine.add_request("text", "hello world", SamplingParams(temperature=0, max_tokens=20, stop=["o"])),
            async_engine.add_request("ids", [5, 17, 42, 99, 7] * 4, greedy),
            async_engine.add_request("sampled", [3] * 20, SamplingParams(temperature=1.0, n=2, max_tokens=10,
                                                                         ignore_eos=True)),
        ]
        processed = async_engine.process("salted", {"prompt_token_ids": list(range(10, 50))}, greedy,
                                         cache_salt="tenant-a")
        streams += async_engine.add_requests([processed])
        aborted = async_engine.add_request("aborted", [9] * 30, SamplingParams(temperature=0, max_tokens=200,
                                                                                ignore_eos=True))
        for _ in aborted:
            break  # the reader leaves after its first output: the request is aborted
        finals = {}
        for stream in streams:
            for out in stream:
                finals[out.request_id] = out
        wait_until(lambda: not async_engine.num_unfinished, 60, "the leader to finish")
        wait_until(lambda: not follower_engine.requests and "aborted" in follower.outputs, 60,
                   "the follower to follow (the abort is sent when the leader goes idle)")
        for rid, out in finals.items():
            assert out.finished and choices(follower.outputs[rid]) == choices(out), rid
        assert follower.outputs["aborted"].outputs[0].finish_reason == "abort"
        assert 0 < len(follower.outputs["aborted"].outputs[0].token_ids) < 200
        assert [c.text for c in finals["text"].outputs] == [c.text for c in follower.outputs["text"].outputs]
        assert leader_engine.kv_cache.pool.num_free_blocks == follower_engine.kv_cache.pool.num_free_blocks
        assert sorted(leader_engine.kv_cache.pool.cached) == sorted(follower_engine.kv_cache.pool.cached)
    finally:
        async_engine.shutdown()
        leader.close()
        thread.join(30)
        stop.set()
    sent_steps = sum(method == "step" for m in channel.sent for method, _, _ in decode_calls(m))
    assert steps == [sent_steps] and sent_steps > 10  # the leader's stop ended the loop, after every step


def test_what_an_engine_spanning_hosts_refuses(engines):
    leader = LeaderEngine(engines[0], QueueChannel())
    foreign = engines[0].process("foreign", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="built by its own process"):
        leader.add_request(foreign)
    assert "foreign" not in engines[0].requests
    for call in (lambda: leader.sleep(1), leader.wake_up, lambda: leader.update_weights("/some/checkpoint")):
        with pytest.raises(RuntimeError, match="not on an engine spanning hosts"):
            call()
    leader.close()
    with pytest.raises(RuntimeError, match="closed"):
        leader.step()


def test_messages_hold_only_parameters():
    params = SamplingParams(temperature=0.5, stop=["x"], structured_outputs={"choice": ["a", "b"]})
    message = pickle.dumps([encode_call("add_request", "r", "prompt", params, cache_salt="s")])
    [(method, args, kwargs)] = decode_calls(message)
    assert (method, args[:2], kwargs) == ("add_request", ("r", "prompt"), {"cache_salt": "s"})
    assert args[2] == params
    evil = pickle.dumps([pickle.dumps(("step", (os.getpid,), {}))])  # a callable: not a parameter
    with pytest.raises(pickle.UnpicklingError, match="may not hold posix.getpid"):
        decode_calls(evil)
