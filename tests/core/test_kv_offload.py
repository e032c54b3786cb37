"""Prefix-cache tiers below the device pool (`jpaged.core.kv_offload`): the host and disk tiers on
their own (LRU, capacity, atomic files, bad files as misses, a full disk), and the engine through
them: greedy tokens equal transformers and tiers-off through eviction to host, to disk, a restart,
corrupt, truncated, unfinished and foreign files, for Llama, Mistral's sliding window and int8 pages;
the randomized stateful engine test with tiers on."""
import errno
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

import test_reliability as reliability
from conftest import assert_greedy_parity
from jpaged import LLM, SamplingParams
from jpaged.config import CacheConfig
from jpaged.core.kv_offload import BlockEntry, DiskTier, HostTier, KVOffload
from jpaged.core.kv_offload.disk_tier import TEMP_SUFFIX
from jpaged import testing

ENGINE = dict(block_size=8, num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=64)


def _entry(i: int, nbytes: int = 64) -> BlockEntry:
    return BlockEntry((i, None, (i,)), f"{i:032x}", (np.full(nbytes // 4, i, np.float32),))


# The tiers on their own ----------------------------------------------------------------------------------------
def test_host_tier_drops_least_recently_used_within_its_bytes():
    host = HostTier(3 * 64)
    for i in range(3):
        assert host.put(_entry(i)) == []
    assert host.get((0, None, (0,))) is not None  # 0 is now the most recent
    assert host.get((1, None, (9,))) is None      # same hash, other key: a miss
    dropped = host.put(_entry(3))
    assert [e.block_hash for e in dropped] == [1] and host.used_bytes == 3 * 64
    too_big = _entry(4, nbytes=4 * 64)
    assert host.put(too_big) == [too_big] and 4 not in host


def test_disk_tier_round_trip_lru_and_restart(tmp_path):
    disk = DiskTier(str(tmp_path), "ns", capacity_bytes=10_000)
    data = (np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(6, dtype=np.int8))
    size = disk.put("a" * 32, data)
    assert size > 0 and disk.put("a" * 32, data) == 0  # already there
    got = disk.get("a" * 32)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(got, data))
    small = DiskTier(str(tmp_path), "ns", capacity_bytes=2 * size)  # a restart: the file is found again
    assert "a" * 32 in small
    small.put("b" * 32, data)
    small.put("c" * 32, data)  # over capacity: the least recently used ("a") goes
    assert "a" * 32 not in small and not os.path.exists(small._path("a" * 32))
    assert small.used_bytes <= 2 * size


def test_bad_files_are_misses_never_hits(tmp_path):
    data = (np.arange(16, dtype=np.float32),)
    disk = DiskTier(str(tmp_path), "ns", capacity_bytes=1 << 20)
    for name in ("corrupt", "truncated", "foreign"):
        disk.put(name.ljust(32, "0"), data)
    with open(disk._path("corrupt".ljust(32, "0")), "r+b") as f:
        f.seek(-40, os.SEEK_END)
        f.write(b"\xff\xfe")
    with open(disk._path("truncated".ljust(32, "0")), "r+b") as f:
        f.truncate(30)
    other = DiskTier(str(tmp_path), "other", capacity_bytes=1 << 20)
    other.put("x" * 32, data)
    os.replace(other._path("x" * 32), disk._path("foreign".ljust(32, "0")))  # another model's file
    unfinished = disk._path("y" * 32) + f".123{TEMP_SUFFIX}"  # a process killed while writing
    with open(unfinished, "wb") as f:
        f.write(b"JPAGEDKV1\n half")
    restarted = DiskTier(str(tmp_path), "ns", capacity_bytes=1 << 20)
    assert not os.path.exists(unfinished)
    for name in ("corrupt", "truncated", "foreign"):
        assert restarted.get(name.ljust(32, "0")) is None
        assert name.ljust(32, "0") not in restarted  # dropped: the next lookup misses at once


def test_a_full_disk_is_a_logged_miss(tmp_path, monkeypatch, jpaged_caplog):
    disk = DiskTier(str(tmp_path), "ns", capacity_bytes=1 << 20)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", no_space)
    assert disk.put("z" * 32, (np.zeros(4, np.float32),)) == 0
    monkeypatch.undo()
    assert "z" * 32 not in disk and not os.listdir(disk.directory)
    assert "No space left" in jpaged_caplog.text
    assert DiskTier(str(tmp_path), "ns", capacity_bytes=10).put("w" * 32, (np.zeros(64, np.float32),)) == 0


def test_stable_ids_follow_the_chain_not_the_process_hash():
    a, b = KVOffload(host_bytes=1 << 10), KVOffload(host_bytes=1 << 10)
    a.name_root(None, (None, 0))
    b.name_root(None, (None, 0))
    first_a, first_b = (111, None, (1, 2)), (222, None, (1, 2))  # other process hashes, same tokens
    assert a.stable_id(first_a) == b.stable_id(first_b)
    assert a.stable_id((333, 111, (3, 4))) == b.stable_id((444, 222, (3, 4)))
    assert a.stable_id((555, 111, (3, 5))) != a.stable_id((333, 111, (3, 4)))
    assert a.stable_id((666, 999, (3, 4))) is None  # unknown parent: host tier only


@pytest.mark.parametrize("value, field", [
    ({"host_bytes": -1}, "kv_offload.host_bytes"), ({"host_bytes": 1, "disk_bytes": 5}, "kv_offload.disk_bytes"),
    ({"disk_path": "/tmp/x"}, "kv_offload.disk_bytes"), ({"hots_bytes": 1}, "hots_bytes"), ("{oops", "not JSON"),
    (7, "kv_offload=7")])
def test_bad_settings_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        CacheConfig(kv_offload=value)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(kv_offload={"host_bytes": 1 << 20}, enable_prefix_caching=False)
    assert CacheConfig(kv_offload='{"host_bytes": 1024}').kv_offload.host_bytes == 1024


# The engine through the tiers ----------------------------------------------------------------------------------
def _workload(seed=0):
    """Three prompts on a shared 40-token prefix, then three others that push them out of a 24-block
    pool, then the first three again."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 256, 40).tolist()
    first = [shared + rng.integers(3, 256, n).tolist() for n in (9, 17, 3)]
    other = [rng.integers(3, 256, 60).tolist() for _ in range(3)]
    return first, other


def _run(llm, name, hf_model, prompts_a, prompts_b):
    """Greedy parity (and no leak) for A, B, A; the metrics after."""
    for prompts in (prompts_a, prompts_b, prompts_a):
        metrics = assert_greedy_parity(name, hf_model, llm, prompts, max_tokens=8)
    testing.block_pool(llm).check_invariants()
    return metrics


def test_in_memory_model_through_host_disk_restart_and_bad_files(tmp_path):
    """A tiny in-memory Llama (no torch): tokens equal a no-cache forward and tiers-off, through the
    host tier, the disk tier, a restart, and a restart after every file was damaged."""
    model = reliability.tiny_model(vocab_size=64, num_layers=2, seed=5)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 64, 24).tolist()
    a = [shared + rng.integers(3, 64, n).tolist() for n in (5, 11)]
    b = [rng.integers(3, 64, 36).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [reliability.greedy_reference(model, p, 6) for p in a]

    def run(llm, batches):
        got = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in batches]
        reliability.assert_clean(llm)
        return got, llm.get_metrics()

    settings_ = dict(num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=32)
    off, _ = run(reliability.make_llm(model, **settings_), [a, b, a])
    assert off[0] == off[2] == expected
    tiers = {"host_bytes": 4 * 1024, "disk_path": str(tmp_path), "disk_bytes": 1 << 24}  # host: 4 blocks
    on, m = run(reliability.make_llm(model, **settings_, kv_offload=tiers), [a, b, a])
    assert on == off and m["kv_offload_host_hits"] > 0 and m["kv_offload_disk_hits"] > 0
    warm, m = run(reliability.make_llm(model, **settings_, kv_offload=tiers), [a])
    assert warm[0] == expected and m["kv_offload_disk_hits"] >= 24 and m["prefix_cache_hits"] >= 48
    (directory,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 1)
    cold, m = run(reliability.make_llm(model, **settings_, kv_offload=tiers), [a])
    assert cold[0] == expected and m["kv_offload_disk_hits"] == 0


def test_serving_through_the_tiers_compiles_nothing_after_warm_up(tmp_path):
    """With ``precompile``, warm-up compiles the tiers' gather and scatter for every padded count:
    stores and loads of any number of blocks (chunked past `MAX_TRANSFER_BLOCKS`) then compile nothing."""
    from jpaged.runner import kv_pool

    assert kv_pool.transfer_buckets(20) == [4, 8, 16, 32] and kv_pool.transfer_buckets(3) == [4]
    assert kv_pool.transfer_buckets(10_000)[-1] == kv_pool.MAX_TRANSFER_BLOCKS
    model = reliability.tiny_model(vocab_size=64, num_layers=2, seed=7)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 64, 24).tolist()
    a = [shared + rng.integers(3, 64, n).tolist() for n in (5, 11, 2)]
    b = [rng.integers(3, 64, 36).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tiers = {"host_bytes": 4 * 1024, "disk_path": str(tmp_path), "disk_bytes": 1 << 24}
    llm = reliability.make_llm(model, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=32,
                               precompile=True, kv_offload=tiers)
    compiled = llm.get_metrics()["num_compilations"]
    names = {signature[0] for signature in llm.llm_engine.runner.counter.signatures}
    assert {"tier_gather", "tier_scatter"} <= names
    for prompts in (a, b, a, b[:1], a[:1]):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reliability.greedy_reference(model, p, 6) for p in prompts]
    m = llm.get_metrics()
    assert m["kv_offload_host_hits"] + m["kv_offload_disk_hits"] > 0 and m["kv_offload_host_stored_bytes"] > 0
    assert m["num_compilations"] == compiled
    reliability.assert_clean(llm)


@pytest.mark.slow
def test_a_draft_model_pool_goes_through_the_tiers_too(tmp_path):
    """speculative_config with a draft model: a tier entry carries the draft's pages too, so after
    eviction, disk hits and a restart the target as its own draft still accepts every proposal (a
    draft reading stale pages for the loaded blocks would not), and the tokens are the reference."""
    model = reliability.tiny_model(vocab_size=64, num_layers=2, seed=9)
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 64, 24).tolist()
    a = [shared + rng.integers(3, 64, n).tolist() for n in (5, 11)]
    b = [rng.integers(3, 64, 36).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = {tuple(p): reliability.greedy_reference(model, p, 6) for p in a + b}
    tiers = {"host_bytes": 8 * 1024, "disk_path": str(tmp_path), "disk_bytes": 1 << 24}
    settings_ = dict(num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=32, precompile=True,
                     speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2})
    for batches in ([a, b, a], [a]):  # the second engine starts on the first one's files
        llm = reliability.make_llm(model, **settings_, kv_offload=tiers)
        compiled = llm.get_metrics()["num_compilations"]
        for prompts in batches:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
        m = llm.get_metrics()
        assert m["kv_offload_host_hits"] + m["kv_offload_disk_hits"] > 0
        assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] == 1.0
        assert m["num_compilations"] == compiled
        reliability.assert_clean(llm)
    assert m["kv_offload_disk_hits"] > 0


def test_block_moves_past_one_chunk_keep_every_block(monkeypatch):
    """A move of more blocks than one call takes goes in several calls and loses none."""
    from jpaged.runner import kv_pool

    monkeypatch.setattr(kv_pool, "MAX_TRANSFER_BLOCKS", 4)
    model = reliability.tiny_model(vocab_size=64, num_layers=1, seed=8)
    llm = reliability.make_llm(model, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=32)
    pool = llm.llm_engine.runner.kv_pool
    rng = np.random.default_rng(4)
    blocks = list(range(1, 11))
    data = [tuple(rng.standard_normal(a.shape).astype(a.dtype) for a in arrays)
            for arrays in pool.read_blocks(blocks)()]
    pool.write_blocks(list(zip(blocks, data)))
    back = pool.read_blocks(blocks)()
    assert all(np.array_equal(x, y) for got, want in zip(back, data) for x, y in zip(got, want))
    assert len(back) == 10


def test_a_step_whose_loads_fail_leaves_no_wrong_hit(tmp_path, monkeypatch):
    """The step carrying tier loads fails before writing them: its requests end with an error, the
    blocks registered for the loads are forgotten, and the same prompts then give the right tokens."""
    model = reliability.tiny_model(vocab_size=64, num_layers=1, seed=6)
    rng = np.random.default_rng(1)
    a = [rng.integers(3, 64, 30).tolist()]
    b = [rng.integers(3, 64, 36).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = reliability.make_llm(model, num_kv_blocks=14, max_model_len=64, max_num_batched_tokens=32,
                               kv_offload={"host_bytes": 1 << 20})
    for prompts in (a, b):
        llm.generate(prompts, params, use_tqdm=False)
    pool = testing.device_kv(llm)

    def failing_write(loads):
        raise RuntimeError("injected load failure")

    monkeypatch.setattr(pool, "write_blocks", failing_write)
    (failed,) = llm.generate(a, params, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and "injected load failure" in failed.outputs[0].stop_reason
    reliability.assert_clean(llm)
    monkeypatch.undo()
    (again,) = llm.generate(a, params, use_tqdm=False)
    assert again.outputs[0].token_ids == reliability.greedy_reference(model, a[0], 5)
    assert llm.get_metrics()["kv_offload_host_hits"] > 0
    reliability.assert_clean(llm)


@pytest.mark.slow
def test_llama_through_host_and_disk_and_a_restart(llama_dir, tmp_path):
    path, hf_model = llama_dir
    a, b = _workload()
    off = _run(LLM(path, **ENGINE), "llama", hf_model, a, b)
    disk = str(tmp_path / "tiers")
    host = _run(LLM(path, **ENGINE, kv_offload={"host_bytes": 1 << 24}), "llama", hf_model, a, b)
    assert host["kv_offload_host_hits"] > 0 and host["prefix_cache_hits"] >= off["prefix_cache_hits"] + 40
    small = {"host_bytes": 8 << 10, "disk_path": disk, "disk_bytes": 1 << 26}  # host holds 2 blocks
    both = _run(LLM(path, **ENGINE, kv_offload=small), "llama", hf_model, a, b)
    assert both["kv_offload_disk_hits"] > 0 and both["kv_offload_disk_stored_bytes"] > 0
    restarted = LLM(path, **ENGINE, kv_offload=small)  # a new engine on the same files: warm at once
    m = assert_greedy_parity("llama", hf_model, restarted, a, max_tokens=8)
    assert m["kv_offload_disk_hits"] > 0 and m["prefix_cache_hits"] >= 32


@pytest.mark.slow
def test_corrupt_truncated_unfinished_files_and_another_model(llama_dir, tied_llama_dir, tmp_path):
    path, hf_model = llama_dir
    a, b = _workload(1)
    tiers = {"host_bytes": 0, "disk_path": str(tmp_path), "disk_bytes": 1 << 26}
    _run(LLM(path, **ENGINE, kv_offload=tiers), "llama", hf_model, a, b)
    (directory,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    files = sorted(os.listdir(directory))
    assert len(files) >= 6
    for i, name in enumerate(files):  # every file damaged one way or another
        with open(os.path.join(directory, name), "r+b") as f:
            if i % 2:
                f.truncate(os.path.getsize(f.name) // 2)
            else:
                f.seek(100)
                f.write(b"\x00\x01\x02\x03")
    open(os.path.join(directory, files[0] + ".9" + TEMP_SUFFIX), "wb").close()
    m = assert_greedy_parity("llama", hf_model, LLM(path, **ENGINE, kv_offload=tiers), a, max_tokens=8)
    assert m["kv_offload_disk_hits"] == 0 and not any(f.endswith(TEMP_SUFFIX) for f in os.listdir(directory))
    tied_path, tied_hf = tied_llama_dir  # another model: its own namespace, never these files
    m = assert_greedy_parity("tied", tied_hf, LLM(tied_path, **ENGINE, kv_offload=tiers), a, max_tokens=8)
    assert m["kv_offload_disk_hits"] == 0 and len(os.listdir(tmp_path)) == 2


@pytest.mark.slow
def test_mistral_sliding_window_through_the_tiers(tmp_path_factory, tmp_path):
    from test_model_families import family

    path, hf_model = family(tmp_path_factory, "mistral")
    a, b = _workload(2)
    tiers = {"host_bytes": 16 << 10, "disk_path": str(tmp_path), "disk_bytes": 1 << 26}
    m = _run(LLM(path, **ENGINE, kv_offload=tiers), "mistral", hf_model, a, b)
    assert m["kv_offload_host_hits"] + m["kv_offload_disk_hits"] > 0
    m = assert_greedy_parity("mistral", hf_model, LLM(path, **ENGINE, kv_offload=tiers), a, max_tokens=8)
    assert m["kv_offload_disk_hits"] > 0


@pytest.mark.slow
def test_int8_pages_and_scales_through_the_tiers(llama_dir, tmp_path):
    path = llama_dir[0]
    a, b = _workload(3)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)

    def tokens(llm):
        return [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in (a, b, a)]

    settings_ = dict(ENGINE, kv_cache_dtype="int8")
    reference = tokens(LLM(path, **settings_))
    tiers = {"host_bytes": 4 << 10, "disk_path": str(tmp_path), "disk_bytes": 1 << 26}
    llm = LLM(path, **settings_, kv_offload=tiers)
    assert tokens(llm) == reference
    m = llm.get_metrics()
    assert m["kv_offload_disk_hits"] > 0 and m["num_free_blocks"] == m["num_total_blocks"]
    restarted = LLM(path, **settings_, kv_offload=tiers)
    assert [o.outputs[0].token_ids for o in restarted.generate(a, params, use_tqdm=False)] == reference[0]
    assert restarted.get_metrics()["kv_offload_disk_hits"] > 0


# The randomized stateful engine test, tiers on -----------------------------------------------------------------
class TieredEngineMachine(reliability.EngineMachine):
    """`EngineMachine`'s add / step / abort with a host tier of a few blocks over a disk tier: the
    same invariants, every block back after the drain, greedy tokens equal a no-cache forward."""

    @initialize(num_blocks=st.integers(12, 40), mode=st.sampled_from(["recompute", "swap"]),
                host_blocks=st.integers(0, 8))
    def start(self, num_blocks, mode, host_blocks):
        import tempfile

        self.disk = tempfile.mkdtemp(prefix="jpaged-tiers-")
        per_block = 2 * 4 * 2 * 8 * 4  # K and V x block of 4 tokens x 2 KV heads x head dim 8 x float32
        self.llm = reliability.make_llm(self.model, num_kv_blocks=num_blocks, preemption_mode=mode,
                                        swap_space_bytes=1 << 20, max_model_len=64, max_num_batched_tokens=24,
                                        max_num_seqs=6, kv_offload={"host_bytes": host_blocks * per_block,
                                                                    "disk_path": self.disk, "disk_bytes": 1 << 22})
        self.engine = self.llm.llm_engine
        self.next_id = 0
        self.greedy = {}
        self.done = {}

    def teardown(self):
        import shutil

        try:
            super().teardown()
        finally:
            shutil.rmtree(self.disk, ignore_errors=True)


TestTieredEngineMachine = pytest.mark.slow(TieredEngineMachine.TestCase)  # ~20 s: with the slow part
TestTieredEngineMachine.settings = settings(max_examples=3, stateful_step_count=20, deadline=None,
                                            suppress_health_check=list(HealthCheck))


def test_tier_metrics_on_the_prometheus_page():
    from prometheus_client import CollectorRegistry, generate_latest

    from jpaged.entrypoints.metrics import _EngineCollector

    offload = KVOffload(host_bytes=1 << 10)
    offload.store([(7, None, (1, 2))], [(np.zeros(8, np.float32),)])
    collector = _EngineCollector({"model_name": "m"})
    collector.snapshot = offload.metrics()
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'jpaged:kv_offload_host_used_bytes{model_name="m"} 32.0' in text
    assert 'jpaged:kv_offload_disk_hits_total{model_name="m"} 0.0' in text
