"""Cases shared by the W8A8 GEMM tests (test_fp8_linear.py, test_int8_linear.py): both ops take the same
(x_q, x_scale, w_q, w_scale, bias, out_dtype) arguments, so they are checked on the same shapes."""

import random

# Decode with bias and per-token scales; per-tensor scales with odd sizes; a K that is whole blocks.
SCALED_LINEAR_SHAPES = [
    {"M": 1, "N": 37, "K": 200, "per_token": True, "bias": True},
    {"M": 17, "N": 33, "K": 77, "per_token": False},
    {"M": 40, "N": 19, "K": 64, "per_token": True},
]


def seed() -> int:
    return random.randrange(2**31)
