"""Quantization error through a whole model (`kiln verify --quant-model [PATH] --format FMT`).

The "original" is the checkpoint's weights in float32 (a GGUF file's blocks dequantized). For a format
of `kiln.quant` (int4 group-wise, FP8/INT8 per channel, GGUF Q4_0/Q4_1/Q8_0, 2:4 sparsity by magnitude)
or "sparse24_wanda" (2:4 by Wanda's |weight| x input-column norm, the norms measured by the float model
on kiln/models/texts/calibration.txt):
  1. weight level: every linear weight of the decoder layers (2-D tensors named `model.layers.*`;
     embeddings and LM head stay float, as quantized checkpoints usually keep them) is quantized,
     dequantized and compared with the original: SNR dB, cosine, max abs error per tensor;
  2. activation level: one fixed prompt runs through the float32 model and through a fake-quant copy
     (linear weights replaced by their quantize->dequantize versions). Each decoder layer's output
     hidden state (the residual stream after the layer, float32 [T, hidden]) of the copy is compared
     with the float model's: SNR, cosine, worst per-token cosine. Then the final logits [T, vocab]:
     mean and worst per-position cosine, and top-1 agreement over the prompt's positions;
  3. perplexity of the float model and of each copy on kiln/models/texts/perplexity.txt (a short text
     written for Kiln, never used for calibration): exp(mean next-token negative log-likelihood).
Both models run in float32 on the CPU, so every difference is the quantization's.
Floors, tables, JSON and the CLI: kiln.verify.quant_model_cli.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kiln.quant import error_metrics, roundtrip
from kiln.quant.formats import FORMATS

# CLI spelling -> kiln.quant format name.
FORMAT_NAMES = {
    "int4-g32": "int4_g32",
    "int4-g64": "int4_g64",
    "int4-g128": "int4_g128",
    "fp8": "fp8",
    "int8": "int8",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q8_0": "Q8_0",
    "sparse24": "sparse24",
    "sparse24-wanda": "sparse24_wanda",
}
MAX_PERPLEXITY_TOKENS = 512
DEFAULT_PROMPT = (
    "The quick brown fox jumps over the lazy dog. Quantization stores each weight in a few bits; "
    "the question is how much of the model's output survives it."
)

# (weight [N, K] float32, kiln.quant format name) -> the float32 [N, K] weight the quantized model uses
Quantizer = Callable[[torch.Tensor, str], torch.Tensor]


def format_name(name: str) -> str:
    """'int4-g128' | 'int4_g128' | 'q4_0' | 'Q4_0' ... -> the kiln.quant format name."""
    if name in FORMATS or name == "sparse24_wanda":
        return name
    key = name.strip().lower().replace("_g", "-g").replace("_wanda", "-wanda")
    if key not in FORMAT_NAMES:
        raise ValueError(f"quant_model: unknown --format {name!r}, expected one of {', '.join(FORMAT_NAMES)}")
    return FORMAT_NAMES[key]


def is_linear_weight(name: str, weight: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and weight.dim() == 2


class FloatWeights:
    """A WeightStore seen through float32: GGUF blocks dequantized, every tensor cast, each read once.
    `overrides` (name -> tensor) replace tensors, e.g. by their fake-quantized versions; `used` lists
    what the model builder read, in order (the model's weights, for the weight report)."""

    def __init__(self, store, overrides: dict[str, torch.Tensor] | None = None, cache=None):
        self.store = store
        self.overrides = overrides or {}
        self.cache: dict[str, torch.Tensor] = {} if cache is None else cache
        self.used: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.store

    def names(self) -> list[str]:
        return self.store.names()

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        from kiln.models.weights import GGUFWeight

        if name not in self.cache:
            w = self.store.get(name, shape)
            self.cache[name] = w.dequantize(torch.float32) if isinstance(w, GGUFWeight) else w.float()
        self.used.append(name)
        return self.overrides.get(name, self.cache[name])

    def get_optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if name in self else None


@dataclass
class Checkpoint:
    """A model's weights (float32 view) and what building and prompting its Kiln model needs."""

    source: str
    config: object  # kiln.models.ModelConfig
    weights: FloatWeights
    model_class: type
    rope_inv_freq: torch.Tensor | None
    token_ids: list[int]
    perplexity_ids: list[int] = field(default_factory=list)  # the perplexity text's tokens
    calibration_ids: list[int] = field(default_factory=list)  # Wanda's calibration text's tokens
    float_perplexity: float = float("nan")  # the unquantized model's, on the perplexity text


def load_checkpoint(path: str | None = None, prompt: str = DEFAULT_PROMPT) -> Checkpoint:
    """A GGUF file or HF directory (default: the embedded SmolLM2 GGUF) through Kiln's loaders; the
    prompt tokenized by its tokenizer (a checkpoint without one gets 32 fixed pseudo-random ids)."""
    from kiln.loaders import Tokenizer, default_model_path
    from kiln.loaders.gguf import load_gguf
    from kiln.loaders.safetensors import load_safetensors_dir
    from kiln.models.calibration import read_text
    from kiln.models.config import ModelLoadError
    from kiln.models.registry import get_model_class

    path = path or default_model_path()
    if not os.path.exists(path):
        raise ValueError(
            f"quant_model: model path {path!r} does not exist; pass a .gguf file or HF directory"
        )
    rope_inv_freq, tokenizer = None, None
    if os.path.isdir(path):
        config, store = load_safetensors_dir(path)
        try:
            tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_ids)
        except (ModelLoadError, OSError, ValueError):
            tokenizer = None
    else:
        config, store, meta, rope_inv_freq = load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)
    generator = torch.Generator().manual_seed(0)

    def encode(text: str, fallback_length: int) -> list[int]:
        ids = tokenizer.encode(text) if tokenizer is not None else []
        if not ids:  # no tokenizer: fixed pseudo-random ids stand in
            ids = torch.randint(0, config.vocab_size, (fallback_length,), generator=generator).tolist()
        return ids

    token_ids = encode(prompt, 32)
    perplexity_ids = encode(read_text("perplexity.txt"), 128)[:MAX_PERPLEXITY_TOKENS]
    calibration_ids = encode(read_text("calibration.txt"), 128)[:MAX_PERPLEXITY_TOKENS]
    model_class = get_model_class(config.architecture, path)
    weights = FloatWeights(store)
    return Checkpoint(
        path, config, weights, model_class, rope_inv_freq, token_ids, perplexity_ids, calibration_ids
    )


