"""`random:<preset>` models (kiln.loaders.random_weights): the tiny preset loads, matches transformers'
Llama on the same weights, is seeded, generates through LLM, and drives `kiln bench engine` and
`kiln profile --engine` without any model file. The 8B preset is checked on a GPU only."""

import json
from dataclasses import replace

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cli import main as kiln_main
from kiln.loaders import load_model
from kiln.loaders.random_weights import (
    PRESETS,
    RandomTokenizer,
    parse_random_spec,
    random_tensor,
    random_weights,
)
from kiln.models import ModelLoadError
from kiln.profile.engine_step import kernel_shares, kiln_triton_kernel_names
from kiln.profile.profiler import KernelRow, ProfileReport
from tests.models.helpers import prompt_logits

PROMPT = [17, 200, 3, 45, 45, 9, 311, 128, 64, 1, 250, 33, 90]  # 13 tokens, crosses 8-token blocks
# float32 Kiln vs the float64 transformers reference on the same (float32) weights: float32 rounding
# through 2 layers.
TOL = 1e-5


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def test_tiny_loads_with_the_preset_shapes_and_llama_tensor_names():
    loaded = load_model("random:tiny")
    c, preset = loaded.config, PRESETS["tiny"]
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (2, 64, 4, 2)
    assert c.vocab_size == preset.vocab_size == loaded.tokenizer.vocab_size
    assert c.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.model.lm_head.compute_dtype == torch.float32
    assert parse_random_spec("random:tiny-1l:seed=3") == ("tiny", replace(preset, num_layers=1), 3)
    assert len(load_model("random:tiny-1l").model.layers) == 1


def test_tiny_logits_match_transformers_llama_in_float64_on_the_same_weights():
    transformers = pytest.importorskip("transformers")
    loaded = load_model("random:tiny:seed=5")
    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hf_config).double().eval()
    store = random_weights(c, 5, torch.device("cpu"), torch.float32)
    state = {name: store.get(name, tuple(p.shape)).double() for name, p in hf.state_dict().items()}
    assert set(store.names()) == set(state)  # the same tensor names as an HF Llama checkpoint
    hf.load_state_dict(state)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = prompt_logits(loaded.model, PROMPT, block_size=8)
    assert torch.isfinite(out).all()
    assert _rel_l2(out, ref).max() < TOL
    assert out.std(dim=-1).min() > 1e-3  # not degenerate: the tokens' logits differ


def test_same_seed_same_weights_and_logits_other_seed_differs():
    first = prompt_logits(load_model("random:tiny").model, PROMPT)
    again = prompt_logits(load_model("random:tiny:seed=0").model, PROMPT)
    other = prompt_logits(load_model("random:tiny:seed=1").model, PROMPT)
    assert torch.isfinite(first).all() and torch.isfinite(other).all()
    assert torch.equal(first, again)
    assert _rel_l2(other, first).min() > 0.1
    # drawn directly in the requested dtype; norms ~1, matrices std ~0.02
    norm = random_tensor("model.norm.weight", (4096,), 0, torch.device("cpu"), torch.bfloat16)
    matrix = random_tensor("lm_head.weight", (256, 256), 0, torch.device("cpu"), torch.bfloat16)
    assert norm.dtype == matrix.dtype == torch.bfloat16
    assert abs(norm.float().mean().item() - 1.0) < 0.01
    assert 0.015 < matrix.float().std().item() < 0.025


def test_llm_generates_n_tokens_deterministically_for_a_seed():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [LLM("random:tiny").generate([PROMPT, PROMPT[:5]], params) for _ in range(2)]
    other = LLM("random:tiny:seed=2").generate([PROMPT, PROMPT[:5]], params)
    assert [len(o.token_ids) for o in outs[0]] == [6, 6]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.token_ids for o in outs[0]] != [o.token_ids for o in other]
    assert outs[0][0].text == "".join(f"<{t}>" for t in outs[0][0].token_ids)


