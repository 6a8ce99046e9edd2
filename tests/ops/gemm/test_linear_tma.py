"""The TMA (tensor-descriptor) dense GEMM: correctness against float64, when it is chosen over the
pointer kernel, and that it lowers to TMA copies and wgmma for sm_90."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from kiln import fallbacks
from kiln.ops.gemm.linear import LINEAR
from kiln.ops.gemm.linear import triton as dispatch
from kiln.ops.gemm.linear import triton_tma as tma
from kiln.ops.gemm.linear.triton import linear_tma_triton, linear_triton
from kiln.ops.gemm.linear_silu_mul import LINEAR_SILU_MUL
from kiln.ops.gemm.linear_silu_mul.triton import linear_silu_mul_tma_triton
from kiln.verify import assert_close, run_case
from kiln.verify.runner import backend_dtypes

# K is a multiple of 8 so fp16 rows are 16-byte aligned (TMA's rule); M and N odd to hit every edge.
SHAPES = [
    {"M": 1, "N": 53, "K": 136, "bias": True},  # decode: split-K, the split's last K block zero-filled
    {"M": 5, "N": 53, "K": 72},
    {"M": 37, "N": 53, "K": 136, "bias": True},  # several M tiles
]


def seed() -> int:
    return random.randrange(2**31)


@pytest.fixture
def tma_only(device, monkeypatch):
    """Skip where the TMA kernel cannot run; make any fall back to the pointer kernel an error."""
    if not tma.tma_device(device):
        pytest.skip(f"no TMA kernel on {device} (needs compute capability >= 9 or the interpreter)")

    def no_pointer(*args, **kwargs):
        raise AssertionError("the pointer kernel ran where the TMA kernel was expected")

    monkeypatch.setattr(dispatch, "_launch_pointer", no_pointer)


def _config(block_m, block_n, block_k, split_k, group_m=2):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
            "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_tma_matches_float64_reference(dtype, shape, device, tma_only):
    case = run_case(LINEAR, "triton_tma", shape, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 53, "K": 136}, {"M": 37, "N": 53, "K": 72}])
def test_linear_silu_mul_tma_matches_float64_reference(dtype, shape, device, tma_only):
    case = run_case(LINEAR_SILU_MUL, "triton_tma", shape, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_tma_grouped_tiles_and_uneven_split_k(split_k, device, tma_only):
    # 3 x 4 output tiles in groups of 2 rows; K = 200 in 3 splits of 5 x 16 (the last ends mid-block).
    x = torch.randn(40, 200, device=device, dtype=torch.float16)
    w = (torch.randn(50, 200, device=device) / 14).half()
    bias = torch.randn(50, device=device, dtype=torch.float16)
    out = linear_tma_triton(x, w, bias, config=_config(16, 16, 16, split_k))
    assert_close(out, x.double() @ w.double().T + bias.double(), 2e-3)


def test_linear_silu_mul_tma_split_k_keeps_gate_and_up_apart(device, tma_only):
    # N = 24 over 16-wide tiles: the second gate tile reads up rows (masked), its up tile runs past 2N.
    x = torch.randn(5, 96, device=device)
    w = torch.randn(2 * 24, 96, device=device) / 10
    out = linear_silu_mul_tma_triton(x, w, config=_config(16, 16, 16, 4))
    gate, up = x.double() @ w[:24].double().T, x.double() @ w[24:].double().T
    assert_close(out, torch.nn.functional.silu(gate) * up, 1e-5)


def test_tma_eligibility_rejects_layouts_tma_cannot_read():
    if not tma.tma_device(torch.device("cpu")):
        pytest.skip("the TMA kernel needs the Triton interpreter on the CPU")
    x, w = torch.randn(5, 72).half(), torch.randn(53, 72).half()
    assert tma.tma_eligible(x, w)
    assert tma.tma_eligible(x.float(), w.float())
    assert not tma.tma_eligible(torch.randn(5, 77).half(), torch.randn(53, 77).half())  # 154-byte rows
    assert not tma.tma_eligible(x, torch.randn(72, 53).half().T)  # unit stride along N, not K
    assert not tma.tma_eligible(torch.randn(5, 80).half()[:, 1:73], w)  # base 2 bytes off
    assert not tma.tma_eligible(x.double(), w.double())


def test_tma_device_needs_compute_capability_9(monkeypatch):
    monkeypatch.setattr(tma, "_compute_capability", lambda index: (8, 0))
    assert not tma.tma_device(torch.device("cuda", 0))
    monkeypatch.setattr(tma, "_compute_capability", lambda index: (9, 0))
    assert tma.tma_device(torch.device("cuda", 0)) == tma.descriptors_available()


def _spy_kernels(monkeypatch) -> list[str]:
    ran = []
    real_tma, real_pointer = dispatch.launch_linear_tma, dispatch._launch_pointer
    monkeypatch.setattr(dispatch, "launch_linear_tma", lambda *a: ran.append("tma") or real_tma(*a))
    monkeypatch.setattr(dispatch, "_launch_pointer", lambda *a: ran.append("pointer") or real_pointer(*a))
    return ran


@pytest.mark.parametrize(
    "env, k, expected",
    [
        ("0", 72, "pointer"),  # the override
        ("1", 72, "tma"),  # forced on wherever it can run (here: the interpreter)
        ("1", 77, "pointer"),  # misaligned rows fall back even when forced
        (None, 72, "tma" if torch.cuda.is_available() else "pointer"),  # default: CUDA only
    ],
)
def test_linear_dispatch_follows_kiln_gemm_tma_and_eligibility(env, k, expected, device, monkeypatch):
    if not tma.tma_device(device):
        pytest.skip(f"no TMA kernel on {device}")
    if env is None:
        monkeypatch.delenv("KILN_GEMM_TMA", raising=False)
    else:
        monkeypatch.setenv("KILN_GEMM_TMA", env)
    ran = _spy_kernels(monkeypatch)
    x = torch.randn(3, k, device=device, dtype=torch.float16)
    w = (torch.randn(21, k, device=device) / 8).half()
    assert_close(linear_triton(x, w), x.double() @ w.double().T, 2e-3)
    assert ran == [expected]


def test_triton_tma_falls_back_to_pointer_kernel_for_misaligned_rows(device, monkeypatch):
    if not tma.tma_device(device):
        pytest.skip(f"no TMA kernel on {device}")
    ran = _spy_kernels(monkeypatch)
    x, w = torch.randn(4, 77, device=device), torch.randn(2 * 9, 77, device=device) / 8
    out = linear_silu_mul_tma_triton(x, w)
    gate, up = x.double() @ w[:9].double().T, x.double() @ w[9:].double().T
    assert_close(out, torch.nn.functional.silu(gate) * up, 1e-5)
    assert ran == ["pointer"]


def test_triton_tma_is_registered_verified_and_benched_beside_the_pointer_kernel():
    for spec in (LINEAR, LINEAR_SILU_MUL):
        assert "triton_tma" in spec.implementations and "triton_pointer" in spec.baselines
        _, skipped = backend_dtypes(spec, "triton_tma", torch.device("cpu"))
        if os.environ.get("TRITON_INTERPRET") == "1":
            assert skipped == [torch.bfloat16]  # bf16 dots are wrong in the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [LINEAR, LINEAR_SILU_MUL])
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 4096, "K": 4096}, {"M": 300, "N": 577, "K": 1000, "bias": True}]
)
def test_linear_tma_bfloat16_on_gpu(spec, shape, tma_only):
    case = run_case(spec, "triton_tma", shape, torch.bfloat16, torch.device("cuda"), seed())
    assert case.passed, case


_AOT_SCRIPT = textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kiln.ops.gemm.linear.triton_tma import _linear_tma_kernel as fn

    i32 = "i32"
    # (dtype, BLOCK_M, BLOCK_K, SILU_MUL, SPLIT_K): prefill tiles (wgmma), a decode tile (mma.sync)
    cases = (("bf16", 64, 64, True, 2), ("fp16", 64, 128, False, 1), ("bf16", 16, 128, True, 4),
             ("fp32", 64, 32, False, 1))
    for dtype, block_m, block_k, silu_mul, split_k in cases:
        # A host TensorDescriptor argument is specialized as "tensordesc<dtype[block shape]>".
        signature = {"x_desc": f"tensordesc<{dtype}{[block_m, block_k]}>",
                     "w_desc": f"tensordesc<{dtype}{[64, block_k]}>",
                     "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "partial_ptr": "*fp32",
                     "M": i32, "N": i32, "K": i32, "stride_om": i32, "stride_on": i32}
        constexprs = {"HAS_BIAS": not silu_mul, "SILU_MUL": silu_mul,
                      "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                      "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "GROUP_M": 8, "SPLIT_K": split_k}
        signature.update({name: "constexpr" for name in constexprs})
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("out_ptr", "stride_om", "N")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": 4, "num_stages": 3}
        ptx = compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx, f"{dtype}: the descriptor loads are not TMA copies"
        if dtype != "fp32" and block_m >= 64:
            assert "wgmma" in ptx, f"{dtype}: the TMA GEMM does not use Hopper tensor cores"
    print("compiled")
    """
)  # fmt: skip


