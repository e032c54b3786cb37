"""The randomized stateful test of test_reliability.py (add / step / abort / preempt / swap / fork
on tiny pools) with speculative decoding on (prompt lookup, a draft model, the target as its own
draft): the same invariants and no-cache greedy tokens, and after every operation no block past a
sequence's tokens and no prefix-cache entry that is not its tokens. Beam searches are refused
with speculation: the base machine's ``add`` checks that a refusal changes nothing."""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

import test_reliability as base
from jpaged.utils import cdiv


class SpecEngineMachine(base.EngineMachine):
    draft = base.tiny_model(num_layers=1, seed=4)  # a different model: proposals mostly rejected

    @initialize(num_blocks=st.integers(12, 40), mode=st.sampled_from(["recompute", "swap"]),
                prefix=st.booleans(), method=st.sampled_from(["ngram", "draft_model", "draft_self"]),
                k=st.integers(1, 4))
    def start(self, num_blocks, mode, prefix, method, k):
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
        if method != "ngram":
            spec = {"method": "draft_model", "num_speculative_tokens": k,
                    "model": self.model if method == "draft_self" else self.draft}
        self.llm = base.make_llm(self.model, num_kv_blocks=num_blocks, preemption_mode=mode, swap_space_bytes=1 << 20,
                                 enable_prefix_caching=prefix, max_model_len=64, max_num_batched_tokens=24,
                                 max_num_seqs=6, speculative_config=spec)
        self.engine = self.llm.llm_engine
        self.next_id = 0
        self.greedy = {}
        self.done = {}

    @invariant()
    def nothing_past_the_tokens(self):
        kv = self.engine.kv_cache
        for request in self.engine.requests.values():
            for seq in request.seqs:
                table = kv.block_table(seq)
                assert len(table) <= cdiv(seq.num_tokens, kv.block_size), "a rejected proposal's block was kept"
                for i, block_hash in enumerate(kv.block_hashes.get(seq.seq_id, [])):
                    key = kv.pool.block_key[table[i]]
                    if key is not None and key[0] == block_hash:
                        assert list(key[2]) == seq.token_ids[i * kv.block_size:(i + 1) * kv.block_size]


TestSpecEngineMachine = pytest.mark.slow(SpecEngineMachine.TestCase)  # minutes: in .ci/run's slow part
TestSpecEngineMachine.settings = settings(max_examples=3, stateful_step_count=20, deadline=None,
                                          suppress_health_check=list(HealthCheck))