def test_tokenizer_stand_in_round_trips_ids():
    tokenizer = RandomTokenizer(320)
    ids = [0, 7, 255, 318]
    assert tokenizer.encode(tokenizer.decode(ids)) == ids
    assert tokenizer.encode("hi<7>") == [ord("h"), ord("i"), 7]
    assert tokenizer.decode([5, 319]) == "<5>"  # EOS (the last id) is special
    assert tokenizer.decode([5, 319], skip_special_tokens=False) == "<5><319>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.encode("<320>")
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("spec", ["random:llama-9b", "random:", "random:tiny:seed=x", "random:tiny-0l"])
def test_unknown_or_malformed_spec_raises_model_load_error_listing_presets(spec):
    with pytest.raises(ModelLoadError) as info:
        load_model(spec)
    assert spec in str(info.value)
    if not spec.endswith("-0l"):
        assert "random:llama3-8b" in str(info.value) and "random:tiny" in str(info.value)


def test_bench_engine_on_random_tiny_has_kiln_rows_and_skips_hf(tmp_path, capsys):
    path = tmp_path / "engine.json"
    argv = ["bench", "engine", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "4"]
    argv += ["--concurrency", "1,2", "--num-prompts", "2", "--prompt-len", "8", "--json", str(path)]
    assert kiln_main(argv) == 0  # the default --hf-batches 1,16 must be skipped, not tried
    report = json.loads(path.read_text())
    systems = {r["system"] for r in report["results"]}
    assert systems == {"kiln"}
    rows = {(r["scenario"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {("single-stream", 1), ("concurrent", 2), ("offline", 2), ("ttft", 1)}
    runs = [r for (scenario, _), r in rows.items() if scenario != "ttft"]
    assert all(r["output_tokens"] == 4 * r["concurrency"] and r["tok_per_s"] > 0 for r in runs)
    assert rows["ttft", 1]["ttft_ms"] > 0  # a 270-token prompt (the default --ttft-prompt-len)
    assert "skipping HF transformers" in capsys.readouterr().err


def test_profile_engine_on_random_tiny_reports_decode_rate_and_kiln_share(capsys):
    assert (
        kiln_main(["profile", "--engine", "--model", "random:tiny", "--batch", "2", "--device", "cpu"]) == 0
    )
    out = capsys.readouterr().out
    assert "decode step at batch 2" in out
    assert "kernel time in Kiln kernels (Triton)" in out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_eager_engine_profile_puts_the_decode_steps_ops_on_the_roofline(device):
    """Every op call of the step declares its case (CUDA graphs, which declare nothing, are off)."""
    from kiln.profile.engine_step import profile_engine_step

    profile = profile_engine_step("random:tiny", batch=2, device=device, timed_steps=1, eager=True)
    ops = profile.report.ops
    assert {"paged_decode_attention", "rms_norm", "prepared_linear"} <= set(ops)
    for op in ("paged_decode_attention", "rms_norm", "prepared_linear"):
        assert ops[op]["calls"] > 0 and ops[op]["time_us"] > 0 and ops[op]["fraction"] > 0, op


def test_kernel_shares_count_kiln_triton_kernels_by_name():
    names = kiln_triton_kernel_names()
    assert {"_rms_norm_kernel", "_write_kv_cache_kernel"} <= names
    report = ProfileReport(
        "cuda",
        [
            KernelRow("_rms_norm_kernel", 2, 30.0, op="rms_norm"),
            KernelRow("sm90_xmma_gemm_bf16bf16", 1, 60.0, op="linear"),
            KernelRow("Memcpy DtoD", 1, 10.0),
        ],
        total_us=100.0,
    )
    kiln_share, op_share = kernel_shares(report, names)
    assert kiln_share == pytest.approx(0.3)
    assert op_share == pytest.approx(0.9)


@pytest.mark.gpu
def test_llama3_8b_preset_builds_on_cuda_without_a_second_copy_of_the_weights():
    """Two layers of the 8B preset on CUDA: peak memory stays near the weights' own size (no CPU
    copy, no doubled GPU memory), logits finite and not degenerate."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    loaded = load_model("random:llama3-8b-2l", device="cuda")
    c = loaded.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (4096, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (
        14336,
        128256,
        500000.0,
        1e-5,
    )
    per_layer = 2 * c.hidden_size * (c.num_heads + c.num_kv_heads) * c.head_dim + 3 * c.hidden_size * 14336
    weight_bytes = 2 * (2 * c.vocab_size * c.hidden_size + 2 * per_layer)  # bf16
    peak = torch.cuda.max_memory_allocated(device) - before
    # the largest transient is one fused gate/up matrix and its two halves
    assert peak < weight_bytes + 4 * 2 * c.intermediate_size * c.hidden_size
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    logits = prompt_logits(loaded.model, PROMPT)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.1
