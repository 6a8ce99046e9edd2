"""Every Triton launch Kiln's ops make compiles for an H100 (sm_90) without a GPU, with the installed
Triton (`kiln tune aot`, alias `python -m kiln.tune.aot`). The sweep runs in a subprocess without
TRITON_INTERPRET (the test session sets it, and interpreted kernels cannot be compiled; `kiln tune aot`
must not set it either, as `kiln tune OP` does without a GPU). By default a subset (each op's smallest
and largest bench shape, bf16 and fp8, two specs per kernel; under a minute); KILN_AOT_FULL=1 runs
every bench and fuzz shape in every dtype."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia")


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_every_recorded_launch_compiles_for_sm90(tmp_path):
    full = os.environ.get("KILN_AOT_FULL") == "1"
    out = tmp_path / "aot.json"
    args = ["-m", "kiln.cli", "tune", "aot", "--json", str(out)]
    proc = _run(args if full else [*args, "--quick", "--per-kernel", "2"], timeout=3600 if full else 600)
    report = json.loads(out.read_text()) if out.exists() else None
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [r for r in report["results"] if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} {r['constexprs']}: {r['error'][-800:]}" for r in failed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not report["drive_errors"], report["drive_errors"]
    kernels = {r["kernel"] for r in report["results"]}
    # dense/TMA/scaled/int4/gguf GEMMs, MoE, attention, norms, elementwise: the sweep reached them all
    assert len(kernels) >= 20, sorted(kernels)
    assert any(name.endswith("_linear_tma_kernel") for name in kernels), "the TMA GEMM was never launched"
    # the engine's fp8 cache keeps exact positions by default: both paged attention kernels for them
    for exact in ("_decode_partition_exact_kernel", "_paged_prefill_exact_kernel"):
        assert any(name.endswith(exact) for name in kernels), f"{exact} was never launched"
    # 16/8-bit launches at bench/model shapes are the GPU's hot path: no register spills there
    # (fp32 launches and odd fuzz-only shapes are reported by the CLI, not asserted)
    spilled = [r for r in report["results"] if r["hot_spill"]]
    assert not spilled, [(r["kernel"], r["constexprs"], r["operand"], r["spill_bytes"]) for r in spilled]


_RECORDER_SCRIPT = textwrap.dedent(
    """
    import json, torch, triton, triton.language as tl
    from kiln.tune.aot.record import compile_spec, record_launches

    @triton.jit
    def scale_kernel(x_ptr, out_ptr, n, stride, factor, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs * stride, mask=offs < n) * factor, mask=offs < n)

    x = torch.randn(4096, dtype=torch.bfloat16)
    out = torch.full((4096,), 7.0)
    with record_launches() as recorder:
        for _ in range(2):  # the same launch twice is one spec
            scale_kernel[(4,)](x, out, 4096, 3, 0.5, BLOCK=1024, num_warps=2)
        scale_kernel[(4,)](x[1:], out, 4095, 1, 0.5, BLOCK=1024)
    specs = list(recorder.specs.values())
    results = [compile_spec(s) for s in specs]
    rows = [[s.signature, {str(k): v for k, v in s.attrs.items()},
             {str(k): str(v) for k, v in s.constexprs.items()}, s.options] for s in specs]
    print(json.dumps({"untouched": bool((out == 7.0).all()), "launches": recorder.launches, "specs": rows,
                      "ok": [r.error is None for r in results]}))
    """
)  # fmt: skip


def test_recorder_specializes_launches_like_a_real_launch_and_runs_nothing(tmp_path):
    script = tmp_path / "record_one_kernel.py"  # @triton.jit needs its source in a file
    script.write_text(_RECORDER_SCRIPT)
    proc = _run([str(script)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["untouched"] and info["launches"] == 3 and info["ok"] == [True, True]
    (sig, attrs, consts, options), (sig2, attrs2, consts2, options2) = info["specs"]
    assert sig == {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32", "stride": "i32", "factor": "fp32",
                   "BLOCK": "constexpr", "FLAG": "constexpr"}  # fmt: skip
    # aligned pointers and n = 4096 are marked divisible by 16; stride 3 is not
    assert set(attrs) == {"(0,)", "(1,)", "(2,)"} and consts == {"(5,)": "1024", "(6,)": "True"}
    assert options == {"num_warps": 2}
    # x[1:] is 2 bytes off 16, n = 4095 is odd, stride 1 is a constexpr (Triton specializes 1)
    assert set(attrs2) == {"(1,)"} and sig2["stride"] == "constexpr" and consts2["(3,)"] == "1"
    assert options2 == {}


def test_python_m_kiln_tune_aot_is_the_same_command():
    alias, command = (
        _run([*args, "--help"], timeout=120)
        for args in (["-m", "kiln.tune.aot"], ["-m", "kiln.cli", "tune", "aot"])
    )
    assert alias.returncode == 0 and command.returncode == 0, alias.stderr[-2000:] + command.stderr[-2000:]
    options = "[--op OP] [--suite SUITE] [--fuzz FUZZ] [--quick]"
    assert options in " ".join(alias.stdout.split()) and options in " ".join(command.stdout.split())
