"""`kiln quantize`: quantize an HF safetensors checkpoint into a compressed-tensors checkpoint that
`load_model` / `LLM(...)` (and transformers, vLLM, SGLang) load.

    kiln quantize SRC_DIR --out DIR --scheme fp8|int8|w4a16 [--method rtn|awq] [--group-size 128]
                  [--kv-cache fp8 [--kv-cache-strategy tensor|attn_head]] [--ignore REGEX ...]
                  [--calibration FILE]

Schemes (compressed-tensors presets; weights from min/max, the library's own calculate_qparams):
    fp8     FP8_DYNAMIC: e4m3 weights, one scale per output channel; activations quantized per token
            at run time
    int8    W8A8: int8 weights, one scale per output channel; int8 activations per token at run time
    w4a16   W4A16 pack-quantized: symmetric int4 weights, one scale per group of --group-size inputs
            (32, 64, 128 or a multiple of 128, dividing every quantized projection's in_features; or
            exactly a projection's in_features: what Kiln's int4_linear loads)
Quantized: the decoder layers' projections (`model.layers.N.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj}`) unless an --ignore regex matches `<module>.weight` (as `kiln sparsify`).
Embeddings, norms and the LM head stay in the source dtype (config.json's "dtype", or the legacy
"torch_dtype"; float32 when it names none), which config.json of the output records too; the scales
are written in it as well.

--method awq (w4a16 only; dense Llama-family layers: Llama, Mistral, Qwen2, Qwen3): before
round-to-nearest, AWQ's activation-aware scaling (kiln.quant.awq_scaling). Kiln's float32 model runs
the calibration text (default: the text `kiln verify --quant-model` calibrates on) and records each
projection group's input; per decoder layer and group sharing an input the best scale s is searched
and folded: 1/s into the op producing the input, s into the projections' input columns:
    q/k/v      <- input_layernorm.weight
    gate/up    <- post_attention_layernorm.weight
    down       <- up_proj rows
    o          <- v_proj rows, only when every attention head has its own KV head (v_proj's rows map
                  1:1 onto o_proj's inputs); skipped otherwise
The scales live in the weights and norms: the output is a standard W4A16 checkpoint. AWQ's weight
clipping search is not done.

--kv-cache fp8 (any scheme): an FP8 kv_cache_scheme with static k/v scales measured on the calibration
text (kiln.entrypoints.quantize_kv_cache), one per layer (--kv-cache-strategy tensor, the default) or
one per layer and kv head (attn_head, compressed-tensors' per-head strategy), for an fp8 KV cache
(`--kv-cache-dtype fp8 --kv-cache-scales checkpoint` in Kiln; vLLM's `kv_cache_dtype="fp8"`).

Written: the compressed-tensors library's model compression and save (config.json gains its
quantization_config, plus "kiln_quantize": {"scheme", "method", "group_size", "kv_cache",
"kv_cache_strategy", "ignore", "quantized"});
every other file of SRC_DIR (tokenizer files) is copied. transformers and compressed-tensors are
optional dependencies of Kiln: without them this command says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from kiln.entrypoints.checkpoint_args import (
    add_checkpoint_parser,
    calibration_model,
    copy_other_files,
    is_projection_weight,
    read_calibration,
    source_safetensors,
)
from kiln.entrypoints.quantize_kv_cache import (
    KV_CACHE_SCHEMES,
    KV_CACHE_STRATEGIES,
    attach_kv_cache_scales,
    kv_cache_observations,
)
from kiln.quant.int4 import GROUP_SIZES

SCHEMES = {"fp8": "FP8_DYNAMIC", "int8": "W8A8", "w4a16": "W4A16"}
AWQ_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# AWQ group -> (Kiln module under layers.{i} whose input the group shares, HF projections)
_AWQ_GROUPS = {
    "qkv": ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "o": ("self_attn.o_proj", ("self_attn.o_proj",)),
    "gate_up": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "down": ("mlp.down_proj", ("mlp.down_proj",)),
}


def add_parser(subparsers) -> None:
    parser = add_checkpoint_parser(
        subparsers,
        "quantize",
        help="quantize an HF checkpoint to FP8, INT8 W8A8 or int4 W4A16 (RTN or AWQ), compressed-tensors",
        doc=__doc__,
        ignore_help="unquantized",
        calibration_help="AWQ calibration text file",
    )
    parser.add_argument("--scheme", required=True, choices=list(SCHEMES))
    parser.add_argument("--method", choices=["rtn", "awq"], default="rtn", help="w4a16 only: rtn or awq")
    parser.add_argument("--group-size", type=int, default=128, help="w4a16 group size (default 128)")
    parser.add_argument(
        "--kv-cache",
        choices=list(KV_CACHE_SCHEMES),
        default=None,
        help="also write static k/v scales for an fp8 KV cache (kv_cache_scheme), from the calibration text",
    )
    parser.add_argument(
        "--kv-cache-strategy",
        choices=list(KV_CACHE_STRATEGIES),
        default=None,
        help="with --kv-cache: one k/v scale per layer (tensor, the default) or per layer and kv head "
        "(attn_head: [num_kv_heads, 1, 1])",
    )
    parser.set_defaults(func=run)


def int4_group_size_error(group_size: int, in_features: int) -> str | None:
    """Why Kiln's loader would reject W4A16 groups of `group_size` on a projection of `in_features`
    inputs, or None when it takes them. The rule of kiln.quant.linear_weights.int4_weight (copied
    from there, which keeps it inline): int4_linear's GROUP_SIZES, a multiple of 128 (split into
    groups of 128), or one group per row; kiln quantize also needs the size to divide in_features."""
    if in_features % group_size:
        return (
            f"{in_features} inputs, not a multiple of --group-size {group_size}; choose a group size "
            f"dividing every projection's in_features (e.g. 32 or 64)"
        )
    if group_size in GROUP_SIZES or group_size % 128 == 0 or group_size == in_features:
        return None
    return (
        f"{in_features} inputs: --group-size {group_size} is not one Kiln's int4_linear loads; "
        f"allowed: {', '.join(map(str, GROUP_SIZES))}, a multiple of 128, or the projection's whole "
        f"in_features ({in_features})"
    )


def source_dtype(config: dict) -> torch.dtype:
    """The dtype of an HF checkpoint from its config.json: "dtype" (transformers >= 4.56), else the
    legacy "torch_dtype", else float32."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"kiln quantize: config.json dtype {name!r} is not a torch floating-point dtype")
    return dtype


