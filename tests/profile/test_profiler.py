import json

import pytest
import torch

import kiln.ops
import kiln.profile
from kiln.bench.ceilings import measure_ceilings
from kiln.cli import main
from kiln.profile.gap import format_gaps, format_kernels
from kiln.profile.kernel_ops import kiln_kernel_op, triton_kernel_ops
from kiln.profile.profiler import profile_callable, profile_op
from kiln.profile.ranges import _NULL

SHAPE = {"rows": 9, "hidden": 300, "residual": True}


def test_range_is_a_shared_no_op_when_nobody_profiles():
    assert kiln.profile.range("decode") is _NULL
    with kiln.profile.range("decode"):
        pass


def test_ranges_inside_a_session_record_their_declared_work():
    with kiln.profile.session() as work:
        with kiln.profile.range("kiln::rms_norm", op="rms_norm", shape=SHAPE, dtype=torch.float32):
            pass
        with kiln.profile.range("decode"):
            pass
    assert work == [("rms_norm", SHAPE, torch.float32)]
    assert kiln.profile.range("decode") is _NULL  # listening stops with the session


def test_kilns_kernels_map_to_the_op_whose_package_defines_them():
    """By the defining package, not by name: most kernel names contain no op name (the paged decode's
    partition kernel), and some contain another op's (fp8_linear's `_scaled_linear_kernel` is not
    `linear`'s)."""
    pytest.importorskip("triton")
    ops = triton_kernel_ops()
    assert ops["_rms_norm_kernel"] == "rms_norm"
    assert ops["_decode_partition_kernel"] == "paged_decode_attention"
    assert ops["_gguf_gemv_kernel"] == "gguf_linear"
    assert ops["_moe_gate_up_kernel"] == "fused_moe"
    assert ops["_scaled_linear_kernel"] is None  # kiln.ops.gemm.scaled_triton: fp8_linear and int8_linear
    assert kiln_kernel_op("_rms_norm_kernel(float*, float*)", ops) == (True, "rms_norm")
    assert kiln_kernel_op("kiln_cpu::q4_blocks_gemv", ops) == (True, "prepared_linear")
    for gemv in ("q8_blocks_mins_a8_gemv", "kquants_a8_gemv", "kquants_a8_gemm", "quantize_q8_k"):  # a8's
        assert kiln_kernel_op(f"kiln_cpu::{gemv}", ops) == (True, "prepared_linear")
    assert kiln_kernel_op("kiln_cpu::paged_decode", ops) == (True, "paged_decode_attention")
    assert kiln_kernel_op("kiln_cpu::causal_attention", ops) == (True, None)  # two ops' kernel
    assert kiln_kernel_op("aten::_fused_rms_norm", ops) == (False, None)
    assert kiln_kernel_op("void gemm_kernel<128>", ops) == (False, None)


