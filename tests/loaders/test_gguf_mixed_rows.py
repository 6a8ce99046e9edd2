"""A fused projection whose GGUF parts mix Q4_0 / Q5_0 with Q8_0 (a Q4_K_M file of a model whose rows
are not a multiple of 256, e.g. Gemma 3 270M: q and k Q5_0, v Q8_0) stays blocks: the parts become
Q8_0 exactly (GGUFWeight.as_q8_0) and stack, instead of being dequantized; the CPU format probe times
the exact blocks formats for such a file's layers. Parts with no exact common GGUF type (a Q4_K_M
file's Q4_K q / k beside a Q6_K v) stack as a GGUFStackedWeight: int8 values with a scale and a min per
16 or 32, exact. References: the `gguf` package's decoder and transformers loading the same file."""

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from kiln.loaders import cpu_format_probe  # noqa: E402
from kiln.loaders.gguf import load_gguf  # noqa: E402
from kiln.models import LlamaForCausalLM  # noqa: E402
from kiln.models.weights import cat_rows  # noqa: E402
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix  # noqa: E402
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight, quantize_blocks  # noqa: E402
from tests.loaders.gguf_tiny import tiny_gguf_with_reference  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402
from tests.ops.gemm.blocks_copy import many_rows_matrix  # noqa: E402

PROMPT = [3, 17, 29, 4, 4, 60, 11, 2, 45, 31, 8]
TOL = 1e-5  # float32 on the exact weights against transformers: summation order only
MIXED_TYPES = {
    "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0, "output": Q.Q8_0,
}  # fmt: skip


def _weight(qtype: str, rows: int, cols: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random GGUF matrix encoded by the gguf package (the K-quants by Kiln's encoder: the package has
    none), and its float32 decode by that package."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    data = (
        quantize_blocks(torch.from_numpy(w), qtype).numpy() if qtype.endswith("_K") else quantize(w, Q[qtype])
    )
    expected = torch.from_numpy(dequantize(data, Q[qtype])).reshape(rows, cols)
    return GGUFWeight(qtype, torch.from_numpy(data), (rows, cols)), expected


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0"])
def test_as_q8_0_is_exact(qtype):
    weight, expected = _weight(qtype, 7, 96, 1)
    q8 = weight.as_q8_0()
    assert q8.qtype == "Q8_0" and q8.shape == (7, 96)
    assert torch.equal(q8.dequantize(), expected)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_as_q8_0_refuses_types_it_cannot_hold(qtype):
    weight = GGUFWeight(qtype, quantize_blocks(torch.randn(4, 256), qtype), (4, 256))
    with pytest.raises(ValueError, match=f"GGUF {qtype} has no exact Q8_0 form"):
        weight.as_q8_0()


def test_mixed_parts_stack_as_q8_0_blocks():
    parts = [_weight("Q5_0", 12, 64, 3), _weight("Q4_0", 5, 64, 4), _weight("Q8_0", 9, 64, 5)]
    stacked = cat_rows([w for w, _ in parts], torch.float32)
    assert isinstance(stacked, GGUFWeight) and stacked.qtype == "Q8_0" and stacked.shape == (26, 64)
    assert torch.equal(stacked.dequantize(), torch.cat([e for _, e in parts]))
    # GGUF blocks beside a float matrix are dequantized
    q41, q41_expected = _weight("Q4_1", 3, 64, 6)
    dense = cat_rows([q41, torch.ones(2, 64)], torch.float32)
    assert isinstance(dense, torch.Tensor) and torch.equal(
        dense, torch.cat([q41_expected, torch.ones(2, 64)])
    )


# (the parts' types, weights per scale and min in the stacked fields, whether they have mins)
STACKS = [
    (("Q4_K", "Q4_K", "Q6_K"), 16, True),  # a Q4_K_M file's QKV where llama.cpp gives v more bits
    (("Q5_K", "Q6_K"), 16, True),  # Q5_K_M's
    (("Q4_1", "Q8_0"), 32, True),
    (("Q4_K", "Q5_0", "Q8_0"), 32, True),
    (("Q6_K", "Q8_0", "Q4_0"), 16, False),
]


