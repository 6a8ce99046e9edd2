"""The structured-outputs masks on each device (kiln.engine.structured_outputs; no grammar engine
needed): rows of random bitmasks, expanded on the logits' device, equal numpy's unpacking of the
bits in float64; plain rows come back untouched; the verify step's per-position rows likewise. The
CUDA case runs in the GPU check (tests marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.engine.structured_outputs import apply_grammar_masks, mask_proposals

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


class _Fixed:
    """A grammar whose next-token bitmask is given: one row per position."""

    def __init__(self, masks: np.ndarray):
        self.masks, self.position = masks, 0
        self.matcher = self

    def catch_up(self, seq):
        return None

    def fill(self, bitmask, row):
        bitmask[row] = self.masks[self.position]

    # the matcher's side, as mask_proposals walks proposals
    def is_terminated(self):
        return False

    def accept_token(self, token):
        self.position += 1
        return True

    def rollback(self, n):
        self.position -= n


class _Seq:
    def __init__(self, grammar, spec=()):
        self.grammar, self.output_token_ids, self.request_id = grammar, [], "r"
        self.spec_token_ids = list(spec)


def _reference(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    bits = np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[..., : logits.shape[-1]]
    return torch.from_numpy(np.where(bits == 1, logits.double().cpu().numpy(), -np.inf)).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [77, 49157])
def test_masked_rows_equal_numpys_unpacking_of_the_bits(device, vocab):
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    masks = rng.integers(-(2**31), 2**31, size=(3, 1, words), dtype=np.int64).astype(np.int32)
    masks[2, 0, : words // 2] = -1  # a row mostly allowed
    seqs = [_Seq(_Fixed(masks[0])), _Seq(None), _Seq(_Fixed(masks[1])), _Seq(_Fixed(masks[2]))]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    poisoned = logits.clone()
    out, failures = apply_grammar_masks(logits, seqs)
    assert not failures and out.device.type == device and torch.equal(logits, poisoned)
    for row, mask in ((0, masks[0]), (2, masks[1]), (3, masks[2])):
        assert torch.equal(out[row].cpu(), _reference(logits[row], mask[0])), row
    assert torch.equal(out[1], logits[1])


@pytest.mark.parametrize("device", DEVICES)
def test_proposal_rows_take_each_positions_mask(device):
    vocab, k = 300, 3
    rng = np.random.default_rng(3)
    masks = rng.integers(-(2**31), 2**31, size=(k + 1, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    grammar = _Fixed(masks)
    seq = _Seq(grammar, spec=[5, 6, 7])
    rows = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(4)).to(device)
    plain = torch.randn(2, vocab).to(device)
    (out, other), failures = mask_proposals([rows, plain], [seq, _Seq(None, spec=[1])])
    assert not failures and other is plain and grammar.position == 0  # rolled back
    for j in range(k + 1):
        assert torch.equal(out[j].cpu(), _reference(rows[j], masks[j])), j
