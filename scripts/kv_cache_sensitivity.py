"""How sensitive greedy decoding of the embedded model is to a lossy KV cache, format by format.

The float32 model on the CPU with a float32 cache, except that every key and value row is rounded
through a format before it is written (a fake-quantized cache: the same numbers a real cache of that
format would return), over the prompt set of scripts/fp8_kv_agreement.py, plain and through the chat
template. Prints per format the leading greedy tokens equal to the plain float32 cache's, per prompt.

Formats: bf16, fp16 (round to the dtype), fp8 (e4m3 with Kiln's calibrated per-head scales and
centred keys, kiln.engine.kv_scales, as `kv_cache_dtype="fp8"` stores them), fp8_keys / fp8_values
(only one of the two), int8_token (symmetric int8, one scale per token and head).

    OMP_NUM_THREADS=2 python scripts/kv_cache_sensitivity.py --max-tokens 64 [--formats bf16,fp8]
"""

from __future__ import annotations

import argparse

import torch

FORMATS = ("bf16", "fp16", "fp8", "fp8_keys", "fp8_values", "int8_token")


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through e4m3 with one scale per head (values beyond 448 * scale saturate)."""
    s = scale.view(1, -1, 1).to(x.dtype)
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s


def int8_token_round(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through symmetric int8 with one scale per token and head."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; expected some of {', '.join(FORMATS)}")

    from fp8_kv_agreement import PROMPTS, leading_equal  # this folder is on sys.path

    import kiln.ops
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.kv_scales import calibrate_kv_cache, calibration_token_ids
    from kiln.loaders import load_model

    loaded = load_model(device="cpu", dtype=torch.float32)
    calibration = calibrate_kv_cache(loaded.model, calibration_token_ids(loaded.tokenizer))
    num_layers = len(calibration)
    write = kiln.ops.write_kv_cache
    state = {"format": None, "calls": 0}

    def rounding_write(key, value, key_cache, value_cache, slots, k_scale=None, v_scale=None):
        layer = state["calls"] % num_layers  # every forward writes the layers in order
        state["calls"] += 1
        fmt = state["format"]
        k_s, v_s, shift = calibration[layer]
        if fmt in ("bf16", "fp16"):
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
            key, value = key.to(dtype).float(), value.to(dtype).float()
        elif fmt == "int8_token":
            key, value = int8_token_round(key), int8_token_round(value)
        elif fmt is not None:
            if fmt in ("fp8", "fp8_keys"):
                key = fp8_round(key - shift, k_s) + shift
            if fmt in ("fp8", "fp8_values"):
                value = fp8_round(value, v_s)
        return write(key, value, key_cache, value_cache, slots, k_scale, v_scale)

    kiln.ops.write_kv_cache = rounding_write  # the attention layers look it up at call time
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = {
        "plain": [loaded.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS],
        "chat": [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS],
    }
    for name, batch in prompts.items():
        runs = {}
        for fmt in [None, *formats]:
            state["format"], state["calls"] = fmt, 0
            llm = LLM(loaded=loaded, device="cpu", kv_cache_bytes=256 << 20)
            runs[fmt] = [out.token_ids for out in llm.generate(batch, params)]
        for fmt in formats:
            leads = [leading_equal(a, b) for a, b in zip(runs[None], runs[fmt], strict=True)]
            reached = sum(lead >= 16 for lead in leads)
            summary = f"{reached}/{len(leads)} reach 16"
            print(f"{name:5s} {fmt:10s} leading equal tokens {leads}; {summary}", flush=True)


if __name__ == "__main__":
    main()
