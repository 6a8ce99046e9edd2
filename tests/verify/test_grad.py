"""`kiln verify --grad`: every registered backward passes against float64 autograd of its reference,
and a wrong backward (scaled by 1.01, one input's gradient off, a gradient left unwritten) fails."""

import json

import pytest
import torch

import kiln.ops.autograd.gated_backward as gated_backward
import kiln.ops.autograd.norm_backward as norm_backward
import kiln.ops.autograd.softmax_backward as softmax_backward
from kiln.cli import main
from kiln.ops.alloc import empty_like
from kiln.verify.grad import verify_grad
from kiln.verify.grad_ops import GRAD_OPS


@pytest.mark.parametrize("op", list(GRAD_OPS))
def test_every_backward_passes_on_the_cpu_path(op):
    rows = verify_grad([op], ["cpu"], device="cpu")
    assert rows and all(r.passed for r in rows), [
        (r.input, r.dtype, r.failures) for r in rows if not r.passed
    ]
    assert {r.input for r in rows} == set(GRAD_OPS[op].wrt)  # one row per differentiated input


@pytest.mark.parametrize("op", ["silu_and_mul", "softmax", "layer_norm"])
def test_triton_backward_passes(op, device):  # interpreted on the CPU, compiled on a GPU
    rows = verify_grad([op], ["triton"], ["float32", "float16"], device=device, max_shapes=3)
    assert rows and all(r.passed for r in rows), [
        (r.input, r.dtype, r.failures) for r in rows if not r.passed
    ]


def test_cli_writes_json_and_exits_zero(tmp_path):
    path = tmp_path / "grad.json"
    argv = [
        "verify",
        "--grad",
        "--op",
        "rms_norm",
        "--backend",
        "cpu",
        "--device",
        "cpu",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    payload = json.loads(path.read_text())
    assert payload["kind"] == "kiln-verify-grad"
    rows = payload["rows"]
    assert {r["input"] for r in rows} == {"x", "weight", "residual"}
    assert all(r["passed"] and r["cases"] > 0 for r in rows)
    # the one-value norm is reported as excluded, not silently dropped
    assert any(e["shape"]["hidden"] == 1 for e in rows[0]["excluded"])


def test_backward_scaled_by_1_01_fails(monkeypatch, capsys):
    right = gated_backward.gated_backward_torch
    monkeypatch.setattr(gated_backward, "gated_backward_torch", lambda *a: right(*a) * 1.01)
    argv = ["verify", "--grad", "--op", "silu_and_mul", "--backend", "cpu", "--dtype", "float32"]
    assert main(argv) == 1
    assert "FAIL" in capsys.readouterr().out


def test_one_wrong_input_gradient_fails_only_that_input(monkeypatch):
    right = norm_backward.rms_norm_backward_torch

    def weight_gradient_off(*args):
        grad_x, grad_weight = right(*args)
        return grad_x, grad_weight * 1.01

    monkeypatch.setattr(norm_backward, "rms_norm_backward_torch", weight_gradient_off)
    rows = {r.input: r for r in verify_grad(["rms_norm"], ["cpu"], ["float32"], device="cpu")}
    assert not rows["weight"].passed
    assert rows["x"].passed and rows["residual"].passed


def test_unwritten_gradient_fails(monkeypatch):
    # a backward that returns its output buffer without writing it: poisoned (NaN), never passes
    monkeypatch.setattr(softmax_backward, "softmax_backward_torch", lambda y, g, t: empty_like(y))
    (row,) = verify_grad(["softmax"], ["cpu"], ["float32"], device="cpu", max_shapes=2)
    assert not row.passed and row.worst_error == float("inf")


def test_unknown_op_is_a_value_error():
    with pytest.raises(ValueError, match="no backward for op"):
        verify_grad(["linear"], ["cpu"], device="cpu")


def test_different_seeds_draw_different_inputs():
    # two runs without a seed draw different inputs: the check is not a fixed, memorized case
    a = verify_grad(["silu_and_mul"], ["cpu"], ["float32"], device="cpu", max_shapes=1, seed=1)
    b = verify_grad(["silu_and_mul"], ["cpu"], ["float32"], device="cpu", max_shapes=1, seed=2)
    assert a[0].worst_error != b[0].worst_error
    assert torch.isfinite(torch.tensor([a[0].worst_error, b[0].worst_error])).all()


def test_one_wrong_gradient_element_cannot_hide_in_the_norm(monkeypatch):
    """One element of a large gradient zeroed (a tenth of the largest): the norm error stays within
    the bound on large inputs, the max-error bound (twice it) catches it, as in the forward verifier."""
    right = gated_backward.gated_backward_torch

    def drops_an_element(*args):
        grad = right(*args)
        flat = grad.view(-1)
        nearest = (flat.abs() - 0.1 * flat.abs().max()).abs().argmin()
        flat[nearest] = 0
        return grad

    monkeypatch.setattr(gated_backward, "gated_backward_torch", drops_an_element)
    rows = verify_grad(["silu_and_mul"], ["cpu"], ["float32"], device="cpu")
    assert not rows[0].passed
    failures = [f["failure"] for f in rows[0].failures]
    assert any("max |g - g_ref|" in failure for failure in failures)
