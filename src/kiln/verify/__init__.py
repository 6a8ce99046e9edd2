"""Numerical verification of every op against float64 references (`kiln verify`)."""

from kiln.verify.compare import assert_close, relative_error
from kiln.verify.runner import Row, run_case, verify

__all__ = ["Row", "assert_close", "relative_error", "run_case", "verify"]
