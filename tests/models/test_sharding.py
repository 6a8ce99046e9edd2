"""How checkpoints are split over tensor-parallel ranks: head / MLP / vocabulary ranges, GGUF block
slicing with their scales, and the sharded WeightStore (no processes: pure slicing)."""

import dataclasses

import pytest
import torch

from kiln.models.config import ModelConfig
from kiln.models.sharding import (
    ShardedWeightStore,
    ShardPlan,
    intermediate_unit,
    shard_cols,
    shard_rows,
    split_evenly,
    with_intermediate_unit,
)
from kiln.models.weights import GGUFWeight, WeightStore


def _config(**overrides):
    base = dict(
        architecture="LlamaForCausalLM", vocab_size=160, hidden_size=64, intermediate_size=96,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def _random_gguf(n, k, qtype, seed=0):
    """Random block bytes with finite fp16 scales (and mins for Q4_1)."""
    from kiln.models.weights import GGUF_BLOCK_BYTES

    g = torch.Generator().manual_seed(seed)
    nb, bb = k // 32, GGUF_BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (n, nb, bb), generator=g, dtype=torch.int32).to(torch.uint8)
    scale_bytes = (torch.rand(n, nb, 1, generator=g) * 0.1 + 0.01).half().view(torch.uint8)
    data[..., 0:2] = scale_bytes.view(n, nb, 2)
    if qtype == "Q4_1":
        data[..., 2:4] = (torch.randn(n, nb, 1, generator=g) * 0.1).half().view(torch.uint8).view(n, nb, 2)
    return GGUFWeight(qtype, data.reshape(n, nb * bb), (n, k))


def test_split_evenly_covers_everything_with_larger_pieces_first():
    assert split_evenly(9, 2) == [(0, 5), (5, 9)]
    assert split_evenly(1536, 3, unit=32) == [(0, 512), (512, 1024), (1024, 1536)]
    assert split_evenly(96, 2, unit=32) == [(0, 64), (64, 96)]


def test_smollm2_heads_split_unevenly_by_whole_gqa_groups():
    plan = ShardPlan(_config(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576), 2)
    assert [s.q_heads for s in plan.shards] == [(0, 6), (6, 9)]
    assert [s.kv_heads for s in plan.shards] == [(0, 2), (2, 3)]
    # every rank keeps the model's GQA ratio (3 q heads per kv head)
    for rank in range(2):
        c = plan.rank_config(rank)
        assert c.num_heads == 3 * c.num_kv_heads


def test_fewer_kv_heads_than_ranks_replicates_kv_heads_and_splits_their_q_heads():
    plan = ShardPlan(_config(num_heads=4, num_kv_heads=1), 2)
    assert [s.kv_heads for s in plan.shards] == [(0, 1), (0, 1)]
    assert [s.q_heads for s in plan.shards] == [(0, 2), (2, 4)]
    plan = ShardPlan(_config(num_heads=8, num_kv_heads=2), 4)
    assert [s.kv_heads for s in plan.shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in plan.shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (dict(num_heads=6, num_kv_heads=2), 3, "cannot share 2 kv heads"),
        (dict(num_heads=2, num_kv_heads=1), 4, "only 2 q heads"),
        (dict(architecture="FalconForCausalLM"), 2, "run it with tp 1"),
        (dict(intermediate_size=1), 2, "no MLP columns"),
    ],
)
def test_unsplittable_models_are_rejected_with_the_reason(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan(_config(**overrides), tp)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_column_shards_keep_their_block_scales(qtype):
    weight = _random_gguf(8, 128, qtype)
    full = weight.dequantize()
    torch.testing.assert_close(shard_cols(weight, 32, 96).dequantize(), full[:, 32:96], rtol=0, atol=0)
    torch.testing.assert_close(shard_rows(weight, 3, 7).dequantize(), full[3:7], rtol=0, atol=0)


def test_gguf_column_shard_off_a_block_boundary_is_its_decoded_slice(caplog):
    """A slice that cuts blocks (a K-quant o_proj over ranks of 7 heads of 128) runs dense: the decoded
    columns exactly, logged once per split."""
    from kiln.quant.gguf_blocks import quantize_blocks

    weight = _random_gguf(4, 128, "Q4_1")
    with caplog.at_level("WARNING", logger="kiln.models.sharding"):
        part = shard_cols(weight, 16, 80, "o_proj")
        shard_cols(weight, 16, 80, "o_proj")
    assert part.dtype == torch.float32 and torch.equal(part, weight.dequantize()[:, 16:80])
    assert [r.getMessage() for r in caplog.records] == [
        "tensor parallel: inputs [16, 80) of o_proj (Q4_1) cut its 32-input GGUF blocks: this rank's slice "
        "is dequantized at load and runs dense (a tp size giving every rank a multiple of 32 of these inputs "
        "keeps it quantized)"
    ]
    k_quant = GGUFWeight("Q4_K", quantize_blocks(torch.randn(3, 1024), "Q4_K"), (3, 1024))
    assert torch.equal(shard_cols(k_quant, 384, 768), k_quant.dequantize()[:, 384:768])
    assert shard_cols(k_quant, 256, 768).data.shape == (3, 2 * 144)  # whole super-blocks: still blocks


def _blocks(qtype: str, n: int, k: int) -> GGUFWeight:
    """A GGUF weight [n, k] of zero bytes: enough to read its block size."""
    from kiln.models.weights import GGUF_BLOCK_BYTES

    per_block = 256 if qtype.endswith("_K") else 32
    data = torch.zeros(n, k // per_block * GGUF_BLOCK_BYTES[qtype], dtype=torch.uint8)
    return GGUFWeight(qtype, data, (n, k))


def test_k_quant_down_proj_splits_the_intermediate_in_whole_256_input_super_blocks():
    config = with_intermediate_unit(_config(intermediate_size=1280, num_heads=8, num_kv_heads=8), 256)
    # 5 super-blocks: 3 + 2, not 640 + 640 (which cuts the third)
    assert [s.intermediate for s in ShardPlan(config, 2).shards] == [(0, 768), (768, 1280)]
    assert [s.intermediate for s in ShardPlan(config, 3).shards] == [(0, 512), (512, 1024), (1024, 1280)]
    with pytest.raises(ValueError, match=r"256-input GGUF super-blocks .* it holds 5\); use tp <= 5"):
        ShardPlan(config, 8)
    # without the unit: 32-column units, as before
    assert ShardPlan(_config(intermediate_size=1280), 2).shards[0].intermediate == (0, 640)


def test_intermediate_unit_is_the_largest_gguf_block_of_any_down_proj():
    config = dataclasses.replace(
        _config(intermediate_size=512, num_layers=2), extra={"gguf_architecture": "llama"}
    )
    h, i = config.hidden_size, config.intermediate_size

    def store(*qtypes):
        loaders = {
            f"model.layers.{n}.mlp.down_proj.weight": ((h, i), lambda q=q: _blocks(q, h, i))
            for n, q in enumerate(qtypes)
        }
        return WeightStore("test.gguf", loaders)

    assert intermediate_unit(config, store("Q8_0", "Q6_K")) == 256  # one K-quant layer is enough
    assert intermediate_unit(config, store("Q8_0", "Q4_0")) == 32
    hf_store = store("Q6_K", "Q6_K")
    assert intermediate_unit(dataclasses.replace(config, extra={}), hf_store) == 32
    assert hf_store.used == set()  # an HF checkpoint's weights are not read for it


def test_sharded_store_slices_reassemble_every_tensor():
    c = _config(num_heads=4, num_kv_heads=2, attention_bias=True)
    d, h, i, v = c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size
    p = "model.layers.0."
    shapes = {
        p + "self_attn.q_proj.weight": (4 * d, h), p + "self_attn.q_proj.bias": (4 * d,),
        p + "self_attn.k_proj.weight": (2 * d, h), p + "self_attn.v_proj.weight": (2 * d, h),
        p + "self_attn.o_proj.weight": (h, 4 * d), p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,), "model.embed_tokens.weight": (v, h),
    }  # fmt: skip
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    store = WeightStore("test", {n: (t.shape, lambda t=t: t) for n, t in tensors.items()})
    plan = ShardPlan(c, 2)
    parts = {name: [] for name in tensors}
    for rank in range(2):
        rc = plan.rank_config(rank)
        local = {
            "q": (rc.num_heads * d, h), "k": (rc.num_kv_heads * d, h), "v": (rc.num_kv_heads * d, h),
            "o": (h, rc.num_heads * d), "gate": (rc.intermediate_size, h), "up": (rc.intermediate_size, h),
            "down": (h, rc.intermediate_size),
        }  # fmt: skip
        sharded = ShardedWeightStore(store, plan, rank)
        for name, shape in shapes.items():
            proj = name.rsplit(".", 2)[-2].removesuffix("_proj")
            want = local.get(proj, shape)
            if name.endswith(".bias"):
                want = (want[0],)
            if name == "model.embed_tokens.weight":
                want = (rc.vocab_size, h)
            parts[name].append(sharded.get(name, want))
    for name, full in tensors.items():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            torch.testing.assert_close(torch.cat(parts[name], dim=1), full, rtol=0, atol=0)
        elif name.endswith("layernorm.weight"):
            assert all(torch.equal(part, full) for part in parts[name])
        else:
            torch.testing.assert_close(torch.cat(parts[name], dim=0), full, rtol=0, atol=0)


def test_rank_config_keeps_everything_but_the_split_sizes():
    c = _config(num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64, intermediate_size=1536)
    rc = ShardPlan(c, 2).rank_config(1)
    assert (rc.num_heads, rc.num_kv_heads, rc.intermediate_size, rc.vocab_size) == (3, 1, 768, 80)
    assert dataclasses.replace(rc, num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=160) == c


@pytest.mark.parametrize("K", [256, 200])  # 200: a short last group
def test_int4_shards_keep_their_group_scales_and_zero_points(K):
    from kiln.quant.int4 import quantize_int4
    from kiln.quant.linear_weights import Int4Weight

    weight = torch.randn(48, K, generator=torch.Generator().manual_seed(1))
    w4 = Int4Weight(*quantize_int4(weight, group_size=64), group_size=64, in_features=K)
    full = w4.dequantize()
    torch.testing.assert_close(shard_rows(w4, 16, 40).dequantize(), full[16:40], rtol=0, atol=0)
    for start, end in ((0, 128), (128, K)):
        torch.testing.assert_close(
            shard_cols(w4, start, end).dequantize(), full[:, start:end], rtol=0, atol=0
        )
    with pytest.raises(ValueError, match="cannot shard weight: .*group_size 64"):
        shard_cols(w4, 32, 128)
    with pytest.raises(ValueError, match="act-order"):
        shard_cols(Int4Weight(w4.qweight, w4.scales, w4.zeros, 64, K, torch.randperm(K)), 0, 128)


@pytest.mark.parametrize("per_channel", [True, False])
def test_w8a8_shards_keep_their_scales(per_channel):
    from kiln.quant.linear_weights import ScaledWeight

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    scale = weight.abs().amax(dim=1) / 448.0 if per_channel else weight.abs().amax().reshape(1) / 448
    w8 = ScaledWeight("fp8", (weight / scale.reshape(-1, 1)).to(torch.float8_e4m3fn), scale.reshape(-1, 1))
    full = w8.dequantize()
    torch.testing.assert_close(shard_rows(w8, 8, 20).dequantize(), full[8:20], rtol=0, atol=0)
    torch.testing.assert_close(shard_cols(w8, 16, 48).dequantize(), full[:, 16:48], rtol=0, atol=0)


def test_block_fp8_and_2to4_shards_keep_their_scales_and_positions():
    from kiln.quant.linear_weights import BlockFP8Weight
    from kiln.quant.sparse24 import Sparse24Weight, compress_24, prune_24

    g = torch.Generator().manual_seed(3)
    data = torch.randn(256, 384, generator=g).to(torch.float8_e4m3fn)
    fp8 = BlockFP8Weight(data, torch.rand(2, 3, generator=g) + 0.5, (128, 128))
    full = fp8.dequantize()
    torch.testing.assert_close(shard_rows(fp8, 128, 256).dequantize(), full[128:], rtol=0, atol=0)
    torch.testing.assert_close(shard_cols(fp8, 128, 384).dequantize(), full[:, 128:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="128-input block boundaries"):
        shard_cols(fp8, 64, 384)
    sparse = Sparse24Weight(*compress_24(prune_24(torch.randn(24, 48, generator=g))))
    dense = sparse.dequantize()
    torch.testing.assert_close(shard_rows(sparse, 5, 17).dequantize(), dense[5:17], rtol=0, atol=0)
    torch.testing.assert_close(shard_cols(sparse, 16, 48).dequantize(), dense[:, 16:48], rtol=0, atol=0)
    with pytest.raises(ValueError, match="8-input boundaries"):
        shard_cols(sparse, 4, 48)
