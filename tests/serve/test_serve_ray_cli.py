"""``jpaged-serve --distributed_executor ray`` as a user runs it: a local Ray, one replica of the tiny
random Llama, the ready line, an OpenAI request, SIGTERM: exit status 0 and no Ray process left.
Slow (Ray's start-up); every wait is bounded."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "serve.py")


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "raylet" in line or "gcs_server" in line]


def test_serve_cli_on_ray(llama_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = ray_processes()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--distributed_executor=ray", "--num_replicas=1",
                             "--num_cpus_per_replica=0.5", f"--model={llama_dir[0]}", "--noprecompile",
                             "--num_kv_blocks=128", "--max_model_len=256", "--api_key=sk-cli", f"--port={port}"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 420
        while "jpaged: ready on" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no ready line"
            time.sleep(1)
        assert f"ready on http://127.0.0.1:{port} ({llama_dir[0].rstrip('/')}, 1 Ray Serve replicas, routing prefix)" \
            in (tmp_path / "serve.log").read_text()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST", data=json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).encode(), headers={
            "Content-Type": "application/json", "Authorization": "Bearer sk-cli"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["finish_reason"] in ("length", "stop")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    deadline = time.monotonic() + 60
    while ray_processes() != before and time.monotonic() < deadline:
        time.sleep(1)
    assert ray_processes() == before
