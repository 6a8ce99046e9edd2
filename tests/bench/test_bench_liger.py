"""`kiln bench --backward`'s Liger-Kernel baselines: recorded as skipped, with the reason, when the
package is absent or the device is not CUDA; with it present, its functional API is called with the
spec's inputs (a stand-in module here: Liger's kernels need a GPU)."""

import importlib
import importlib.util
import json
import types

import pytest
import torch
import torch.nn.functional as F

import kiln.bench.backward_liger as backward_liger
from kiln.bench.backward import bench_backward_case, format_backward_table, resolve_backward_cases

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _liger_installed(monkeypatch, installed: bool):
    real = importlib.util.find_spec
    fake_spec = types.SimpleNamespace(name="liger_kernel")
    monkeypatch.setattr(
        backward_liger.importlib.util,
        "find_spec",
        lambda name, *a: (fake_spec if installed else None) if name == "liger_kernel" else real(name, *a),
    )


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "fused_linear_cross_entropy"])
def test_absent_liger_is_reported_as_not_installed(monkeypatch, op):
    _liger_installed(monkeypatch, False)
    assert backward_liger.liger_baselines(op, CUDA) == ({}, {"liger_kernel": "liger_kernel not installed"})


def test_installed_liger_off_cuda_is_reported_as_needing_cuda(monkeypatch):
    _liger_installed(monkeypatch, True)
    runnable, skipped = backward_liger.liger_baselines("rms_norm", CPU)
    assert runnable == {} and skipped["liger_kernel"].startswith("needs CUDA")


def test_an_op_liger_lacks_gets_no_entry():
    assert backward_liger.liger_baselines("softmax", CUDA) == ({}, {})
    assert backward_liger.liger_baselines("flash_attention_with_lse", CUDA) == ({}, {})


def test_the_bench_record_and_table_carry_the_skip_reason(monkeypatch):
    _liger_installed(monkeypatch, False)
    shape = json.dumps({"rows": 9, "hidden": 64})
    (case,) = resolve_backward_cases(["rms_norm"], "llm", shape, ["float32"], CPU)
    record = bench_backward_case(case, CPU, compile_baseline=False, timing_kwargs={"reps": 3})
    assert record["error"] is None, record["error"]
    assert record["baselines"]["liger_kernel"] == {"skipped": "liger_kernel not installed"}
    assert "speedup" in record["baselines"]["torch_eager"]
    assert "| skipped |" in format_backward_table([record])


def test_with_liger_present_on_cuda_its_functional_api_is_called(monkeypatch):
    calls = []

    def rms_norm(x, w, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls.append(("liger_rms_norm", in_place))
        return F.rms_norm(x, (x.shape[-1],), w + offset, eps)

    def fused_add(x, r, w, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls.append(("liger_fused_add_rms_norm", in_place))
        return F.rms_norm(x + r, (x.shape[-1],), w + offset, eps), x + r

    functional = types.SimpleNamespace(liger_rms_norm=rms_norm, liger_fused_add_rms_norm=fused_add)
    _liger_installed(monkeypatch, True)
    real_import = importlib.import_module
    monkeypatch.setattr(
        backward_liger.importlib,
        "import_module",
        lambda name: functional if name == "liger_kernel.transformers.functional" else real_import(name),
    )
    runnable, skipped = backward_liger.liger_baselines("rms_norm", CUDA)
    assert skipped == {} and set(runnable) == {"liger_kernel"}
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    (y,) = runnable["liger_kernel"](x=x, weight=w, eps=1e-6, weight_offset=1.0)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), w + 1.0, 1e-6))
    y, s = runnable["liger_kernel"](x=x, weight=w, eps=1e-6, residual=r)
    torch.testing.assert_close(s, x + r)
    # never in place: the bench reuses its upstream gradients across calls
    assert calls == [("liger_rms_norm", False), ("liger_fused_add_rms_norm", False)]
    del functional.liger_fused_add_rms_norm  # an older Liger without the fused residual norm
    assert backward_liger.liger_baselines("rms_norm", CUDA)[1] == {
        "liger_kernel": "this liger_kernel version lacks liger_fused_add_rms_norm"
    }
