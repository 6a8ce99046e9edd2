"""compressed-tensors checkpoints (FP8 dynamic / static, INT8 W8A8, W4A16 symmetric / asymmetric,
FP8 block) written by the compressed-tensors library (tests/loaders/ct_checkpoints.py), loaded by Kiln
with no flag, against transformers loading the same files (which runs compressed-tensors' own
fake-quantized forward: the same activation quantization Kiln's kernels do). transformers 5.x cannot
load the asymmetric pack-quantized file; its reference is compressed-tensors' own decompression of
the packed weights in a dense transformers Llama.

Tolerance: Kiln and transformers compute the same quantized arithmetic in float32 in a different
order; measured last-position relative L2 errors 4e-7 .. 1.3e-6 on an AMD host, so 1e-5 (as the
dense float32 model tests) where activations stay float. Where activations are quantized, a one-ULP
float32 difference upstream can move one element across a rounding boundary of its int8 / fp8 grid,
a whole step of that element, which the later layers carry to the logits: on an Intel host one W8A8
down_proj input element (of 13 x 384) quantized to -128 in transformers and -127 in Kiln (inputs
6e-7 apart), 5.3e-3 on the logits; in tests/entrypoints/test_quantize.py's tiny Llama one such step
gave 1.0e-2 and 2.2e-2. Those presets get 5e-2; their greedy tokens must still be equal, and every
projection, fed the input transformers gave it, must be within 1e-5 of transformers' module
(tests/loaders/ct_checkpoints.py worst_projection_error).
Greedy tokens are compared for as many tokens as transformers produced (it stops at the config's
eos)."""

import json
import logging

import pytest
import torch

from kiln.loaders.safetensors import load_safetensors_dir
from kiln.models import ModelLoadError, get_model_class
from kiln.ops.gemm import weight_formats
from tests.loaders.ct_checkpoints import (
    TOL_QUANTIZED_ACTIVATIONS,
    decompressed_llama,
    worst_projection_error,
    write_quantized_llama,
)
from tests.models.helpers import greedy, prompt_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]
TOL = 1e-5
# preset -> the format Kiln's fused qkv projection runs in on the CPU
PRESETS = {
    "FP8_DYNAMIC": "fp8",
    "FP8": "fp8",
    "W8A8": "int8",
    "W4A16": "dense",  # dequantized once at load on the CPU (logged)
    "W4A16_ASYM": "dense",
    "FP8_BLOCK": "fp8_block",
}


@pytest.fixture(scope="module", params=list(PRESETS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param.lower())
    write_quantized_llama(request.param, str(directory))
    return request.param, str(directory)


def test_compressed_tensors_checkpoint_matches_transformers(checkpoint, caplog):
    preset, directory = checkpoint
    if preset == "W4A16_ASYM":  # transformers cannot load it: compressed-tensors' own unpacking
        hf = decompressed_llama(directory)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    weight_formats._log_dequantized_at_load.cache_clear()  # logged once per process and format
    with caplog.at_level(logging.INFO):
        config, weights = load_safetensors_dir(directory)
        model = get_model_class(config.architecture)(config, weights)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.format == PRESETS[preset]
    if PRESETS[preset] == "dense":
        assert "dequantized once at load" in caplog.text
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].double()
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = prompt_logits(model, PROMPT)[-1].double()
    tol = TOL if PRESETS[preset] == "dense" else TOL_QUANTIZED_ACTIVATIONS
    assert ((out - ref).norm() / ref.norm()).item() < tol
    assert worst_projection_error(model, hf, PROMPT) < TOL
    theirs = theirs[0, len(PROMPT) :].tolist()
    assert len(theirs) >= 4
    assert greedy(model, PROMPT, len(theirs)) == theirs


def test_w4a16_with_cpu_format_int4_runs_torchs_int4_matmul(tmp_path):
    """cpu_format="int4" repacks the pack-quantized groups of 128 into torch's int4 CPU layout
    (groups of 32, bf16 scales and activations: ~1e-2 relative, as the GGUF int4 path)."""
    write_quantized_llama("W4A16_ASYM", str(tmp_path))
    config, weights = load_safetensors_dir(str(tmp_path))
    dense = get_model_class(config.architecture)(config, weights)
    config, weights = load_safetensors_dir(str(tmp_path))
    packed = get_model_class(config.architecture)(config, weights, cpu_format="int4")
    assert packed.layers[0].mlp.gate_up_proj.format == "int4"
    ref, out = prompt_logits(dense, PROMPT)[-1].double(), prompt_logits(packed, PROMPT)[-1].double()
    assert ((out - ref).norm() / ref.norm()).item() < 5e-2


def _edit_config(directory, edit):
    path = f"{directory}/config.json"
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


def test_unsupported_quantization_fails_at_load_naming_tensor_format_and_supported(tmp_path):
    write_quantized_llama("W8A8", str(tmp_path))
    _edit_config(
        tmp_path, lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=64)
    )
    with pytest.raises(
        ModelLoadError,
        match=r"tensor .model\.layers\.0\.\w+\.\w+_proj\.weight.*int-quantized int 8-bit group.*Kiln loads",
    ):
        load_safetensors_dir(str(tmp_path))
    _edit_config(tmp_path, lambda qc: qc.update(quant_method="bitsandbytes"))
    with pytest.raises(ModelLoadError, match=r"quant_method 'bitsandbytes' is not supported.*awq"):
        load_safetensors_dir(str(tmp_path))


def test_w4a16_group_size_and_actorder_without_their_tensors_fail_by_name(tmp_path):
    write_quantized_llama("W4A16", str(tmp_path))
    weights = lambda qc: qc["config_groups"]["group_0"]["weights"]  # noqa: E731
    _edit_config(tmp_path, lambda qc: weights(qc).update(group_size=None))  # was a TypeError
    with pytest.raises(ModelLoadError, match=r"group_size None"):
        load_safetensors_dir(str(tmp_path))
    _edit_config(tmp_path, lambda qc: weights(qc).update(group_size=128, actorder="group"))
    with pytest.raises(ModelLoadError, match=r"missing tensor .*weight_g_idx"):
        load_safetensors_dir(str(tmp_path))


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W8A8", "W4A16"])
def test_llm_generates_from_a_quantized_checkpoint_like_transformers(preset, tmp_path):
    """The user's path: LLM(model=DIR) with no flag, greedy tokens through the engine (paged KV,
    scheduler, sampler) equal to transformers.generate on the same compressed-tensors files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kiln.engine import LLM, SamplingParams

    write_quantized_llama(preset, str(tmp_path))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    theirs = theirs[0, len(PROMPT) :].tolist()
    llm = LLM(model=str(tmp_path), device="cpu", dtype=torch.float32, num_kv_blocks=16)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=len(theirs), temperature=0.0, ignore_eos=True))
    assert len(theirs) >= 4 and out.token_ids == theirs
