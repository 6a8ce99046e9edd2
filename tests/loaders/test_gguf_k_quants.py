"""A tiny Llama GGUF whose matrices are GGUF K-quants (Q4_K, Q5_K, Q6_K, the tensor types of a Q4_K_M
file): Kiln keeps them as blocks and matches transformers loading the same file (transformers
dequantizes with the `gguf` package, the reference we did not write).

The gguf package cannot encode K-quants, so the file's blocks come from Kiln's round-to-nearest encoder
(tests/loaders/gguf_tiny.py); the reference never reads them through Kiln's decoder. Hidden and
intermediate sizes are multiples of 256 (one super-block holds 256 inputs)."""

import logging

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from kiln.loaders.gguf import load_gguf  # noqa: E402
from kiln.models import LlamaForCausalLM  # noqa: E402
from tests.loaders.gguf_tiny import tiny_gguf_with_reference  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402

PROMPT = [3, 17, 29, 4, 4, 60, 11, 2, 45, 31, 8]
# Kiln decodes the blocks to the same float32 values as gguf (bit-exact), so against transformers in
# float32 only the summation order differs: a few float32 roundings per dot product, ~1e-6 relative.
TOL = 1e-5
# Every matrix a K-quant (the fused q/k/v and gate/up rows share a type, so they stay one block matrix).
K_QUANT_TYPES = {
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q5_K,
    "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q4_K,
}  # fmt: skip
LAYOUTS = {
    "qkv": "gguf_Q4_K", "o": "gguf_Q5_K", "gate_up": "gguf_Q5_K", "down": "gguf_Q6_K", "head": "gguf_Q4_K",
}  # fmt: skip


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """(path of the file, transformers' model loaded from it, its float32 logits over PROMPT)."""
    folder = tmp_path_factory.mktemp("k_quants")
    return tiny_gguf_with_reference(folder, "tiny-k.gguf", K_QUANT_TYPES, PROMPT, seed=3)


def _layouts(model) -> dict[str, str]:
    layer = model.layers[0]
    return {
        "qkv": layer.self_attn.qkv_proj.prepared.layout,
        "o": layer.self_attn.o_proj.prepared.layout,
        "gate_up": layer.mlp.gate_up_proj.prepared.layout,
        "down": layer.mlp.down_proj.prepared.layout,
        "head": model.lm_head.prepared.layout,
    }


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())


def test_k_quant_gguf_kept_as_blocks_matches_transformers_loading_the_same_file(k_quant_gguf):
    path, ref_model, ref = k_quant_gguf
    config, weights, _, _ = load_gguf(str(path))
    # "gguf": every matrix stays the file's blocks and runs on gguf_linear (as on CUDA)
    model = LlamaForCausalLM(config, weights, cpu_format="gguf", lm_head_format="gguf")
    assert _layouts(model) == LAYOUTS
    assert all(model.layers[i].mlp.down_proj.format == "gguf" for i in range(config.num_layers))
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL
    with torch.no_grad():
        theirs = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy(model, PROMPT, 6, block_size=4) == theirs[0, len(PROMPT) :].tolist()


def test_k_quant_gguf_default_cpu_path_dequantizes_once_at_load_and_says_so(k_quant_gguf, caplog):
    from kiln.ops.gemm import weight_formats

    weight_formats._log_dequantized_at_load.cache_clear()  # logged once a process: other tests' loads
    path, _, ref = k_quant_gguf
    config, weights, _, _ = load_gguf(str(path))
    with caplog.at_level(logging.INFO, logger="kiln.ops.gemm.weight_formats"):
        model = LlamaForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32")
    assert {model.layers[0].mlp.down_proj.format, model.lm_head.format} == {"dense"}
    logged = caplog.text
    assert "GGUF Q6_K weights on cpu: dequantized once at load to fp32" in logged, logged
    assert "GGUF Q4_K weights on cpu" in logged and "GGUF Q5_K weights on cpu" in logged
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL


def test_k_quant_gguf_int4_cpu_format_packs_q4_k_and_stays_close(k_quant_gguf):
    path, _, ref = k_quant_gguf
    config, weights, _, _ = load_gguf(str(path))
    model = LlamaForCausalLM(config, weights, cpu_format="int4", lm_head_format="int4")
    assert model.layers[0].self_attn.qkv_proj.format == "int4"  # Q4_K sub-blocks as int4 groups of 32
    assert model.lm_head.format == "int4"
    assert model.layers[0].mlp.down_proj.format == "dense"  # Q6_K: no 4-bit packing, dense
    # bf16 activations (cpu_format "bf16" alone: ~3e-2 on this model) and a bf16 (scale, zero) per
    # group of 32 (zero = 8 d*sc - dmin*m rounds at 2^-9 of its size): measured 5.8e-2
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < 1e-1


