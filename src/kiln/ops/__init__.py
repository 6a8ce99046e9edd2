"""Kiln's kernel library. Each public function validates its arguments and dispatches to the
implementation for the tensors' device (see kiln.ops.registry). Each family package lists its public
functions in `__all__`; they are all re-exported here."""

from kiln.ops import activation, attention, gemm, moe, norm, rope, sampling, softmax
from kiln.ops.activation import *  # noqa: F401,F403
from kiln.ops.attention import *  # noqa: F401,F403
from kiln.ops.gemm import *  # noqa: F401,F403
from kiln.ops.moe import *  # noqa: F401,F403
from kiln.ops.norm import *  # noqa: F401,F403
from kiln.ops.registry import OpSpec, all_ops, get_op
from kiln.ops.rope import *  # noqa: F401,F403
from kiln.ops.sampling import *  # noqa: F401,F403

# Captured before the last star import: the function kiln.ops.softmax shadows the softmax package.
_FAMILIES = (activation, attention, gemm, moe, norm, rope, sampling, softmax)
from kiln.ops.softmax import *  # noqa: F401,F403,E402

__all__ = ["OpSpec", "all_ops", "get_op"] + [name for family in _FAMILIES for name in family.__all__]

# Last: registers torch.ops.kiln.* over the public functions imported above (see library.py).
from kiln.ops import library  # noqa: E402,F401
