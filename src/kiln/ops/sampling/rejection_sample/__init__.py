"""rejection_sample: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.sampling.rejection_sample import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE, rejection_sample

__all__ = ["REJECTION_SAMPLE", "rejection_sample"]