@pytest.mark.gpu
def test_k_quant_gguf_on_cuda_runs_the_blocks_in_planes(k_quant_gguf):
    """On CUDA every K-quant matrix is repacked at load into planes (the same values bit for bit:
    kiln.ops.gemm.gguf_planar) and runs on their Triton GEMM; float32 as close to transformers as the
    CPU's blocks."""
    path, _, ref = k_quant_gguf
    config, weights, _, _ = load_gguf(str(path))
    planar = {name: layout.replace("gguf_", "gguf_planar_") for name, layout in LAYOUTS.items()}
    # fp16 / bf16: 2^-11 / 2^-8 activation roundings
    for dtype, tol in ((torch.float32, TOL), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)):
        model = LlamaForCausalLM(config, weights, device="cuda", dtype=dtype)
        assert _layouts(model) == planar
        out = prompt_logits(model, PROMPT, block_size=4).cpu()
        assert _relative_error(out, ref) < tol, dtype


def test_k_quant_gguf_in_the_exact_blocks_format_keeps_every_matrix_as_blocks(k_quant_gguf):
    """cpu_format "q8_blocks": Q4_K in the Q4 blocks layout, Q5_K as q with d * sc and its min per 32,
    Q6_K as q - 32 with d * sc per 16; float32 arithmetic on the exact weights."""
    path, ref_model, ref = k_quant_gguf
    config, weights, _, _ = load_gguf(str(path))
    model = LlamaForCausalLM(config, weights, cpu_format="q8_blocks", lm_head_format="q8_blocks")
    layouts = _layouts(model)
    if "onednn" in layouts.values() or "dense" in layouts.values():
        pytest.skip(f"oneDNN does not pack float32 here: {layouts}")
    q4, q8, q8m = "q4_blocks_onednn", "q8_blocks_onednn", "q8_blocks_mins_onednn"
    assert layouts == {"qkv": q4, "o": q8m, "gate_up": q8m, "down": q8, "head": q4}
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL
    with torch.no_grad():
        theirs = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy(model, PROMPT, 6, block_size=4) == theirs[0, len(PROMPT) :].tolist()


# A Q4_K_M-like file: Q4_K matrices, Q6_K down_proj and embedding (llama.cpp's choice for them)
Q4_K_M_TYPES = {
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q6_K,
}  # fmt: skip


@pytest.mark.parametrize("attn_v", ["Q4_K", "Q6_K"])
def test_q4_k_m_gguf_in_the_exact_blocks_format_keeps_q4_k_and_q6_k_as_blocks(tmp_path, attn_v):
    """cpu_format "q4_blocks" (what the probe picks among for a model's layers) keeps Q4_K in the Q4
    blocks layout and Q6_K as its int8 values with d * sc per 16 ("q8_blocks_onednn"; it was the
    float32 fallback); where llama.cpp gives v more bits (attn_v Q6_K beside Q4_K q and k, half a
    Q4_K_M file's layers) the fused QKV is a stacked weight, values with a scale and a min per 16
    ("q8_blocks_mins_onednn"; it was dequantized to float32). Exact: the engine (its one-call native
    decode over every layer, one and 17 sequences) gives transformers' greedy tokens and float32-close
    logits."""
    from kiln.engine import LLM, SamplingParams

    types = {**Q4_K_M_TYPES, "attn_v": Q[attn_v]}
    _, ref_model, ref = tiny_gguf_with_reference(tmp_path, "tiny-q4km.gguf", types, PROMPT, seed=5)
    config, weights, _, _ = load_gguf(str(tmp_path / "tiny-q4km.gguf"))
    model = LlamaForCausalLM(config, weights, cpu_format="q4_blocks", lm_head_format="q4_blocks")
    layouts = _layouts(model)
    if "onednn" in layouts.values() or "dense" in layouts.values():
        pytest.skip(f"oneDNN does not pack float32 here: {layouts}")
    qkv = "q4_blocks_onednn" if attn_v == "Q4_K" else "q8_blocks_mins_onednn"
    assert layouts == {"qkv": qkv, "o": "q4_blocks_onednn", "gate_up": "q4_blocks_onednn",
                       "down": "q8_blocks_onednn", "head": "q8_blocks_onednn"}  # fmt: skip
    if attn_v == "Q6_K":
        scales = model.layers[0].self_attn.qkv_proj.prepared.tensors[1]
        assert scales.shape[1] == config.hidden_size // 16  # a scale (and a min) per 16
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL
    # 17 sequences: where this build has tile kernels (AVX-512: Q4 from 8 rows, Q8_0 16 to 32) the Q4
    # layers' tiles run and Q6_K's down_proj (no tiles) its row kernel
    prompts = [PROMPT, PROMPT[3:]] + [[7, 7, 1 + i, 50 - i] for i in range(15)]
    with torch.no_grad():
        expected = [
            ref_model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
            for p in prompts
        ]
    expected = [e[len(p) :] for e, p in zip(expected, prompts, strict=True)]
    llm = LLM(model=str(tmp_path / "tiny-q4km.gguf"), device="cpu", num_kv_blocks=32, cpu_format="q4_blocks",
              lm_head_format="q4_blocks")  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [e.tolist() for e in expected]

    def tokens(outputs):  # as far as transformers went: it stops at an end-of-sequence token
        return [o.token_ids[: len(e)] for o, e in zip(outputs, expected[: len(outputs)], strict=True)]

    assert tokens(llm.generate(prompts[:1], params)) == expected[:1]
    assert tokens(llm.generate(prompts, params)) == expected
    assert llm.engine.runner.flat_decode is not None and llm.engine.runner.flat_decode.native is not None


