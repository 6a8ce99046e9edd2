"""row_argmax: torch.argmax(x, dim=-1) of a [rows, vocab] float tensor, exactly (the first maximum;
NaN counts as the maximum, so the first NaN), in two passes that run vectorized on CPU.

PyTorch's CPU argmax over the last dim is a scalar loop (SmolLM2's vocabulary, 2 threads: ~0.5 ms at
16 rows, ~2 ms at 64), while amax is vectorized. So: each row's maximum per chunk of CHUNK columns
(amax), the first chunk holding the row's maximum (a small argmax), then the argmax within that chunk
(measured 108 vs 501 us at 16 rows of 49152, 23 vs 64 us at one row).
"""

from __future__ import annotations

import torch

CHUNK = 1024


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x: float [rows, vocab]. Returns int64 [rows], equal to x.argmax(dim=-1)."""
    rows, vocab = x.shape
    full = vocab - vocab % CHUNK
    if x.device.type != "cpu" or full == 0:
        return x.argmax(dim=-1)
    maxima = x[:, :full].reshape(rows, full // CHUNK, CHUNK).amax(dim=-1)
    if full < vocab:  # the last, shorter chunk
        maxima = torch.cat([maxima, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    # amax keeps NaN, so the first chunk with the row's maximum (or first NaN) is the argmax's chunk
    starts = maxima.argmax(dim=-1) * CHUNK
    # a window past the end of the row repeats its last column, which cannot come before the real one
    columns = (starts[:, None] + torch.arange(CHUNK, device=x.device)).clamp_(max=vocab - 1)
    return starts + x.gather(1, columns).argmax(dim=-1)
