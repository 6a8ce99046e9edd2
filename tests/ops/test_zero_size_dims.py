"""A zero-size dim gives a named ValueError or an empty (or, for an empty sum, zero) result, and the
same one on every backend: before, the Triton launchers raised raw reshape or division errors where
the reference and CPU paths returned empty tensors, and the quantizers' references raised IndexError."""

import contextlib
import os
import random

import pytest
import torch

import kiln.ops
from kiln.ops import all_ops, get_op

TORCH_BACKENDS = ("reference", "cpu", "triton")


@contextlib.contextmanager
def _forced(op: str, backend: str):
    """KILN_BACKEND=backend for one call (the dispatch cache is keyed on it, so cleared either side)."""
    spec, before = get_op(op), os.environ.get("KILN_BACKEND")
    os.environ["KILN_BACKEND"] = backend
    spec._selected.clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["KILN_BACKEND"]
        else:
            os.environ["KILN_BACKEND"] = before
        spec._selected.clear()


def _outcome(op: str, backend: str, inputs: dict) -> str:
    spec = get_op(op)
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    try:
        with _forced(op, backend):
            result = getattr(kiln.ops, op)(**args)
    except ValueError as error:
        # flash_attention_with_lse shares flash_attention's checks (and names it)
        assert str(error).startswith(op.removesuffix("_with_lse") + ":"), f"{op}/{backend}: {error}"
        return "ValueError"
    outputs = spec.output_tensors(result, args)
    for out in outputs:
        assert not (out.is_floating_point() and out.isnan().any()), f"{op}/{backend}: NaN in the result"
    # Shapes only: a reference may answer in a wider dtype (gguf_dequantize's gives float64).
    return " ".join(str(tuple(o.shape)) for o in outputs)


def _can_make(spec, shape, dtype) -> bool:
    try:
        spec.make_inputs(shape, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - e.g. weights scaled by K**-0.5: covered by the GEMM test below
        return False
    return True


def _dtype(spec) -> torch.dtype:
    return torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0]


def _zero_size_cases():
    """Every integer dim of each op's first fuzz shape set to 0, where the op's input maker can."""
    cases = []
    for op in all_ops():
        spec = get_op(op)
        shape = spec.fuzz_shapes(random.Random(0))[0]
        for key, value in shape.items():
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                zeroed = {**shape, key: 0}
                if _can_make(spec, zeroed, _dtype(spec)):
                    cases.append(pytest.param(op, zeroed, id=f"{op}-{key}=0"))
    return cases


@pytest.mark.parametrize("op, shape", _zero_size_cases())
def test_a_zero_size_dim_gives_the_same_outcome_on_every_backend(op, shape, device):
    spec = get_op(op)
    for module in spec.requires:  # packages its reference needs
        pytest.importorskip(module)
    inputs = spec.make_inputs(shape, _dtype(spec), device, torch.Generator(device).manual_seed(0))
    backends = [
        b
        for b in TORCH_BACKENDS
        if b == "reference" or (b in spec.implementations and spec.implementations[b].is_available(device))
    ]
    outcomes = {b: _outcome(op, b, inputs) for b in backends}
    assert len(set(outcomes.values())) == 1, outcomes


@pytest.mark.parametrize("op", ["linear", "linear_silu_mul", "w8a16_linear", "gguf_linear", "int4_linear"])
def test_a_gemm_over_k_zero_is_zeros_plus_bias_on_every_backend(op, device):
    for module in get_op(op).requires:
        pytest.importorskip(module)
    M, N = 3, 5
    x = torch.randn(M, 0, device=device)
    width = 2 * N if op == "linear_silu_mul" else N
    args = {
        "linear": lambda: (x, torch.randn(N, 0, device=device), torch.randn(N, device=device)),
        "linear_silu_mul": lambda: (x, torch.randn(width, 0, device=device)),
        "w8a16_linear": lambda: (
            x,
            torch.zeros(N, 0, dtype=torch.int8, device=device),
            torch.ones(N, device=device),
        ),
        "gguf_linear": lambda: (x, torch.zeros(N, 0, dtype=torch.uint8, device=device), "Q8_0"),
        "int4_linear": lambda: (
            x,
            torch.zeros(N, 0, dtype=torch.int32, device=device),
            torch.ones(N, 0, device=device),
            torch.zeros(N, 0, dtype=torch.uint8, device=device),
            32,
        ),
    }[op]()
    spec = get_op(op)
    for backend in ("reference", "cpu", "triton"):
        if backend != "reference" and not (
            backend in spec.implementations and spec.implementations[backend].is_available(device)
        ):
            continue
        with _forced(op, backend):
            out = getattr(kiln.ops, op)(*args)
        expected = torch.zeros(M, N, device=device)
        if op == "linear":
            expected += args[2]
        torch.testing.assert_close(out, expected, msg=f"{op}/{backend}")
