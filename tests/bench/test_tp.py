"""`kiln bench tp`'s measurement: decode tokens/s over the steps after the first token, and the
all-reduce count and time per step (none in a one-process engine; the TP run itself needs 2 ranks,
see tests/distributed)."""

from engine.toy_model import toy_loaded  # tests/engine/toy_model.py

from kiln.bench.tp import decode_rate
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine


def test_decode_rate_counts_the_steps_after_the_first_token():
    engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=1, num_kv_blocks=64), loaded=toy_loaded())
    untimed = decode_rate(engine, max_tokens=6, timed=False)
    assert untimed["decode_steps"] == 5 and untimed["decode_tokens_per_s"] > 0
    assert untimed["step_ms"] > 0 and "all_reduce_ms_per_step" not in untimed
    timed = decode_rate(engine, max_tokens=4, timed=True)
    assert timed["decode_steps"] == 3
    assert timed["all_reduces_per_step"] == 0 and timed["all_reduce_ms_per_step"] == 0
