"""The engine with attention_backend="pallas" (interpret mode on CPU) gives the xla backend's tokens."""
import numpy as np

from conftest import random_prompts
from jpaged import LLM, SamplingParams


def test_pallas_backend_matches_xla(llama_dir):
    prompts = random_prompts(np.random.default_rng(0), [1, 20, 37, 5])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(llama_dir[0], attention_backend=backend, num_kv_blocks=24, max_model_len=128, block_size=8,
                  max_num_batched_tokens=32)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_metrics()["attention_backend"] == backend
    assert tokens["xla"] == tokens["pallas"]
