"""What the paged attention tests share: paged KV caches with a query batch (with an fp8 cache's
exact positions too), and the bad arguments both paged ops must reject."""

import os
import random
import subprocess
import sys

import torch

from kiln.ops import get_op
from kiln.ops.attention.paged_inputs import make_paged_kv
from kiln.ops.attention.reference import exact_positions, exact_slot
from kiln.ops.testing import upcast_to_float64
from kiln.verify import relative_error

DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]  # fp8: float16 queries over an fp8 cache


def decode_inputs(device, context_lens, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float16):
    """make_paged_kv's cache (shuffled blocks) and q [num_seqs, heads, head_dim]."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = make_paged_kv(context_lens, kv_heads, head_dim, block_size, dtype, device, gen)
    q_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    inputs["q"] = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(q_dtype).to(device)
    return inputs


BAD_COMMON = [
    ({"q": torch.randn(2, 3, 64).half()}, "not a multiple of the 2 kv heads"),
    ({"q": torch.randn(2, 4, 48).half()}, "head_dim 48, supported head dims"),
    ({"q": torch.randn(2, 4, 64)}, "key_cache is float16 but the data is float32"),
    (
        {"block_tables": torch.zeros(2, 1, dtype=torch.int32)},
        "seq_len 20 but block_tables rows hold only 1 blocks",
    ),
    ({"block_tables": torch.zeros(2, 2, dtype=torch.int64)}, "block_tables has dtype int64"),
    ({"seq_lens": torch.tensor([20, 9])}, "seq_lens has dtype int64"),
    ({"seq_lens": torch.tensor([20], dtype=torch.int32)}, "seq_lens 1 entries"),
    ({"k_scale": torch.ones(2), "v_scale": torch.ones(2)}, "apply only to float8_e4m3fn"),
    ({"key_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16)}, "must have one shape and dtype"),
    (
        {"key_cache": torch.zeros(4, 12, 2, 64).half(), "value_cache": torch.zeros(4, 12, 2, 64).half()},
        "power of two",
    ),
    ({"sliding_window": 0}, "sliding_window must be positive"),
]


# ---- an fp8 cache with exact positions (exact_key_cache / exact_value_cache / exact_block_tables) ----

FP8 = torch.float8_e4m3fn


def exact_inputs(device, context_lens, heads, kv_heads, block_size, window, seed=None):
    """make_paged_kv's fp8 cache with make_exact_kv's exact caches for `window`, q float16
    [num_seqs, heads, 64]."""
    gen = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    inputs = make_paged_kv(context_lens, kv_heads, 64, block_size, FP8, device, gen, exact_window=window)
    inputs["q"] = torch.randn(len(context_lens), heads, 64, generator=gen).half().to(device)
    return inputs


def float64_reference(spec, inputs: dict) -> torch.Tensor:
    return spec.reference(**{k: v.double() if k == "q" else v for k, v in inputs.items()})


def poison_exact_reads(inputs: dict) -> None:
    """NaN where the contract reads nothing: in every fp8 cache slot holding an exact position of a
    sequence (the first block, the last exact_window positions: read from the exact caches instead),
    and in every exact cache slot no exact position of any sequence maps to (exact_slot)."""
    block_size = inputs["key_cache"].shape[1]
    exact_read = torch.zeros(inputs["exact_key_cache"].shape[:2], dtype=torch.bool)
    tables, exact_tables = inputs["block_tables"].tolist(), inputs["exact_block_tables"].tolist()
    for table, exact_row, length in zip(tables, exact_tables, inputs["seq_lens"].tolist(), strict=True):
        for j in exact_positions(length, block_size, inputs["exact_window"]):
            for cache in (inputs["key_cache"], inputs["value_cache"]):
                cache.view(torch.uint8)[table[j // block_size], j % block_size] = 0x7F  # e4m3fn's NaN
            exact_read[exact_slot(exact_row, j, block_size)] = True
    for cache in (inputs["exact_key_cache"], inputs["exact_value_cache"]):
        cache[~exact_read.to(cache.device)] = float("nan")


def tightest_exact_ring_error(op_name: str, backend: str, shape: dict) -> float:
    """||out - ref|| / ||ref|| of one backend on `shape` (fp8 cache, exact positions) against float64,
    with exact_block_tables cut to R = ceil(exact_window / block_size) ring columns, the fewest the
    contract allows (the spec's input maker gives one more)."""
    op = get_op(op_name)
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = op.make_inputs(shape, FP8, torch.device("cpu"), generator)
    ring = -(-shape["exact_window"] // shape["block_size"])
    inputs["exact_block_tables"] = inputs["exact_block_tables"][:, : 1 + ring].contiguous()
    want = op.reference(**upcast_to_float64(inputs))
    return relative_error(op.implementation(backend).fn(**inputs), want)


def jax_jit_against_torch_cpu(op_name: str, implementation: str, shape: dict) -> tuple[float, dict, set]:
    """The generated kiln.jax entry of `op_name` under jax.jit (the op's non-tensor arguments static
    Python ints, as in a model's step) against the torch CPU implementation on the same fp8 inputs:
    (relative error, the static arguments, the names of the array arguments)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kiln.jax as kjax
    from kiln.ops.jax_bridge import to_jax

    op = get_op(op_name)
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = op.make_inputs(shape, FP8, torch.device("cpu"), generator)
    want = op.implementation("cpu").fn(**inputs).float().numpy()
    arrays = {k: to_jax(v) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    static = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    entry = getattr(kjax, op_name)

    @jax.jit
    def run(arrays):
        return entry(**arrays, **static, implementation=implementation)

    got = np.asarray(run(arrays).astype(jnp.float32))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)), static, set(arrays)


def assert_triton_child_prints_ok(code: str, device) -> None:
    """Run `code` in a child Python (an out-of-bounds read may kill the process) on the Triton backend,
    with `device` as its argv[1]: it must exit 0 and print "ok" last."""
    result = subprocess.run(
        [sys.executable, "-c", code, str(device)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KILN_BACKEND": "triton"},
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


_fp16_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
_small_blocks = torch.zeros(9, 8, 2, 64, dtype=torch.float16)
BAD_EXACT = [
    ({"exact_value_cache": None}, "go together; give all three or none"),
    ({"exact_block_tables": None}, "go together; give all three or none"),
    (
        {"key_cache": _fp16_cache, "value_cache": _fp16_cache, "k_scale": None, "v_scale": None},
        "the cache is float16, not float8_e4m3fn",
    ),
    (
        {"exact_key_cache": torch.zeros(9, 16, 2, 64), "exact_value_cache": torch.zeros(9, 16, 2, 64)},
        "exact_key_cache has dtype float32",
    ),
    (
        {"exact_key_cache": _small_blocks, "exact_value_cache": _small_blocks},
        r"exact_key_cache blocks are \(8, 2, 64\)",
    ),
    ({"exact_value_cache": torch.zeros(5, 16, 2, 64).half()}, "must have one shape and dtype"),
    ({"exact_block_tables": torch.zeros(2, 2, dtype=torch.int32)}, "has 1 ring columns .* widen it to 3"),
    ({"exact_block_tables": torch.zeros(1, 5, dtype=torch.int32)}, "has 1 rows, expected num_seqs 2"),
    ({"exact_block_tables": torch.zeros(2, 5, dtype=torch.int64)}, "exact_block_tables has dtype int64"),
    (
        {"exact_block_tables": torch.tensor([[0, 1, 2, 3, 4], [5, 6, 99, 7, 8]], dtype=torch.int32)},
        r"exact_block_tables\[1, 2\] = 99 is outside the exact caches' \d+ blocks",
    ),
    (
        {"exact_key_cache": None, "exact_value_cache": None, "exact_block_tables": None},
        "exact_window=20 needs exact_key_cache, exact_value_cache and exact_block_tables",
    ),
    ({"exact_window": -1}, "exact_window must be a non-negative int, got -1"),
]  # fmt: skip
