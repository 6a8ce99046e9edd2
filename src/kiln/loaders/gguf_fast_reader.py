"""The `gguf` package's GGUFReader over a plain NumPy view of the file's memory map.

GGUFReader slices its `np.memmap` once or twice for every metadata value, and each slice of a memmap
runs NumPy's Python-level `memmap.__getitem__` / `__array_finalize__`. A tokenizer's vocabulary and
merges are ~100k strings, so on the embedded SmolLM2 file that overhead is two thirds of the parse
(2.9-3.1 s -> 0.96-0.98 s on a 2-core Zen 3 host). Read through a base-class `np.ndarray` view of the
same map, the fields and tensors are the same bytes (same values, same offsets, still no copy), and
the map stays open as the view's base.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


@functools.cache
def _reader_class() -> type:
    from gguf import GGUFReader

    class PlainArrayGGUFReader(GGUFReader):
        """GGUFReader whose `data` (assigned once, the file's memmap, in GGUFReader.__init__) is kept
        as an ndarray view of that map: slices of it skip memmap's Python-level hooks."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainArrayGGUFReader


def read_gguf(path: str) -> Any:
    """GGUFReader(path) (read-only), its tensors' `data` ndarray views of the file's memory map:
    the package's own parser and errors, without memmap's per-slice overhead."""
    return _reader_class()(path)
