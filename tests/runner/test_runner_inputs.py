"""The runner's host side without a model: step buckets, the padded step arrays, and the scheduler
output they are built from being plain data."""
import dataclasses

import numpy as np

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.request import Request
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampleRow, ScheduledSeq, SchedulerOutput
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.inputs import prepare_inputs
from jpaged.sampling_params import SamplingParams


def test_bucket_shapes_follow_the_token_count():
    xla = StepBuckets(max_num_seqs=8, max_model_len=256, block_size=16, attention_backend="xla")
    assert xla.shape(1, 1, 1) == (2, 2, 16)
    assert xla.shape(21, 3, 2) == (24, 8, 16)
    assert xla.shape(33, 12, 1) == (48, 16, 16)  # forks can make more sequences than max_num_seqs
    pallas = dataclasses.replace(xla, attention_backend="pallas")
    assert pallas.shape(5, 3, 3) == (8, 8, 4) and pallas.shape(5, 3, 9) == (8, 8, 16)
    assert xla.token_buckets(64) == [2, 4, 8, 16, 24, 32, 48, 64]
    assert xla.row_buckets(16) == [2, 4, 8]  # at most max_num_seqs rows
    for t_pad in xla.token_buckets(256):
        assert all(xla.rows(r, t_pad) == r for r in xla.row_buckets(t_pad))  # a row bucket is its own bucket


def test_prepare_inputs_lays_sequences_end_to_end_and_pads():
    buckets = StepBuckets(max_num_seqs=4, max_model_len=64, block_size=4)
    out = SchedulerOutput(seqs=[ScheduledSeq("a", 0, [11, 12, 13], 0, [7]),        # a prompt chunk
                                ScheduledSeq("b", 1, [21], 5, [3, 9])],            # a decode row at 5
                          sample_rows=[SampleRow(0, 0), SampleRow(1, 0)])
    x = prepare_inputs(out, buckets)
    assert x.input_ids.tolist() == [11, 12, 13, 21]
    assert x.positions.tolist() == [0, 1, 2, 5]
    assert x.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1]
    assert x.query_start_loc.tolist() == [0, 3, 4, 4, 4] and x.num_seqs == 2
    assert x.seq_lens.tolist() == [3, 6, 0, 0]
    assert x.block_tables.shape == (4, 16) and x.block_tables[1, :2].tolist() == [3, 9]
    assert x.logits_indices.tolist() == [2, 3]
    out.seqs[0].token_ids.append(14)  # 5 tokens: padded to 8, padding writes nowhere
    x = prepare_inputs(out, buckets)
    assert x.input_ids.shape == (8,) and x.slot_mapping[5:].tolist() == [-1, -1, -1]
    assert x.logits_indices.tolist() == [3, 4]


def _plain(value) -> bool:
    """Only numbers, strings, lists/tuples/dicts of them, numpy arrays and plain dataclasses."""
    if value is None or isinstance(value, (bool, int, float, str, np.ndarray, np.generic)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_scheduler_output_is_plain_data():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv, max_model_len=64)
    sched.add_request(Request("r", None, [5, 6, 7, 8, 9], SamplingParams(n=2, temperature=0.5, logit_bias={3: 1.0},
                                                                         max_tokens=4)))
    out = sched.schedule()
    assert _plain(out)
    assert [r.sample_index for r in out.sample_rows] == [0, 1]  # n = 2: two rows on the prompt
    assert out.sampling.temperature == [0.5, 0.5] and out.sampling.bias == [[(3, 1.0)], [(3, 1.0)]]
