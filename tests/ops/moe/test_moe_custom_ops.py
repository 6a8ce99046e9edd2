import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ops
from kiln.ops.moe.fused_moe import quantize_experts_fp8
from kiln.verify import assert_close

MOE_OPS = ("moe_route", "fused_moe")


def _inputs(device, fp8=False):
    generator = torch.Generator().manual_seed(7)
    inputs = {
        "x": torch.randn(9, 40, generator=generator).to(device),
        "w_gate_up": (torch.randn(5, 2 * 24, 40, generator=generator) / 40**0.5).to(device),
        "w_down": (torch.randn(5, 40, 24, generator=generator) / 24**0.5).to(device),
        "router_logits": torch.randn(9, 5, generator=generator).to(device),
    }
    if fp8:
        inputs["w_gate_up"], inputs["w_gate_up_scale"] = quantize_experts_fp8(inputs["w_gate_up"])
        inputs["w_down"], inputs["w_down_scale"] = quantize_experts_fp8(inputs["w_down"])
    return inputs


def _moe_layer(router_logits, x, w_gate_up, w_down, w_gate_up_scale=None, w_down_scale=None):
    weights, ids = torch.ops.kiln.moe_route(router_logits, 2, True, "softmax")
    return torch.ops.kiln.fused_moe(x, w_gate_up, w_down, weights, ids, w_gate_up_scale, w_down_scale) * 2.0


def _eager_layer(router_logits, x, w_gate_up, w_down, w_gate_up_scale=None, w_down_scale=None):
    weights, ids = kiln.ops.moe_route(router_logits, 2)
    return kiln.ops.fused_moe(x, w_gate_up, w_down, weights, ids, w_gate_up_scale, w_down_scale) * 2.0


def test_moe_ops_are_reachable_under_torch_ops_kiln():
    for name in MOE_OPS:
        assert hasattr(torch.ops.kiln, name), name


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_moe_custom_ops_match_the_plain_functions(backend, fp8, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    inputs = _inputs(device, fp8)
    assert_close(_moe_layer(**inputs), _eager_layer(**inputs), 1e-6)


def test_torch_compile_fullgraph_traces_through_the_moe_ops():
    torch._dynamo.reset()
    compiled = torch.compile(_moe_layer, fullgraph=True, backend="aot_eager")
    inputs = _inputs("cpu")
    assert_close(compiled(**inputs), _eager_layer(**inputs), 1e-6)  # a graph break raises here


def test_moe_fakes_give_shapes_and_dtypes_and_validate():
    with FakeTensorMode():
        logits = torch.empty(7, 8, dtype=torch.bfloat16)
        weights, ids = torch.ops.kiln.moe_route(logits, 2, True, "softmax")
        x = torch.empty(7, 64, dtype=torch.bfloat16)
        out = torch.ops.kiln.fused_moe(
            x, torch.empty(8, 96, 64, dtype=torch.bfloat16), torch.empty(8, 64, 48, dtype=torch.bfloat16),
            weights, ids, None, None,
        )  # fmt: skip
        with pytest.raises(ValueError, match="w_down has shape"):
            torch.ops.kiln.fused_moe(x, torch.empty(8, 96, 64, dtype=torch.bfloat16),
                                     torch.empty(8, 64, 47, dtype=torch.bfloat16), weights, ids)  # fmt: skip
    assert weights.shape == ids.shape == (7, 2)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16


def test_opcheck_fused_moe_and_moe_route():
    inputs = _inputs("cpu")  # opcheck's schema test cannot compare float8 tensors
    torch.library.opcheck(torch.ops.kiln.moe_route.default, (inputs["router_logits"], 3, False, "sigmoid"))
    weights, ids = kiln.ops.moe_route(inputs["router_logits"], 2)
    args = (inputs["x"], inputs["w_gate_up"], inputs["w_down"], weights, ids,
            inputs.get("w_gate_up_scale"), inputs.get("w_down_scale"))  # fmt: skip
    torch.library.opcheck(torch.ops.kiln.fused_moe.default, args)
