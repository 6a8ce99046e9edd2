"""Qwen3 under tensor parallelism: two CPU ranks (gloo) against one process on a tiny checkpoint
written by transformers (heads split by whole GQA groups, the q/k norm weights replicated); and
Qwen3-MoE, whose TP is not supported yet (#19), refused before any worker starts."""

import pytest

from kiln.distributed import TensorParallelEngine
from kiln.engine.config import EngineConfig
from tests.distributed.test_tensor_parallel import PROMPTS, _compare
from tests.models.test_qwen3 import qwen3, qwen3_moe, save, write_word_tokenizer


def _checkpoint(make_hf, directory, **overrides):
    hf_model = make_hf(vocab_size=144, **overrides)
    save(hf_model, directory, seed=11)
    write_word_tokenizer(directory, 144)
    return str(directory)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv_heads_split", "kv_head_replicated"])
def test_tp2_qwen3_with_q_k_norms_matches_tp1(kv_heads, tmp_path):
    path = _checkpoint(qwen3, tmp_path, num_key_value_heads=kv_heads)
    # fp32 everywhere; TP only reorders the sums of o_proj / down_proj: rounding-level differences
    _compare(path, PROMPTS, tol=1e-5)


def test_tp_engine_refuses_qwen3_moe_before_starting_workers(tmp_path):
    path = _checkpoint(qwen3_moe, tmp_path)
    with pytest.raises(ValueError, match="architecture 'Qwen3MoeForCausalLM' is not supported"):
        TensorParallelEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=8), tp_size=2)
