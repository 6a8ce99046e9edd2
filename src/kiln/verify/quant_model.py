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


def float_reference(
    path: str | None, prompt: str, num_layers: int | None
) -> tuple[Checkpoint, tuple[list[torch.Tensor], torch.Tensor], list[str]]:
    """(the checkpoint at `path`, the float model's run_prompt output on `prompt`, the names of the
    linear weights it used, in first-use order); the float model's perplexity goes to
    ckpt.float_perplexity. The float model is dropped before returning."""
    ckpt = load_checkpoint(path, prompt)
    float_model = build_model(ckpt, ckpt.weights, num_layers)
    reference = run_prompt(float_model, ckpt.token_ids)
    ckpt.float_perplexity = perplexity(float_model, ckpt.perplexity_ids)
    linear_names = list(
        dict.fromkeys(n for n in ckpt.weights.used if is_linear_weight(n, ckpt.weights.cache[n]))
    )
    return ckpt, reference, linear_names


def compare_with_reference(
    report: FormatReport,
    model: torch.nn.Module,
    ckpt: Checkpoint,
    reference: tuple[list[torch.Tensor], torch.Tensor],
) -> None:
    """Run `model` on the prompt and fill `report`: its perplexity on the shipped text, per-layer
    error metrics of the hidden states against `reference` (the float model's run_prompt output) with
    each layer's worst token cosine, and the logits' mean / min cosine, SNR and top-1 agreement."""
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
    compare_with_reference(report, model, ckpt, reference)
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
    ckpt, reference, linear_names = float_reference(path, prompt, num_layers)
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


# --- a quantized checkpoint against its original (`kiln verify --quant-model ORIG --against DIR`) ---


class QuantizedCheckpointWeights(FloatWeights):
    """A quantized HF checkpoint's WeightStore for the comparison model: its quantized linear weights
    (kiln.quant.linear_weights) are handed to the model as they are, so it runs them as Kiln does on
    the CPU (FP8 / INT8 W8A8 with their per-token activation quantization; W4A16 dequantized once),
    every other tensor (norms, embeddings, LM head: the checkpoint's own, AWQ-rescaled norms included)
    in float32. `dequantized` holds each quantized weight's float32 [N, K] matrix."""

    def __init__(self, store):
        super().__init__(store)
        self.dequantized: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]):
        from kiln.models.weights import GGUFWeight
        from kiln.quant.linear_weights import QUANTIZED_WEIGHT_TYPES

        if name not in self.cache:
            weight = self.store.get(name, shape)
            if isinstance(weight, QUANTIZED_WEIGHT_TYPES):
                self.used.append(name)
                self.dequantized[name] = weight.dequantize(torch.float32)
                return weight
            self.cache[name] = (
                weight.dequantize(torch.float32) if isinstance(weight, GGUFWeight) else weight.float()
            )
        return super().get(name, shape)


def checkpoint_format_name(hf_config: dict) -> str:
    """A short name of a quantized checkpoint's format from its config.json: e.g. "ct-w4a16-g128",
    "ct-fp8-channel-dynamic", "ct-int8-channel-dynamic", "awq-g128", "gptq-g128", "fp8-block", with
    "+awq" / "+rtn" when `kiln quantize` wrote it."""
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method", "dense")
    if method == "compressed-tensors":
        group = next(iter((qc.get("config_groups") or {}).values()), {})
        w, acts = group.get("weights") or {}, group.get("input_activations")
        if w.get("num_bits") == 4:
            name = f"ct-w4a{16 if acts is None else acts.get('num_bits')}"
            name += f"-g{w.get('group_size')}" if w.get("strategy") == "group" else f"-{w.get('strategy')}"
            name += "" if w.get("symmetric", True) else "-asym"
        else:
            wtype = {"float": "fp8", "int": "int8"}.get(w.get("type"), str(w.get("type")))
            act = "w8only" if acts is None else ("dynamic" if acts.get("dynamic") else "static")
            name = f"ct-{wtype}-{w.get('strategy')}-{act}"
    elif method in ("awq", "gptq"):
        name = f"{method}-g{qc.get('group_size', qc.get('q_group_size', 128))}"
    elif method == "fp8":
        name = "fp8-block" if qc.get("weight_block_size") else "fp8-tensor"
    else:
        name = str(method)
    made = hf_config.get("kiln_quantize")
    if isinstance(made, dict) and made.get("scheme") == "w4a16" and made.get("method"):
        name += f"+{made['method']}"
    return name


