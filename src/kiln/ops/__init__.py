"""Kiln's kernel library. Each public function validates its arguments and dispatches to the
implementation for the tensors' device (see kiln.ops.registry)."""

from kiln.ops.norm import rms_norm
from kiln.ops.registry import OpSpec, all_ops, get_op

__all__ = ["OpSpec", "all_ops", "get_op", "rms_norm"]