def _libraries():
    """(transformers, compressed_tensors), or ValueError saying how to install them."""
    try:
        import compressed_tensors
        import transformers
    except ImportError as exc:
        raise ValueError(
            f"kiln quantize needs transformers and compressed-tensors ({exc}); "
            "install them with: pip install transformers 'compressed-tensors>=0.20'"
        ) from exc
    return transformers, compressed_tensors


def quantized_modules(model: torch.nn.Module, ignore: list[re.Pattern]) -> list[str]:
    """Names of the nn.Linear modules of a transformers model that `kiln quantize` quantizes."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and is_projection_weight(name + ".weight", ignore)
    ]


def weight_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) of a [N, K] weight for compressed-tensors QuantizationArgs `args` (strategy
    "channel": [N, 1]; "group": [N, K / group_size]) from its min/max, by calculate_qparams."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = weight.float()
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        raise ValueError(f"kiln quantize: weight strategy {args.strategy!r} is not supported")
    return calculate_qparams(lo, hi, args)


def fake_quantizer(args):
    """weight float32 [N, K] -> its quantize->dequantize version under `args` (compressed-tensors'
    fake_quantize with weight_qparams): what the AWQ search scores."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    def run(weight: torch.Tensor) -> torch.Tensor:
        scale, zero = weight_qparams(weight, args)
        return fake_quantize(weight.float(), scale, zero, args).float()

    return run


