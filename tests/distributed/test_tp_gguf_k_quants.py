"""A GGUF whose matrices are K-quants (Q4_K / Q5_K / Q6_K: 256-input super-blocks, the tensor types of
llama.cpp's Q4_K_M files) under TP 2, its blocks kept as blocks on every rank. Intermediate 1280 is 5
super-blocks: rank 0 reads down_proj's block size before the workers start and the MLP splits 768 +
512 (32-column units would give 640 + 640, cutting a super-block of down_proj's inputs)."""

import pytest

from kiln.distributed import TensorParallelEngine
from kiln.engine.config import EngineConfig

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.distributed.test_tensor_parallel import _compare  # noqa: E402
from tests.loaders.gguf_tiny import write_tiny_gguf  # noqa: E402
from tests.loaders.test_gguf_loader import tiny_llama  # noqa: E402

TYPES = {
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q6_K,
}  # fmt: skip
PROMPTS = [[5, 17, 3, 41, 42, 9, 20, 63, 1, 33, 7, 8, 9, 10, 11, 12, 13], [2, 3, 4]]
GGUF_FORMATS = dict(cpu_format="gguf", lm_head_format="gguf")


def _write(tmp_path, **shape) -> str:
    path = tmp_path / "tiny-k.gguf"
    shape = {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, **shape}
    hf = tiny_llama(seed=3, **shape)
    write_tiny_gguf(hf, path, tensor_types=TYPES)
    return str(path)


def test_tp2_over_k_quants_splits_the_mlp_in_whole_super_blocks_and_matches_tp1(tmp_path):
    path = _write(tmp_path, intermediate_size=1280)
    # float32 on the same decoded blocks; TP only reorders the o_proj / down_proj sums
    _compare(path, PROMPTS, tol=1e-5, num_kv_blocks=16, **GGUF_FORMATS)


def test_tp_over_more_ranks_than_super_blocks_is_refused_before_starting_workers(tmp_path):
    path = _write(tmp_path, intermediate_size=512, num_hidden_layers=1)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=16, **GGUF_FORMATS)
    with pytest.raises(ValueError, match=r"256-input GGUF super-blocks .* it holds 2\); use tp <= 2"):
        TensorParallelEngine(config, tp_size=4, timeout_s=10)


def test_tp2_with_a_k_quant_o_proj_cut_inside_super_blocks_runs_those_slices_dense(tmp_path):
    """6 heads of 128 over 2 ranks: each rank's o_proj reads 384 inputs, 1.5 super-blocks, so its
    slice is dequantized at load (logged) rather than refused; the rest stays K-quant blocks, and the
    logits match TP 1's."""
    path = _write(tmp_path, hidden_size=768, num_attention_heads=6, intermediate_size=1280)
    _compare(path, PROMPTS, tol=1e-5, num_kv_blocks=16, **GGUF_FORMATS)