def build_model(ckpt: Checkpoint, weights: FloatWeights, num_layers: int | None = None) -> torch.nn.Module:
    """The float32 CPU model over `weights`; num_layers keeps only the first layers (a faster, partial
    measurement: the logits are then those of the truncated model)."""
    config = ckpt.config
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_layers:
            raise ValueError(f"quant_model: --layers {num_layers} out of range 1..{config.num_layers}")
        config = replace(config, num_layers=num_layers)
    kwargs = {"rope_inv_freq": ckpt.rope_inv_freq} if ckpt.rope_inv_freq is not None else {}
    with torch.no_grad():
        model = ckpt.model_class(
            config,
            weights,
            device="cpu",
            dtype=torch.float32,
            cpu_format="fp32",
            lm_head_format="fp32",
            **kwargs,
        )
    return model.eval()


def run_prompt(model: torch.nn.Module, token_ids: list[int]):
    """One prefill of `token_ids` -> (per-layer hidden states, each float32 [T, hidden], logits float32
    [T, vocab]). A layer's hidden state is its output plus the residual it carries (the model fuses
    that add into the next rms_norm), i.e. HF's hidden_states[i + 1]."""
    from kiln.models.calibration import prefill

    states: list[torch.Tensor] = []

    def capture(module, inputs, output):
        hidden, residual = output  # residual is updated in place by the next layer: add now
        states.append((hidden + residual).float())

    hooks = [layer.register_forward_hook(capture) for layer in model.layers]
    try:
        hidden = prefill(model, token_ids)
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return states, logits