@pytest.mark.parametrize("qtypes,block,with_mins", STACKS)
def test_parts_without_a_common_gguf_type_stack_with_their_exact_fields(qtypes, block, with_mins):
    parts = [_weight(q, 5 + 3 * i, 512, 10 + i) for i, q in enumerate(qtypes)]
    stacked = cat_rows([w for w, _ in parts], torch.float32)
    assert isinstance(stacked, GGUFStackedWeight) and stacked.shape == (
        sum(5 + 3 * i for i in range(len(qtypes))),
        512,
    )
    assert stacked.qtypes == tuple(dict.fromkeys(qtypes)) and stacked.block == block
    expected = torch.cat([e for _, e in parts])
    assert torch.equal(stacked.dequantize(), expected)
    values, scales, mins = stacked.fields()
    assert values.dtype == torch.int8 and scales.shape == (stacked.shape[0], 512 // block)
    assert (mins is not None) == with_mins
    w = values.float().view(stacked.shape[0], -1, block) * scales[..., None]
    if mins is not None:
        assert mins.shape == scales.shape
        w = w + mins[..., None]
    assert torch.equal(w.view(stacked.shape), expected)  # float32, bit for bit the gguf package's decode


@pytest.mark.parametrize("cpu_format", ["q4_blocks", "q8_blocks"])
@pytest.mark.parametrize("qtypes,block,with_mins", STACKS)
def test_either_exact_format_runs_a_stacked_weight_on_the_q8_kernels(cpu_format, qtypes, block, with_mins):
    parts = [_weight(q, 4 + i, 512, 20 + i) for i, q in enumerate(qtypes)]
    stacked = GGUFStackedWeight.stack([w for w, _ in parts])
    prepared = prepare_linear_weight(
        stacked, device=torch.device("cpu"), dtype=torch.float32, cpu_format=cpu_format
    )
    if prepared.layout == "onednn":
        pytest.skip("neither the panel kernel runs nor oneDNN packs float32 here")
    assert prepared.layout == ("q8_blocks_mins_onednn" if with_mins else "q8_blocks_onednn")
    assert prepared.tensors[1].shape == (stacked.shape[0], 512 // block)
    expected = torch.cat([e for _, e in parts]).double()
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), expected)
    # what many rows multiply: the oneDNN float32 copy, or (none kept) the blocks in the panel kernel
    assert torch.equal(many_rows_matrix(prepared.tensors, 3 if with_mins else 2).double(), expected)
    # other formats (and CUDA) dequantize it once, as the parts would have been
    fp16 = prepare_linear_weight(stacked, device=torch.device("cpu"), dtype=torch.float32, cpu_format="fp16")
    assert fp16.layout in ("fp16_onednn", "fp16_rows")
    assert torch.equal(fp16.tensors[0], expected.to(torch.float16))


def test_stacking_refuses_parts_of_unlike_in_features_or_unknown_types():
    a, _ = _weight("Q4_K", 4, 256, 1)
    b, _ = _weight("Q6_K", 4, 512, 2)
    with pytest.raises(ValueError, match=r"one in_features, got Q4_K \(4, 256\), Q6_K \(4, 512\)"):
        GGUFStackedWeight.stack([a, b])
    with pytest.raises(ValueError, match="Q3_K"):
        GGUFStackedWeight.stack([a, GGUFWeight("Q3_K", torch.zeros(4, 110, dtype=torch.uint8), (4, 256))])


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    return tiny_gguf_with_reference(folder, "tiny-mixed.gguf", MIXED_TYPES, PROMPT, seed=5)


def test_mixed_file_keeps_its_fused_projections_as_exact_blocks_and_matches_transformers(
    mixed_gguf, monkeypatch
):
    monkeypatch.delenv("KILN_CPU_FORMATS", raising=False)  # the default candidates
    path, ref_model, ref = mixed_gguf
    config, weights, _, _ = load_gguf(str(path))
    layer_weights = cpu_format_probe.layer_weights(weights, config, torch.float32)
    assert [w.qtype for w in layer_weights] == ["Q8_0", "Q4_K", "Q8_0", "Q6_K"]  # qkv and gate_up stacked
    assert "q4_blocks" in cpu_format_probe.candidate_formats(layer_weights)
    model = LlamaForCausalLM(config, weights, cpu_format="q4_blocks", lm_head_format="q8_blocks")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    layouts = [attn.qkv_proj.prepared.layout, attn.o_proj.prepared.layout, mlp.gate_up_proj.prepared.layout]
    if any("blocks" not in layout for layout in layouts):
        pytest.skip(f"oneDNN does not pack float32 here: {layouts}")
    assert layouts == ["q8_blocks_onednn", "q4_blocks_onednn", "q8_blocks_onednn"]
    out = prompt_logits(model, PROMPT, block_size=4)
    assert float(((out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max()) < TOL
    with torch.no_grad():
        theirs = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy(model, PROMPT, 6, block_size=4) == theirs[0, len(PROMPT) :].tolist()