def unscale_columns(original: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """`approx` [N, K] with each input column divided by the least-squares factor s_k mapping the
    original's column onto it (s_k = <a_k, w_k> / <w_k, w_k>; 1 for a zero column): for comparing an
    AWQ-folded weight (its columns scaled by s before quantization) with the unscaled original."""
    w, a = original.double(), approx.double()
    norm = w.square().sum(0)
    s = torch.where(norm > 0, (a * w).sum(0) / norm.clamp(min=1e-300), torch.ones_like(norm))
    s = torch.where(s.abs() > 1e-12, s, torch.ones_like(s))
    return (a / s).float()


def measure_checkpoint(
    ckpt: Checkpoint,
    quant_path: str,
    reference: tuple[list[torch.Tensor], torch.Tensor],
    linear_names: list[str],
    num_layers: int | None = None,
) -> FormatReport:
    """The quantized HF checkpoint at `quant_path` (any format Kiln loads) against the float model of
    `ckpt`: each linear weight's dequantized matrix against the original (AWQ-folded checkpoints:
    after unscale_columns), and the model built entirely from the quantized checkpoint (its own norms,
    embeddings and LM head; FP8 / INT8 activation quantization included) on the prompt, per layer,
    on the logits and in perplexity. Reported under checkpoint_format_name."""
    import json

    from kiln.loaders.safetensors import load_safetensors_dir

    if not os.path.isdir(quant_path):
        raise ValueError(f"quant_model: --against {quant_path!r} is not an HF checkpoint directory")
    with open(os.path.join(quant_path, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    config, store = load_safetensors_dir(quant_path)
    if (config.architecture, config.hidden_size, config.num_layers, config.vocab_size) != (
        ckpt.config.architecture, ckpt.config.hidden_size, ckpt.config.num_layers, ckpt.config.vocab_size
    ):  # fmt: skip
        raise ValueError(
            f"quant_model: {quant_path} ({config.architecture}, hidden {config.hidden_size}, "
            f"{config.num_layers} layers, vocab {config.vocab_size}) is not a quantization of {ckpt.source}"
        )
    report = FormatReport(checkpoint_format_name(hf_config))
    weights = QuantizedCheckpointWeights(store)
    model = build_model(replace(ckpt, config=config, rope_inv_freq=None), weights, num_layers)
    if not weights.dequantized:  # every metric would be NaN or the float model's own
        method = (hf_config.get("quantization_config") or {}).get("quant_method", "none")
        raise ValueError(
            f"quant_model: --against {quant_path} holds no quantized linear weights (config.json "
            f"quantization_config: {method}): nothing to measure against {ckpt.source}"
        )
    folded = (hf_config.get("kiln_quantize") or {}).get("method") == "awq"
    for name in linear_names:
        if name in weights.dequantized:
            original, approx = ckpt.weights.cache[name], weights.dequantized[name]
            report.weights[name] = error_metrics(
                original, unscale_columns(original, approx) if folded else approx
            )
    compare_with_reference(report, model, ckpt, reference)
    return report


def quant_checkpoint_report(
    path: str | None, against: list[str], *, prompt: str = DEFAULT_PROMPT, num_layers: int | None = None
) -> tuple[Checkpoint, list[FormatReport]]:
    """measure_checkpoint of each quantized checkpoint in `against` vs the float model at `path`
    (None: the embedded SmolLM2 GGUF), which runs once; its perplexity goes to ckpt.float_perplexity."""
    ckpt, reference, linear_names = float_reference(path, prompt, num_layers)
    return ckpt, [measure_checkpoint(ckpt, q, reference, linear_names, num_layers) for q in against]