def test_k_quant_gguf_decodes_in_the_native_flat_call_as_the_modules_and_transformers(
    k_quant_gguf, monkeypatch
):
    """cpu_format "q8_blocks": every decode step, of one sequence and of three, runs as the native
    one-call decode (kiln_cpu.FlatDecode; Q5_K's o and gate/up through the Q8 kernels given their mins):
    transformers' greedy tokens and float32-close logprobs (transformers on the same file, all positions
    at once), and the module path's logprobs bit for bit."""
    from kiln.engine import LLM, SamplingParams
    from kiln.models.cpu_flat_decode import FlatDecodeLayers
    from kiln.ops import native_cpu

    if not native_cpu.load():
        pytest.skip("Kiln's native CPU library is not built here")
    path, ref_model, _ = k_quant_gguf
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=32, max_num_seqs=3, enable_prefix_caching=False,
              cpu_format="q8_blocks", lm_head_format="q8_blocks")  # fmt: skip
    layouts = _layouts(llm.engine.runner.model)
    if "onednn" in layouts.values() or "dense" in layouts.values():
        pytest.skip(f"oneDNN does not pack float32 here: {layouts}")
    assert layouts["o"] == layouts["gate_up"] == "q8_blocks_mins_onednn"
    flat = llm.engine.runner.flat_decode
    assert flat is not None and flat.native is not None
    rows, call = [], FlatDecodeLayers.__call__

    def counted(flat, *args):  # the hidden rows of each step the flat loop takes
        rows.append(args[1].shape[0])
        return call(flat, *args)

    monkeypatch.setattr(FlatDecodeLayers, "__call__", counted)
    prompts = [PROMPT, PROMPT[3:], [7, 7, 1, 50]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

    def run() -> list:
        outputs = llm.generate(prompts[:1], params) + llm.generate(prompts, params)
        return [(out.token_ids, out.logprobs) for out in outputs]

    flat_outputs = run()
    assert rows.count(1) >= 5  # one sequence's steps, in the native call
    # three sequences' steps too where the blocks' multi-row kernels are built (AVX2, AVX-512)
    assert (3 in rows) == (native_cpu.blocks_gemm_rows() >= 3)
    for (tokens, logprobs), prompt in zip(flat_outputs, [prompts[0], *prompts], strict=True):
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + tokens])).logits[0].double()
        for i, (token, top) in enumerate(zip(tokens, logprobs, strict=True)):
            row = logits[len(prompt) - 1 + i]  # the logits that chose token i
            assert token == int(row.argmax()), (prompt, i)
            # a logprob is a logit less the log-sum-exp, each float32-close (TOL of the row's norm)
            error = max(abs(value - float(row.log_softmax(-1)[t])) for t, value in top.items())
            assert error < 2 * TOL * float(row.norm()), (prompt, i, error)
    rows.clear()
    llm.engine.runner.model.flat_decode = None  # the modules (the runner puts back only its own loop)
    assert run() == flat_outputs and not rows
