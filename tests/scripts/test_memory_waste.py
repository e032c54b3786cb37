"""scripts/memory_waste.py: slot accounting on a hand-made trace, and the script end to end."""
import os
import sys

import pytest

from run_script import SCRIPTS, run_script

sys.path.insert(0, SCRIPTS)
import memory_waste as mw  # noqa: E402

sys.path.remove(SCRIPTS)


def trace():
    """Three requests, (prompt, output): lengths chosen so block rounding is visible with bs 4."""
    return [[5] * 6, [6] * 3, [7] * 10], [10, 5, 2]


def test_every_slot_is_classified_and_everything_drains():
    prompts, outs = trace()
    token_share = {}
    for allocator in mw.ALLOCATORS:
        r = mw.simulate(allocator, prompts, outs, num_kv_blocks=12, block_size=4, max_model_len=16,
                        max_num_seqs=2, max_num_batched_tokens=64)  # checks the pool drains
        slots = r["slots"]
        steps_loaded = sum(slots.values()) // (12 * 4)
        assert steps_loaded >= 1 and sum(slots.values()) == steps_loaded * 12 * 4  # whole pool each step
        assert r["preemptions"] == 0 and min(slots.values()) >= 0
        assert sum(mw.shares(slots).values()) == pytest.approx(1.0)
        token_share[allocator] = mw.shares(slots)["tokens"]
        if allocator == "paged":
            assert slots["external"] == 0
    assert token_share["paged"] > token_share["oracle"] >= token_share["pow2"] >= token_share["max"]


def test_hand_made_trace_numbers():
    """max_num_seqs=1, so request 1 waits while request 0 runs: exact accounting per step."""
    prompts, outs = [[5] * 6, [6] * 3], [3, 2]
    kw = dict(num_kv_blocks=6, block_size=4, max_model_len=16, max_num_seqs=1, max_num_batched_tokens=64)
    # Request 0: prompt 6, output 3, final length 9. It runs 3 steps (prefill, 2 decodes) while
    # request 1 waits: after them it has 6 and 7 tokens computed, then it finishes, and the whole
    # pool (24 slots) is free but request 1 is not admitted until the next step.
    # oracle: 9 tokens -> 3 blocks (12 slots); free 3 blocks in one hole; request 1 needs
    # 3 + 2 = 5 -> 2 blocks, which fit: no external fragmentation.
    r = mw.simulate("oracle", prompts, outs, **kw)
    assert r["slots"] == {"tokens": 6 + 7, "reserved": 3 + 2, "internal": 3 + 3, "free": 12 + 12 + 24}
    # max: 16 tokens -> 4 blocks each; 2 blocks left are a hole too small for request 1's 4.
    r = mw.simulate("max", prompts, outs, **kw)
    assert r["slots"] == {"tokens": 6 + 7, "reserved": 3 + 2, "internal": 7 + 7, "external": 8 + 8, "free": 24}
    # paged: blocks as tokens arrive: 2 blocks (8 slots) after 6 and after 7 tokens.
    r = mw.simulate("paged", prompts, outs, **kw)
    assert r["slots"] == {"tokens": 6 + 7, "reserved": 2 + 1, "free": 16 + 16 + 24}
    shares = mw.shares(r["slots"])
    assert shares["tokens"] == pytest.approx(13 / 16) and shares["external"] == 0


def test_script_runs_on_a_small_trace(tmp_path):
    result = run_script("memory_waste.py", "--num_requests", "40", "--num_kv_blocks", "256", "--out_dir", str(tmp_path),
                        timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for workload in ("sharegpt-like", "alpaca-like"):
        assert f"{workload}: 40 requests" in result.stdout
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()
             if line.split() and line.split()[0] in mw.ALLOCATORS}
    assert set(lines) == set(mw.ALLOCATORS)
    assert os.path.getsize(tmp_path / "memory_waste.png") > 1000
