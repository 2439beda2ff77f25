"""Weight-only int8 split over two Ray ranks (each quantizes its own shard) gives TP=1 int8's greedy tokens."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import assert_all_blocks_free

PROMPTS = ["def __init__(self", "import os\n\ndef", "for i in range(", "class Parser:\n    def parse(self, text):"]


def test_int8_tp2_equals_tp1(ray_cluster):
    params = SamplingParams(temperature=0, max_tokens=24)
    one = LLM(quantization="int8", dtype="float32")
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        one.shutdown()
    two = LLM(quantization="int8", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params, use_tqdm=False)] == want
        assert_all_blocks_free(two)
    finally:
        two.shutdown()