def calibration_inputs(source: str, text: str | None, max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, {AWQ group: float32 [T, K] the input its projections share}, recorded by
    Kiln's float32 CPU model of `source` on the first `max_tokens` tokens of `text` (None: the default
    calibration text)."""
    from kiln.models.calibration import prefill

    loaded, ids = calibration_model("kiln quantize", source, text, max_tokens)
    model = loaded.model
    modules = dict(model.named_modules())
    inputs: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    handles = []
    for i in range(len(model.layers)):
        for group, (kiln_module, _) in _AWQ_GROUPS.items():
            module = modules.get(f"layers.{i}.{kiln_module}")
            if module is None:
                raise ValueError(
                    f"kiln quantize: --method awq: layer {i} has no {kiln_module} (architecture "
                    f"{model.config.architecture!r}); AWQ supports dense Llama-family layers"
                )

            def record(mod, args, i=i, group=group):
                x = args[0].detach().float()
                inputs[i][group] = x.reshape(-1, x.shape[-1]).clone()

            handles.append(module.register_forward_pre_hook(record))
    try:
        prefill(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def awq_fold(
    hf: torch.nn.Module,
    inputs: list[dict[str, torch.Tensor]],
    fake_quantize,
    quantized: set[str],
    progress: bool = False,
) -> list[dict]:
    """Search and fold AWQ scales into the float32 transformers model `hf`, in place (see the module
    docstring); `inputs` from calibration_inputs, `quantized` the module names that will be quantized
    (only they count in the search; unquantized members of a group are scaled exactly).
    Returns per layer {group: {"alpha", "error", "rtn_error"}} (mean squared output errors)."""
    from tqdm import tqdm

    from kiln.quant.awq_scaling import search_scale

    config = hf.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    fold_o = kv_heads in (None, heads)
    layers = hf.model.layers
    if len(layers) != len(inputs):
        raise ValueError(f"kiln quantize: {len(inputs)} calibrated layers for a model of {len(layers)}")
    report = []
    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc="awq", disable=not progress, file=sys.stderr):
            layer, found = layers[i], {}
            previous = {
                "qkv": [layer.input_layernorm],
                "o": [layer.self_attn.v_proj] if fold_o else None,
                "gate_up": [layer.post_attention_layernorm],
                "down": [layer.mlp.up_proj],
            }
            for group, (_, projections) in _AWQ_GROUPS.items():
                prev = previous[group]
                names = [f"model.layers.{i}.{p}" for p in projections]
                members = [hf.get_submodule(n) for n in names]
                counted = [m.weight for n, m in zip(names, members, strict=True) if n in quantized]
                if prev is None or not counted:
                    continue
                result = search_scale(torch.cat(counted), inputs[i][group], fake_quantize)
                s = result.scale
                for member in members:
                    member.weight.mul_(s.to(member.weight.dtype))
                for op in prev:  # a norm weight [K], or a Linear's output rows [K, ...] (+ bias [K])
                    op.weight.div_(s.reshape(-1, *([1] * (op.weight.dim() - 1))).to(op.weight.dtype))
                    if getattr(op, "bias", None) is not None:
                        op.bias.div_(s.to(op.bias.dtype))
                found[group] = {"alpha": result.alpha, "error": result.error, "rtn_error": result.rtn_error}
            report.append(found)
    return report


def quantize(
    source: str,
    out: str,
    scheme: str,
    method: str = "rtn",
    group_size: int = 128,
    ignore: list[str] = (),
    calibration_text: str | None = None,
    max_calibration_tokens: int = 512,
    progress: bool = True,
    kv_cache: str | None = None,
    kv_cache_strategy: str | None = None,
) -> dict:
    """Quantize `source` into `out` (see the module docstring). Returns config.json's "kiln_quantize"
    entry, with "awq": the per-layer search results for --method awq. kv_cache_strategy: None is
    "tensor" with `kv_cache`, and must be None without."""
    from tqdm import tqdm

    transformers, _ = _libraries()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    if scheme not in SCHEMES:
        raise ValueError(f"kiln quantize: unknown scheme {scheme!r}, expected one of {', '.join(SCHEMES)}")
    if method not in ("rtn", "awq"):
        raise ValueError(f"kiln quantize: unknown method {method!r}, expected rtn or awq")
    if method == "awq" and scheme != "w4a16":
        raise ValueError("kiln quantize: --method awq applies to --scheme w4a16 only")
    if group_size <= 0:
        raise ValueError(f"kiln quantize: --group-size {group_size} must be positive")
    if kv_cache is not None and kv_cache not in KV_CACHE_SCHEMES:
        expected = ", ".join(KV_CACHE_SCHEMES)
        raise ValueError(f"kiln quantize: --kv-cache {kv_cache!r} unsupported, expected one of {expected}")
    if kv_cache is None and kv_cache_strategy is not None:
        raise ValueError("kiln quantize: --kv-cache-strategy applies with --kv-cache only")
    if kv_cache is not None:
        kv_cache_strategy = kv_cache_strategy or "tensor"
        if kv_cache_strategy not in KV_CACHE_STRATEGIES:
            raise ValueError(
                f"kiln quantize: --kv-cache-strategy {kv_cache_strategy!r} unsupported, expected one of "
                + ", ".join(KV_CACHE_STRATEGIES)
            )
    source_safetensors("kiln quantize", source, out)
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        source_config = json.load(f)
    if "quantization_config" in source_config:
        raise ValueError(
            f"kiln quantize: {source} is already quantized (config.json has quantization_config)"
        )
    architecture = (source_config.get("architectures") or ["?"])[0]
    if method == "awq" and architecture not in AWQ_ARCHITECTURES:
        raise ValueError(
            f"kiln quantize: --method awq supports {', '.join(AWQ_ARCHITECTURES)}, not {architecture}"
        )
    patterns = [re.compile(p) for p in ignore]

    preset = preset_name_to_scheme(SCHEMES[scheme], ["Linear"])
    if scheme == "w4a16":
        preset.weights = preset.weights.model_copy(update={"group_size": group_size})
    dtype = source_dtype(source_config)
    hf_config = transformers.AutoConfig.from_pretrained(source)
    with torch.device("meta"):  # the projections' shapes, checked before any weight is read
        shapes = transformers.AutoModelForCausalLM.from_config(hf_config)
    names = quantized_modules(shapes, patterns)
    if not names:
        raise ValueError("kiln quantize: no projection to quantize (every one ignored?)")
    if scheme == "w4a16":
        for name in names:
            error = int4_group_size_error(group_size, shapes.get_submodule(name).in_features)
            if error:
                raise ValueError(f"kiln quantize: {name} has {error}")
    del shapes
    # Loaded in float32 (the AWQ search and fold run in it), cast back to `dtype` before quantizing;
    # transformers records the load dtype in hf.config, hence `dtype` from the source's config.json.
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if quantized_modules(hf, patterns) != names:
        raise ValueError(f"kiln quantize: {source}'s loaded projections differ from its config's")

    awq = None
    if method == "awq":
        inputs = calibration_inputs(source, calibration_text, max_calibration_tokens)
        awq = awq_fold(hf, inputs, fake_quantizer(preset.weights), set(names), progress)
        del inputs
    observations = None
    if kv_cache is not None:  # the float model's keys and values, AWQ's folds included
        observations = kv_cache_observations(hf, source, calibration_text, max_calibration_tokens)

    hf.to(dtype)
    hf.config.dtype = dtype
    quantized = set(names)
    unquantized = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized]
    qconfig = QuantizationConfig(config_groups={"group_0": preset}, ignore=unquantized)
    apply_quantization_config(hf, qconfig)
    kv_cache_scheme = None
    if observations is not None:
        kv_cache_scheme = attach_kv_cache_scales(hf, observations, dtype, kv_cache_strategy)
    with torch.no_grad():
        for name in tqdm(names, desc=f"quantize {scheme}", disable=not progress, file=sys.stderr):
            module = hf.get_submodule(name)
            scale, zero = weight_qparams(module.weight, module.quantization_scheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                zp = module.weight_zero_point
                zp.data = zero.to(zp.dtype).reshape(zp.shape)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.quantization_config.kv_cache_scheme = kv_cache_scheme
    compressor.compress_model(hf)
    os.makedirs(out, exist_ok=True)
    hf.save_pretrained(out)
    compressor.update_config(out)
    copy_other_files(source, out, {"config.json", "generation_config.json"})

    summary = {
        "scheme": scheme,
        "method": method,
        "group_size": group_size if scheme == "w4a16" else None,
        "kv_cache": kv_cache,
        "kv_cache_strategy": kv_cache_strategy,
        "ignore": list(ignore),
        "quantized": len(names),
    }
    config_path = os.path.join(out, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["kiln_quantize"] = summary
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return {**summary, "awq": awq} if awq is not None else summary


def run(args: argparse.Namespace) -> int:
    text = read_calibration(args.calibration)
    try:
        summary = quantize(
            args.source,
            args.out,
            args.scheme,
            args.method,
            args.group_size,
            args.ignore,
            text,
            args.max_calibration_tokens,
            kv_cache=args.kv_cache,
            kv_cache_strategy=args.kv_cache_strategy,
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(
        f"kiln quantize: {summary['quantized']} projections quantized ({summary['scheme']}, "
        f"{summary['method']}) -> {args.out}"
    )
    groups = [g for layer in summary.get("awq") or [] for g in layer.values()]
    if groups:
        ratio = sum(g["error"] / g["rtn_error"] for g in groups if g["rtn_error"] > 0) / len(groups)
        alphas = sum(g["alpha"] for g in groups) / len(groups)
        print(
            f"kiln quantize: AWQ scaled {len(groups)} projection groups (mean alpha {alphas:.2f}); their "
            f"output error on the calibration tokens is {ratio:.3f}x round-to-nearest's on average"
        )
    return 0
