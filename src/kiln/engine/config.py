"""EngineConfig: the engine's knobs, and how the KV-cache size follows from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.exact_kv import ExactKVLayout, exact_kv_layout
from kiln.engine.speculative.config import SpeculativeConfig
from kiln.models.mixtral import EXPERT_FORMATS
from kiln.ops.attention.validate import FP8_DTYPES

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32, small on a 24 GiB box
# EngineConfig.kv_cache_dtype's accepted names -> the cache dtype (None = the model's own)
KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
KV_CACHE_SCALES = ("calibrated", "unit", "checkpoint")  # EngineConfig.kv_cache_scales


@dataclass
class EngineConfig:
    """Engine settings.

    model: None (the embedded SmolLM2-135M-Instruct GGUF), a GGUF file or an HF directory.
    max_num_seqs: most sequences running at once.
    max_num_batched_tokens: per-step token budget (decodes + prefill chunks); None = a device default.
    block_size: tokens per KV block (a power of two).
    kv_cache_bytes: KV budget in bytes (all layers, K and V); None = 1 GiB on CPU, or on CUDA the
        gpu_memory_utilization share of the GPU left after the model.
    num_kv_blocks: set the number of KV blocks directly (overrides the byte budgets; tests use it).
    max_model_len: longest prompt + output; None = the model's max_position_embeddings, capped by the cache.
    enforce_eager: skip CUDA-graph capture on CUDA, and the compiled decode step on the CPU.
    compile_cpu_decode: on the CPU, decode through a forward compiled per padded batch size
        (kiln.engine.cpu_compiled_step; each size compiles on its first step: ~2 minutes for SmolLM2
        from a cold inductor cache, 10-15 s from a warm one); one-sequence steps that the native
        one-call decode takes (GGUF-block layouts) run it instead, measured faster.
    cpu_format, lm_head_format: how the loader keeps CPU linear / LM-head weights ("int4",
        "int4_bf16", "int8", "int8_blocks", "q4_blocks", "q4_blocks_a8", "fp16", "bf16", "fp32", ...;
        None = the loader's default), see kiln.ops.gemm.weight_formats.
    speculative: speculative decoding (kiln.engine.speculative.SpeculativeConfig), None = off.
    expert_format: MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): None keeps the routed experts in the
        model dtype; "fp8" stores each expert float8_e4m3fn with its own scale (half a bf16 expert's
        bytes; fused_moe's fp8 path). A ValueError at load for a model without routed experts.
    kv_cache_dtype: "auto" (the model's dtype), "bfloat16" / "bf16" or "float16" / "fp16" (a 16-bit
        cache under a float32 model: half the bytes attention reads per step, and 2x the blocks; the
        attention layer rounds this step's q, k and v to the cache's dtype, attends in it and returns
        the model's dtype), or "fp8" / "fp8_e4m3" (float8_e4m3fn, one byte an
        element: 2x the blocks of a 16-bit cache, 4x those of a float32 one for the same budget). An
        fp8 cache has a float32 scale per kv head per layer for keys and for values (stored =
        value / scale), set by kv_cache_scales; values beyond 448 * scale saturate (in the fp8
        cache; the exact positions below keep them)
        (docs/contracts.md, "FP8 KV cache", has the greedy-token agreement measured).
    kv_cache_scales: for an fp8 cache, "calibrated" (measured at start-up by one prefill of Kiln's
        calibration text through the model, kiln.engine.kv_scales: per head, keys centred on their
        mean, which attention ignores, and scales at twice the peaks over 448), "unit" (1.0, as
        vLLM uses when a checkpoint gives none) or "checkpoint" (the per-layer k and v scales a quantized
        checkpoint ships, as vLLM uses them: compressed-tensors' kv_cache_scheme, self_attn.k_scale /
        v_scale, one per tensor or one per kv head; keys not centred; kiln.loaders.kv_scales; a
        ValueError at start-up when the checkpoint has none). A 16-bit cache ignores this ("checkpoint"
        logs that it does). Under tensor parallelism each rank calibrates its own heads at the same
        start-up point, or takes its heads' slice of per-head checkpoint scales; under pipeline
        parallelism calibrated scales stay 1.0 (logged), checkpoint scales apply.
    kv_cache_exact_window: for an fp8 cache, every sequence's first block and its last this many
        positions are also kept unrounded (float16) and attention reads them from there
        (kiln.engine.exact_kv): the attention sink and the recent tokens, where e4m3's rounding flips
        greedy tokens most. 0 keeps only the first block, None none. The float16 blocks (a ring of
        ceil((window + speculative tokens - 1) / block_size) blocks per sequence, none for window 0,
        and two first-block copies per sequence: max_num_seqs * (ring + 2)) come out of the KV budget.
    """

    model: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    compile_cpu_decode: bool = False
    seed: int = 0
    cpu_format: str | None = None
    lm_head_format: str | None = None
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "calibrated"
    kv_cache_exact_window: int | None = 32
    expert_format: str | None = None

    def __post_init__(self) -> None:
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(
                f"EngineConfig: expert_format={self.expert_format!r}, expected one of "
                + ", ".join(repr(name) for name in EXPERT_FORMATS)
            )
        window = self.kv_cache_exact_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
            raise ValueError(
                f"EngineConfig: kv_cache_exact_window={window!r}, expected an int >= 0 or None (off)"
            )
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(
                f"EngineConfig: kv_cache_scales={self.kv_cache_scales!r}, expected one of "
                + ", ".join(repr(name) for name in KV_CACHE_SCALES)
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig: kv_cache_dtype={self.kv_cache_dtype!r}, expected one of "
                + ", ".join(repr(name) for name in KV_CACHE_DTYPES)
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig: block_size={self.block_size}, expected a power of two")
        if self.max_num_seqs < 1:
            raise ValueError(f"EngineConfig: max_num_seqs={self.max_num_seqs}, expected >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"EngineConfig: max_num_batched_tokens={self.max_num_batched_tokens}, expected >= 1"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"EngineConfig: gpu_memory_utilization={self.gpu_memory_utilization}, expected in (0, 1]"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig: num_kv_blocks={self.num_kv_blocks}, expected >= 1")

    def resolved_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def token_budget(self, device: torch.device) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        # CPU: a 512-token chunk keeps decode steps interleaved with long prefills without hurting
        # prefill throughput much; GPUs want big batches.
        return 8192 if device.type == "cuda" else 512


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes over all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_kv_blocks_for(
    config: EngineConfig, device: torch.device, block_bytes: int, reserved_bytes: int = 0
) -> int:
    """How many KV blocks fit the configured budget (explicit count, byte size, or GPU share) once
    `reserved_bytes` (an fp8 cache's exact blocks) are taken out of it."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # keep (1 - utilization) of the whole GPU free, plus headroom for activations and graphs
        budget = free - (1.0 - config.gpu_memory_utilization) * total - (512 << 20)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    blocks = int((budget - reserved_bytes) // block_bytes)
    if blocks < 1:
        reserved = f" after {reserved_bytes} bytes of exact blocks" if reserved_bytes else ""
        raise ValueError(
            f"EngineConfig: a KV budget of {int(budget)} bytes holds no {block_bytes}-byte block{reserved}; "
            "raise kv_cache_bytes / gpu_memory_utilization"
            + (" or lower kv_cache_exact_window / max_num_seqs" if reserved_bytes else "")
        )
    return blocks


def kv_cache_dtype_for(config: EngineConfig, model) -> torch.dtype:
    """The dtype the engine allocates `model`'s KV cache in: config.kv_cache_dtype's, or for "auto"
    the model's own kv_cache_dtype (its activation dtype). A 16-bit cache is for a float32 model (or
    one of its own dtype): a bf16 model's values would overflow an fp16 cache, so that is refused."""
    dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or model.kv_cache_dtype
    own = model.kv_cache_dtype
    if dtype in (torch.bfloat16, torch.float16) and own not in (torch.float32, dtype):
        model_dtype = str(own).removeprefix("torch.")
        raise ValueError(
            f"EngineConfig: kv_cache_dtype={config.kv_cache_dtype!r} under a {model_dtype} model: a 16-bit "
            "cache takes a float32 model (or 'auto')"
        )
    return dtype


def exact_kv_layout_for(config: EngineConfig, kv_cache_dtype: torch.dtype) -> ExactKVLayout | None:
    """The exact positions of an fp8 cache under `config` (kiln.engine.exact_kv), None for other
    caches or with kv_cache_exact_window None."""
    if kv_cache_dtype not in FP8_DTYPES:
        return None
    spec = config.speculative
    return exact_kv_layout(
        config.kv_cache_exact_window,
        config.block_size,
        config.max_num_seqs,
        spec.num_speculative_tokens if spec is not None else 0,
    )


def num_kv_blocks_for_model(config: EngineConfig, device: torch.device, model) -> int:
    """How many KV blocks of `model` (its config's layers and kv heads, in kv_cache_dtype_for's dtype)
    fit the configured budget, after an fp8 cache's exact blocks."""
    c = model.config
    dtype = kv_cache_dtype_for(config, model)
    block_bytes = kv_block_bytes(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, dtype)
    layout = exact_kv_layout_for(config, dtype)
    reserved = 0
    if layout is not None:
        exact_block = kv_block_bytes(
            c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, torch.float16
        )
        reserved = layout.num_blocks * exact_block
    return num_kv_blocks_for(config, device, block_bytes, reserved)
