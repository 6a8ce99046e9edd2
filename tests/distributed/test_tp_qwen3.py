"""Qwen3 under tensor parallelism: two CPU ranks (gloo) against one process on a tiny checkpoint
written by transformers (heads split by whole GQA groups, the q/k norm weights replicated); and
Qwen3-MoE (6 experts) under tensor and expert parallelism (3 whole experts per rank)."""

import pytest

from tests.distributed.test_moe_parallel import compare_with_one_process
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


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "ep2"])
def test_qwen3_moe_over_two_ranks_matches_one_process(ep_size, tmp_path):
    path = _checkpoint(qwen3_moe, tmp_path)
    _, moe = compare_with_one_process(path, ep_size)
    assert moe.w_gate_up.shape[0] == (3 if ep_size == 2 else 6)
