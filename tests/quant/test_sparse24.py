"""kiln.quant.sparse24: 2:4 pruning (magnitude, Wanda) and the compressed layout, checked on a hand-worked
matrix and by exact round trips."""

import pytest
import torch

from kiln.quant.sparse24 import compress_24, decompress_24, is_24_sparse, prune_24, wanda_scores


def test_layout_of_a_hand_worked_matrix():
    # Row 0: group 0 keeps positions 1, 3; group 1 keeps 0, 2; group 2 (one non-zero at 2) pads with 0.
    w = torch.tensor([[0.0, 5.0, 0.0, -6.0, 7.0, 0.0, 8.0, 0.0, 0.0, 0.0, 9.0, 0.0]])
    values, meta = compress_24(w)
    assert values.tolist() == [[5.0, -6.0, 7.0, 8.0, 0.0, 9.0]]
    # nibbles: g0 = 1 | 3 << 2 = 13, g1 = 0 | 2 << 2 = 8, g2 = 0 | 2 << 2 = 8; bytes: 13 | 8 << 4, 8
    assert meta.tolist() == [[13 | 8 << 4, 8]]
    assert torch.equal(decompress_24(values, meta), w)


@pytest.mark.parametrize("shape", [(7, 12), (3, 64), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prune_compress_decompress_round_trip_is_exact(shape, dtype):
    w = torch.randn(shape).to(dtype)
    pruned = prune_24(w)
    assert is_24_sparse(pruned)
    values, meta = compress_24(pruned)
    assert values.dtype == dtype and values.shape == (shape[0], shape[1] // 2)
    assert torch.equal(decompress_24(values, meta), pruned)


def test_magnitude_pruning_keeps_the_two_largest_of_every_group():
    w = torch.randn(9, 40)
    pruned = prune_24(w)
    groups, kept = w.reshape(9, 10, 4).abs(), pruned.reshape(9, 10, 4) != 0
    top2 = groups.topk(2, dim=2).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(2, top2, True))
    # exactly half the weights survive, unchanged
    assert int(kept.sum()) == 9 * 20
    assert torch.equal(pruned[pruned != 0], w[pruned != 0])


def test_wanda_scores_weigh_magnitude_by_the_input_norm():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    norm = torch.tensor([10.0, 10.0, 1.0, 1.0])
    # magnitude keeps 3, 4; Wanda keeps 1, 2 (scores 10, 20 beat 3, 4)
    assert prune_24(w).tolist() == [[0.0, 0.0, 3.0, 4.0]]
    assert prune_24(w, wanda_scores(w, norm)).tolist() == [[1.0, 2.0, 0.0, 0.0]]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"row 1, group 0 \(columns 0..3\) has 3 non-zeros"):
        compress_24(torch.tensor([[1.0, 0, 0, 0], [1.0, 2.0, 3.0, 0]]))
    with pytest.raises(ValueError, match="multiple of 4"):
        prune_24(torch.randn(2, 6))
    with pytest.raises(ValueError, match="corrupt"):
        decompress_24(torch.randn(1, 2), torch.tensor([[0b0101]], dtype=torch.uint8))
