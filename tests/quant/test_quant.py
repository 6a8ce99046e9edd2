import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize as gguf_package_quantize  # noqa: E402

import kiln.quant as q  # noqa: E402


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_encoders_are_byte_identical_to_the_gguf_package(qtype):
    w = np.random.default_rng(0).standard_normal((11, 160)).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero block: scale 0 must not divide by zero
    w[:, 7] *= -25.0
    expected = gguf_package_quantize(w, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(q.quantize_blocks(torch.from_numpy(w), qtype).numpy(), expected)


def test_gguf_encoder_rejects_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        q.quantize_blocks(torch.randn(2, 40), "Q8_0")


@pytest.mark.parametrize("K", [1, 8, 13, 77])
def test_int4_pack_unpack_round_trip_low_nibble_first(K):
    values = torch.randint(0, 16, (5, K))
    packed = q.pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-K // 8))
    assert torch.equal(q.unpack_int4(packed, K), values.to(torch.uint8))
    # Element 8j + i lives in bits 4i..4i+3 of word j.
    assert ((packed[:, 0] >> 0) & 0xF).tolist() == values[:, 0].tolist()
    if K > 7:
        assert ((packed[:, 0] >> 28) & 0xF).tolist() == values[:, 7].tolist()


@pytest.mark.parametrize("group_size, K", [(32, 96), (64, 100), (128, 77)])
def test_int4_rtn_error_is_at_most_half_a_step_per_group(group_size, K):
    w = torch.randn(6, K) * 0.05 + 0.01
    qweight, scales, zeros = q.quantize_int4(w, group_size)
    assert scales.shape == zeros.shape == (6, -(-K // group_size))
    dq = q.dequantize_int4(qweight, scales, zeros, group_size, K)
    step = q.int4.expand_groups(scales.float(), group_size, K)
    # Half a step from rounding w / scale; up to one step where the rounded zero point makes the clamp bite.
    assert bool(((dq - w).abs() <= step * 1.0 + 1e-7).all())
    assert q.snr_db(w, dq) > 15.0


def test_per_channel_fp8_and_int8_quantizers_scale_each_row():
    w = torch.randn(8, 64) * torch.logspace(-3, 1, 8).unsqueeze(1)  # rows four decades apart
    w8, s8 = q.quantize_int8_per_channel(w)
    assert w8.dtype == torch.int8 and s8.shape == (8, 1)
    assert bool(((q.dequantize_per_channel(w8, s8) - w).abs() <= s8 / 2 + 1e-9).all())
    assert (w8.abs().amax(1) == 127).all()
    wf, sf = q.quantize_fp8_per_channel(w)
    assert wf.dtype == torch.float8_e4m3fn and (wf.float().abs().amax(1) == 448).all()
    assert q.snr_db(w, q.dequantize_per_channel(wf, sf)) > 25.0  # 3 mantissa bits ~ 31 dB


def test_error_metrics_on_known_perturbations():
    w = torch.randn(32, 48)
    exact = q.error_metrics(w, w)
    assert (
        exact["snr_db"] == math.inf
        and exact["cosine"] == pytest.approx(1.0)
        and exact["max_abs_error"] == 0.0
    )
    scaled = q.error_metrics(w, 1.1 * w)  # noise = 0.1 w: SNR exactly 20 dB, direction unchanged
    assert scaled["snr_db"] == pytest.approx(20.0, abs=1e-4)
    assert scaled["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert scaled["max_abs_error"] == pytest.approx(0.1 * w.abs().max().item(), rel=1e-5)
    assert q.cosine_similarity(w, -w) == pytest.approx(-1.0)


def test_quantization_report_orders_formats_by_bits():
    weights = {"attn_q": torch.randn(64, 256) * 0.02, "odd_k": torch.randn(16, 40)}
    report = q.quantization_report(weights)
    assert set(report["attn_q"]) == set(q.FORMATS)
    assert not {"Q4_0", "Q4_1", "Q8_0"} & set(report["odd_k"])  # GGUF needs K % 32 == 0
    snr = {fmt: m["snr_db"] for fmt, m in report["attn_q"].items()}
    assert snr["int8"] > snr["fp8"] > snr["int4_g32"] > snr["int4_g128"]
    assert snr["Q8_0"] > snr["Q4_1"]
    assert all(0.99 < m["cosine"] <= 1.0 + 1e-9 for m in report["attn_q"].values())


def test_quantization_report_rejects_non_matrix():
    with pytest.raises(ValueError, match="expected 2-D"):
        q.quantization_report({"norm": torch.randn(64)})


def test_quantize_weight_feeds_each_gemm():
    # The tensors quantize_weight returns are the GEMM's own arguments.
    import kiln.ops

    w, x = torch.randn(24, 64) / 8, torch.randn(3, 64)
    ref = x @ w.T
    int4 = q.quantize_weight(w, "int4_g32")
    assert q.snr_db(ref, kiln.ops.int4_linear(x, group_size=32, **int4)) > 15
    gguf_q = q.quantize_weight(w, "Q8_0")
    assert q.snr_db(ref, kiln.ops.gguf_linear(x, gguf_q["qweight"], "Q8_0")) > 35
    fp8 = q.quantize_weight(w, "fp8")
    x_fp8, x_scale = kiln.ops.quantize_fp8(x)
    assert (
        q.snr_db(
            ref, kiln.ops.fp8_linear(x_fp8, x_scale, fp8["w_fp8"], fp8["w_scale"], out_dtype=torch.float32)
        )
        > 20
    )
