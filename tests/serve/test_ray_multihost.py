"""One engine over two Ray actors (a placement group of two bundles, `jax.distributed` from the
placement, two CPU devices each): greedy tokens equal a single-process run. Ray's start-up and two
engine processes make this slow; `ray.shutdown()` stops every Ray process it started."""
import pytest

ray = pytest.importorskip("ray")

from jpaged import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_ray_hosts_serve_one_batch_as_one_process(llama_dir):
    from jpaged.serve.ray_multihost import MultiHostLLM

    prompts = [[5, 17, 42, 99, 7], [3] * 20, list(range(10, 50))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        multi = MultiHostLLM(llama_dir[0], num_hosts=2, local_devices=2, strategy="PACK", num_kv_blocks=256,
                             max_model_len=512)
        try:
            assert [p["devices"] for p in multi.placement] == [4, 4]
            assert sorted(p["process_index"] for p in multi.placement) == [0, 1]
            assert multi.placement[0]["mesh"] == {"data": 1, "model": 4} or 4 in multi.placement[0]["mesh"].values()
            tokens = [o[0][0] for o in multi.generate(prompts, params, timeout=300)]
        finally:
            multi.shutdown()
    finally:
        ray.shutdown()
    single = LLM(llama_dir[0], num_kv_blocks=256, max_model_len=512).generate(prompts, params, use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in single]