def test_tma_kernel_compiles_to_tma_and_wgmma_for_sm90_without_a_gpu():
    # The interpreter never compiles: check the real lowering (bulk tensor copies, wgmma) for Hopper.
    pytest.importorskip("triton.backends.nvidia")
    if not tma.descriptors_available():
        pytest.skip("this triton has no host-side tensor descriptors")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_automatic_tma_path_that_fails_to_build_falls_back_to_the_pointer_kernel(device, monkeypatch, caplog):
    if not tma.tma_device(device):
        pytest.skip(f"no TMA kernel on {device}")
    monkeypatch.setenv("KILN_GEMM_TMA", "1")
    monkeypatch.setattr(dispatch, "_TMA_FAILED", [])
    fallbacks.clear()
    tried = []

    def broken(*args):
        tried.append(1)
        raise RuntimeError("PassManager::run failed")  # what a Triton that can't lower it raises

    monkeypatch.setattr(dispatch, "launch_linear_tma", broken)
    x = torch.randn(5, 72, device=device)
    w = torch.randn(53, 72, device=device)
    for _ in range(2):  # the second call does not retry the TMA kernel
        assert_close(linear_triton(x, w), x.double() @ w.double().T, 1e-5, "after TMA failure")
    assert len(tried) == 1 and "PassManager" in dispatch._TMA_FAILED[0]
    assert "TMA kernel failed" in caplog.text
    # recorded once for the result writers, which mark linear/triton as run by the pointer kernel
    (entry,) = fallbacks.taken()
    assert entry["kind"] == fallbacks.GEMM_TMA_TO_POINTER and "PassManager" in entry["detail"]
    fallbacks.clear()
