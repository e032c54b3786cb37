"""Two processes on loopback, one global mesh: the batch's tokens equal a single-process run."""
import json
import os
import subprocess
import sys

import pytest

from jpaged import LLM, SamplingParams

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "multihost_generate.py")


@pytest.mark.slow
def test_two_processes_serve_one_batch(llama_dir, tmp_path):
    out = tmp_path / "tokens.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, SCRIPT, f"--model={llama_dir[0]}", "--num_processes=2", "--local_devices=2",
                    "--coordinator=127.0.0.1:12391", f"--output_json={out}", "--max_tokens=10"],
                   env=env, check=True, timeout=240)
    multi = json.loads(out.read_text())
    llm = LLM(llama_dir[0], num_kv_blocks=256, max_model_len=512)
    prompts = [[5, 17, 42, 99, 7], [3] * 20, list(range(10, 50))]
    single = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert multi == [o.outputs[0].token_ids for o in single]
