"""Kiln's kernel library. Each public function is generated from its op's spec
(`kiln/ops/<family>/<op>/spec.py`, see kiln.ops.registry): it validates its arguments and dispatches to
the implementation for the tensors' device and dtype. Each family package lists its public functions
in `__all__`; they are all re-exported here, with `all_ops()` / `get_op(name)` over the registry."""

from kiln.ops import activation, attention, gemm, loss, moe, norm, rope, sampling, softmax
from kiln.ops.activation import *  # noqa: F401,F403
from kiln.ops.attention import *  # noqa: F401,F403
from kiln.ops.gemm import *  # noqa: F401,F403
from kiln.ops.loss import *  # noqa: F401,F403
from kiln.ops.moe import *  # noqa: F401,F403
from kiln.ops.norm import *  # noqa: F401,F403
from kiln.ops.registry import _REGISTRY, OpSpec, trusted_inputs
from kiln.ops.rope import *  # noqa: F401,F403
from kiln.ops.sampling import *  # noqa: F401,F403

# Captured before the last star import: the function kiln.ops.softmax shadows the softmax package.
_FAMILIES = (activation, attention, gemm, loss, moe, norm, rope, sampling, softmax)
from kiln.ops import autograd  # noqa: E402,F401  (registers the backward formulas on the custom ops)
from kiln.ops.softmax import *  # noqa: F401,F403,E402

__all__ = ["OpSpec", "all_ops", "get_op", "trusted_inputs"]
__all__ += [name for family in _FAMILIES for name in family.__all__]


def all_ops() -> dict[str, OpSpec]:
    """Every registered op (each family registered its ops when imported above), with each op's JAX
    backends when jax is installed (`kiln.ops.jax_bridge.load_jax_backends`)."""
    from kiln.ops import jax_bridge

    jax_bridge.load_jax_backends()
    return dict(sorted(_REGISTRY.items()))


def get_op(name: str) -> OpSpec:
    """The spec of op `name` (ValueError listing the registered ops if unknown)."""
    ops = all_ops()
    try:
        return ops[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; registered ops: {', '.join(ops)}") from None