def test_public_op_calls_in_a_session_declare_their_case_once():
    """Every public op call while profiling runs in its kiln::<op> range with the case its arguments
    make, so a workload that never declared anything (the engine) gets rooflines; an op called inside
    another's call (prepared_linear's Triton path through linear) is the outer op's."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 96, generator=g), torch.randn(96, generator=g)
    q, k = torch.randn(5, 4, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    cache = kiln.ops.rope_cos_sin_cache(32, 64)
    positions = torch.randint(0, 64, (5,), generator=g)

    def step():
        kiln.ops.rms_norm(x, w)
        kiln.ops.qk_norm_rope(positions, q, k, torch.ones(32), torch.ones(32), cache)
        with kiln.profile.range("kiln::softmax", op="softmax", shape={"rows": 7, "cols": 96}, dtype=x.dtype):
            kiln.ops.softmax(kiln.ops.rms_norm(x, w))  # as an implementation calling public ops

    cpu = torch.device("cpu")
    report = profile_callable(step, cpu, steps=2, ceilings=measure_ceilings(cpu))
    assert report.ops["rms_norm"]["calls"] == 2
    assert report.ops["qk_norm_rope"]["calls"] == 2
    assert report.ops["softmax"]["calls"] == 2
    assert set(report.ops) == {"rms_norm", "qk_norm_rope", "softmax"}
    for entry in report.ops.values():
        assert entry["time_us"] > 0 and entry["fraction"] is not None and entry["fraction"] > 0
    with kiln.profile.session() as work:
        kiln.ops.rms_norm(x, w)
    assert work == [("rms_norm", {"rows": 7, "hidden": 96, "residual": False}, torch.float32)]
    kiln.ops.rms_norm(x, w)  # the observer goes with the session
    assert work == [("rms_norm", {"rows": 7, "hidden": 96, "residual": False}, torch.float32)]


def test_an_aten_kernel_outside_any_op_call_is_no_ops_and_a_ranges_own_time_is_python():
    x = torch.randn(64, 64)

    def step():
        with kiln.profile.range("phase"):
            torch.softmax(x, dim=-1)  # named like a registered op, but not a call of it

    report = profile_callable(step, torch.device("cpu"), steps=1)
    assert {k.op for k in report.kernels} == {None}
    assert any(k.name == "phase" for k in report.kernels)


def test_profile_of_cpu_rms_norm_has_kernel_table_roofline_and_trace(tmp_path):
    trace = tmp_path / "trace.json"
    report = profile_op("rms_norm", SHAPE, torch.float32, torch.device("cpu"), steps=3, trace=str(trace))
    assert report.kernels and report.total_us > 0
    assert abs(sum(k.share for k in report.kernels) - 1.0) < 1e-6
    entry = report.ops["rms_norm"]
    assert entry["calls"] == 3 and entry["time_us"] > 0 and 0 < entry["fraction"] <= 1.0
    mapped = [k for k in report.kernels if k.op == "rms_norm"]
    assert any("rms_norm" in k.name for k in mapped)
    # everything ran inside the kiln::rms_norm ranges, so every kernel but the range's own Python
    # maps to the op
    assert {k.name for k in report.kernels if k.op is None} <= {"kiln::rms_norm"}
    assert len(mapped) >= len(report.kernels) - 1
    for k in mapped:
        assert k.gap_us == k.total_us * (1 - entry["fraction"])
    gaps = format_gaps(report)
    assert "cumulative gap" in gaps and "kernel" in format_kernels(report)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "kiln::rms_norm" for e in events)


def test_kernels_outside_any_declared_op_rank_by_their_whole_time():
    x = torch.randn(200, 200)

    def step():
        with kiln.profile.range("my_phase"):
            torch.mm(x, x)

    report = profile_callable(step, torch.device("cpu"), steps=2)
    mm = next(k for k in report.kernels if k.name == "aten::mm")
    assert mm.calls == 2 and mm.fraction is None and mm.gap_us == mm.total_us


def test_profile_command_prints_tables_and_writes_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    rc = main(
        ["profile", "--op", "rms_norm", "--shape", json.dumps(SHAPE), "--steps", "2", "--trace", str(trace)]
    )
    out = capsys.readouterr().out
    assert rc == 0 and trace.exists()
    assert "% roofline" in out and "utilization gaps" in out and "rms_norm" in out


def test_profile_command_rejects_unknown_op(capsys):
    assert main(["profile", "--op", "no_such_op"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_engine_profile_without_the_engine_module_exits_2(monkeypatch, capsys):
    import sys

    from kiln.cli import build_parser

    build_parser()  # the subcommands' parsers import the engine's flag modules: that part is not tested

    monkeypatch.setitem(sys.modules, "kiln.engine", None)  # import now raises ModuleNotFoundError
    assert main(["profile", "--engine"]) == 2
    assert "kiln.engine is not available" in capsys.readouterr().err


def test_declared_op_range_beats_the_kernel_name():
    x = torch.randn(64, 64)

    def step():
        with kiln.profile.range("kiln::rms_norm"):
            torch.softmax(x, dim=-1)  # "softmax" is a registered op name, but this call belongs to rms_norm

    report = profile_callable(step, torch.device("cpu"), steps=1)
    assert {k.op for k in report.kernels if "softmax" in k.name} == {"rms_norm"}


def test_an_fp8_or_int8_gemm_is_bounded_by_its_operands_matmul_peak():
    """kiln profile held fp8 / int8 GEMMs to the peak of their output dtype (2x too low a bound on an
    H100: 133% of roofline where kiln bench said 67%); it uses OpSpec.peak_dtype as kiln bench does."""
    from types import SimpleNamespace

    from kiln.bench.ceilings import Ceilings
    from kiln.ops import all_ops
    from kiln.profile.profiler import build_report

    peaks = {"bfloat16": 750.0, "float32": 50.0, "float8_e4m3fn": 1500.0, "int8": 1500.0}
    ceilings = Ceilings("H100-like", 3000.0, peaks)
    shape = {"M": 8192, "N": 28672, "K": 4096, "per_token": True}
    for op in ("fp8_linear", "int8_linear"):
        spec = all_ops()[op]
        work = [(op, shape, torch.bfloat16)]
        report = build_report(SimpleNamespace(events=lambda: []), work, torch.device("cpu"), ceilings)
        bound = max(
            spec.flops(shape, torch.bfloat16) / ceilings.peak_flops(spec.peak_dtype(shape, torch.bfloat16)),
            spec.bytes(shape, torch.bfloat16) / ceilings.peak_bandwidth,
        )
        assert spec.peak_dtype(shape, torch.bfloat16) != torch.bfloat16
        assert abs(report.ops[op]["bound_us"] - bound * 1e6) <= 1e-9 * bound * 1e6
