"""How the model layers call kiln.ops: `op(name, device)` gives the function to call for op `name`.

(The module once also held PyTorch stand-ins for ops that had not landed yet; every op the models use
is in kiln.ops now, so a missing one is an error at model construction, not a silent fallback.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import kiln.ops


def op(name: str, device: torch.device | None = None) -> Callable[..., Any]:
    """The function a layer calls for op `name` (same signature as `kiln.ops.<name>`).

    On the CPU the registry's selected implementation is returned directly: the public function would
    re-validate the same model-built shapes on every call, about a third of a decode step's Python
    time for a small model. Elsewhere the public function (custom op, validation) is kept.
    """
    public = getattr(kiln.ops, name, None)
    if public is None:
        raise ValueError(f"kiln.models: the model needs kiln.ops.{name}, which this Kiln does not provide")
    if device is not None and device.type == "cpu":
        try:
            return kiln.ops.get_op(name).select(device).fn
        except ValueError:
            return public  # not a registered op (a plain helper like rope_cos_sin_cache)
    return public