def _row_cosines(reference: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(reference.double(), approx.double(), dim=-1)


@dataclass
class FormatReport:
    """Everything measured for one format (metrics dicts: "snr_db", "cosine", "max_abs_error")."""

    format: str
    weights: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> metrics
    layers: list[dict[str, float]] = field(default_factory=list)  # per layer: metrics + min_token_cosine
    logits_cosine: float = float("nan")  # mean over positions of the per-position cosine
    logits_min_cosine: float = float("nan")
    logits_snr_db: float = float("nan")
    top1_agreement: float = float("nan")  # fraction of positions whose argmax token matches
    perplexity: float = float("nan")  # on kiln/models/texts/perplexity.txt

    def weight_stat(self, metric: str, how: str) -> float:
        """worst ("min" for snr/cosine, "max" for max_abs_error) or "mean" of a weight metric."""
        values = torch.tensor([m[metric] for m in self.weights.values()], dtype=torch.float64)
        if values.numel() == 0:
            return float("nan")
        if how == "mean":
            return values.mean().item()
        return values.max().item() if metric == "max_abs_error" else values.min().item()


def weight_errors(
    weights: dict[str, torch.Tensor], fmt: str, quantizer: Quantizer | None = None
) -> tuple[dict[str, dict[str, float]], dict[str, torch.Tensor]]:
    """Quantize->dequantize each float32 [N, K] weight with `quantizer` (default kiln.quant.roundtrip)
    -> ({name: {"snr_db", "cosine", "max_abs_error"}}, {name: dequantized float32 weight})."""
    quantizer = quantizer or roundtrip
    metrics, approx = {}, {}
    for name, original in weights.items():
        approx[name] = quantizer(original, fmt).float()
        metrics[name] = error_metrics(original, approx[name])
    return metrics, approx


def perplexity(model: torch.nn.Module, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of token t + 1 given tokens 0..t) over `token_ids` (>= 2)."""
    from kiln.models.calibration import prefill

    if len(token_ids) < 2:
        return float("nan")
    with torch.inference_mode():
        logits = model.compute_logits(prefill(model, token_ids)).double()
    target = torch.tensor(token_ids[1:], dtype=torch.int64)
    return torch.nn.functional.cross_entropy(logits[:-1], target).exp().item()


def wanda_weights(
    ckpt: Checkpoint, linear_names: list[str], num_layers: int | None
) -> dict[str, torch.Tensor]:
    """{name: the 2:4 Wanda-pruned float32 weight} with input norms measured by the float model on the
    calibration text."""
    from kiln.models.calibration import checkpoint_input_norms
    from kiln.quant.sparse24 import prune_24, wanda_scores

    model = build_model(ckpt, ckpt.weights, num_layers)
    norms = checkpoint_input_norms(model, [ckpt.calibration_ids])
    pruned = {}
    for name in linear_names:
        weight = ckpt.weights.cache[name]
        if name not in norms:
            raise ValueError(f"quant_model: no calibration input norm for {name} (sparse24-wanda)")
        pruned[name] = prune_24(weight, wanda_scores(weight, norms[name]))
    return pruned


def measure_format(
    ckpt: Checkpoint,
    fmt: str,
    reference: tuple[list[torch.Tensor], torch.Tensor],
    linear_names: list[str],
    quantizer: Quantizer | None = None,
    num_layers: int | None = None,
    approximations: dict[str, torch.Tensor] | None = None,
) -> FormatReport:
    """Quantize the linear weights `linear_names` with `quantizer` (or take their `approximations`,
    name -> float32 weight), report them, run the fake-quant model on the prompt and compare with
    `reference` (the float model's run_prompt output); its perplexity on the shipped text."""
    report = FormatReport(fmt)
    originals = {name: ckpt.weights.cache[name] for name in linear_names}
    if approximations is None:
        report.weights, overrides = weight_errors(originals, fmt, quantizer)
    else:
        overrides = {name: approximations[name].float() for name in linear_names}
        report.weights = {name: error_metrics(originals[name], overrides[name]) for name in linear_names}
    model = build_model(ckpt, FloatWeights(ckpt.weights.store, overrides, ckpt.weights.cache), num_layers)
    states, logits = run_prompt(model, ckpt.token_ids)
    report.perplexity = perplexity(model, ckpt.perplexity_ids)
    ref_states, ref_logits = reference
    for ref, got in zip(ref_states, states, strict=True):
        metrics = error_metrics(ref, got)
        metrics["min_token_cosine"] = _row_cosines(ref, got).min().item()
        report.layers.append(metrics)
    cosines = _row_cosines(ref_logits, logits)
    report.logits_cosine = cosines.mean().item()
    report.logits_min_cosine = cosines.min().item()
    report.logits_snr_db = error_metrics(ref_logits, logits)["snr_db"]
    report.top1_agreement = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return report


def quant_model_report(
    path: str | None = None,
    formats: list[str] = ("int4_g128",),
    *,
    prompt: str = DEFAULT_PROMPT,
    num_layers: int | None = None,
    quantizer: Quantizer | None = None,
) -> tuple[Checkpoint, list[FormatReport]]:
    """Weight and activation reports of `formats` (any spelling format_name takes) for the model at
    `path` (None: the embedded SmolLM2 GGUF); the unquantized model's perplexity goes to
    ckpt.float_perplexity. The float model runs once; each format builds one copy.
    GGUF formats need every linear weight's K to be a multiple of 32, sparse24 of 4 (ValueError)."""
    formats = [format_name(f) for f in formats]
    ckpt = load_checkpoint(path, prompt)
    float_model = build_model(ckpt, ckpt.weights, num_layers)
    reference = run_prompt(float_model, ckpt.token_ids)
    ckpt.float_perplexity = perplexity(float_model, ckpt.perplexity_ids)
    linear_names = list(
        dict.fromkeys(n for n in ckpt.weights.used if is_linear_weight(n, ckpt.weights.cache[n]))
    )
    del float_model
    for fmt in formats:
        multiple = 32 if fmt.startswith("Q") else 4 if fmt.startswith("sparse24") else 1
        bad = [n for n in linear_names if ckpt.weights.cache[n].shape[1] % multiple]
        if bad:
            raise ValueError(
                f"quant_model: format {fmt} needs in_features a multiple of {multiple}; {bad[0]} has shape "
                f"{tuple(ckpt.weights.cache[bad[0]].shape)}: choose an int4/int8/fp8 format"
            )
    reports = []
    for fmt in formats:
        approximations = wanda_weights(ckpt, linear_names, num_layers) if fmt == "sparse24_wanda" else None
        reports.append(
            measure_format(ckpt, fmt, reference, linear_names, quantizer, num_layers, approximations)
        )
    return ckpt, reports
