"""``jpaged-serve --distributed_executor jax`` as a LeaderWorkerSet's pods run it, on one machine: two
processes of two CPU devices each, told who they are by the LWS environment (``LWS_GROUP_SIZE``,
``LWS_WORKER_INDEX``; the coordinator's port is a free one here, not the pods' 8476). The leader's
greedy completion equals a single-process run; SIGTERM to the leader drains it and stops the
follower: both exit 0. Slow (two engine processes compiling); every wait is bounded."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from jpaged import LLM, SamplingParams

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "serve.py")
PROMPT = list(range(10, 50))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_lws_pods_serve_one_engine(llama_dir, tmp_path):
    port, coordinator_port = free_port(), free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, SCRIPT, "--distributed_executor=jax", f"--coordinator_address=127.0.0.1:{coordinator_port}",
            f"--model={llama_dir[0]}", "--noprecompile", "--num_kv_blocks=128", "--max_model_len=256",
            "--host=127.0.0.1", f"--port={port}", "--served_model_name=tiny"]
    logs = [tmp_path / f"pod{i}.log" for i in range(2)]
    pods = [subprocess.Popen(args, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT,
                             env={**env, "LWS_WORKER_INDEX": str(i)}) for i in range(2)]

    def log(i: int) -> str:
        return logs[i].read_text()[-3000:]

    try:
        deadline = time.monotonic() + 420
        while "jpaged: ready on" not in logs[0].read_text():
            assert all(p.poll() is None for p in pods), log(0) + log(1)
            assert time.monotonic() < deadline, "no ready line"
            time.sleep(1)
        assert f"ready on http://127.0.0.1:{port} (tiny," in logs[0].read_text()
        assert "follower 1 of 2: following the leader" in logs[1].read_text()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST", data=json.dumps(
            {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            served = json.loads(r.read())["choices"][0]["text"]
        pods[0].send_signal(signal.SIGTERM)
        assert pods[0].wait(120) == 0, log(0)
        assert pods[1].wait(120) == 0, log(1)
        assert "follower 1: stopped after" in logs[1].read_text()
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    single = LLM(llama_dir[0], num_kv_blocks=128, max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert served == single[0].outputs[0].text
