"""moe_route: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.moe.moe_route import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.moe.moe_route.spec import MOE_ROUTE, moe_route

__all__ = ["MOE_ROUTE", "moe_route"]
