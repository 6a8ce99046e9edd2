"""row_argmax equals torch.argmax(dim=-1) exactly: random rows, ties across and within chunks (the
first wins), NaN (the first NaN wins), all -inf rows, vocabularies below, at and off a chunk multiple."""

import pytest
import torch

from kiln.engine.argmax import CHUNK, row_argmax


@pytest.mark.parametrize("vocab", [7, CHUNK, 3 * CHUNK, 3 * CHUNK + 5, 49152])
@pytest.mark.parametrize("rows", [1, 5])
def test_row_argmax_equals_torch_argmax_on_random_rows(rows, vocab):
    g = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=g)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_ties_nan_and_all_minus_infinity_rows_match_torch():
    vocab = 3 * CHUNK + 5
    x = torch.randn(6, vocab)
    x[0, [10, 2 * CHUNK + 1]] = 50.0  # a tie across chunks: the first
    x[1, [CHUNK + 3, CHUNK + 900]] = 50.0  # a tie within a chunk: the first
    x[2, [CHUNK + 7, 2 * CHUNK + 8]] = float("nan")  # NaN beats every number: the first NaN
    x[2, 5] = 1e30
    x[3] = float("-inf")
    x[4, vocab - 1] = 50.0  # the maximum in the short last chunk
    x[5, vocab - 1] = x[5, 3 * CHUNK] = 50.0  # a tie inside the short last chunk
    out = row_argmax(x)
    assert torch.equal(out, x.argmax(dim=-1))
    assert out.tolist() == [10, CHUNK + 3, CHUNK + 7, 0, vocab - 1, 3 * CHUNK]
