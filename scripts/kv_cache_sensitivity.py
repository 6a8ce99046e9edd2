"""How sensitive greedy decoding of the embedded model is to a lossy KV cache, format by format.

The float32 model on the CPU with a float32 cache, except that every key and value row is rounded
through a format before attention reads it (a fake-quantized cache: the same numbers a real cache of
that format would return). Prints per format the leading greedy tokens equal to the plain float32
cache's, per prompt, and how many prompts reach 16.

Prompt sets (--prompts): short (default), the 8 prompts of scripts/fp8_kv_agreement.py, plain and
through the chat template (3-10 and 33-40 tokens: much of a reply's cache is its own decoded
tokens); long, the chat template over Kiln's perplexity text (kiln/models/texts/perplexity.txt, never
calibrated on) and one of 8 short questions about it (417-423 tokens: most of the cache is the prompt).

Formats: bf16, fp16 (round to the dtype), fp8 (e4m3 with Kiln's calibrated per-head scales and
centred keys, kiln.engine.kv_scales, as `kv_cache_dtype="fp8"` stores them), fp8_keys / fp8_values
(only one of the two), int8_token (symmetric int8, one scale per token and head), fp8_token (e4m3,
one scale per token and head), fp8_rot / fp8_token_rot (fp8 / fp8_token in a Hadamard-rotated basis
of each head, as QuaRot rotates a cache: q.k and the attention output are unchanged by the rotation,
and it spreads outlier channels; fp8_rot's scales calibrated on the rotated keys and values), and
fp8_sink<S>[_window<W>] (fp8, except that the first S positions of a sequence and its W most recent
ones stay exact, as KIVI / IntactKV keep them; a position is rounded once it leaves the window).

    OMP_NUM_THREADS=2 python scripts/kv_cache_sensitivity.py --max-tokens 64 [--formats bf16,fp8]
    OMP_NUM_THREADS=2 python scripts/kv_cache_sensitivity.py --prompts long --max-tokens 48 \
        --formats bf16,fp16,fp8,fp8_sink4,fp8_sink4_window32
"""

from __future__ import annotations

import argparse
import re

import torch

FORMATS = (
    "bf16", "fp16", "fp8", "fp8_keys", "fp8_values", "int8_token", "fp8_token", "fp8_rot", "fp8_token_rot",
)  # fmt: skip
SINK_WINDOW = re.compile(r"fp8_sink(\d+)(?:_window(\d+))?")

# Questions about kiln/models/texts/perplexity.txt, one per long prompt.
LONG_QUESTIONS = (
    "Summarise this text in two sentences.",
    "What did the potters dig?",
    "How could a good potter tell the quality of the clay?",
    "What were the kilns built from?",
    "Why did someone sit beside the firebox for two nights?",
    "Where was most of the work sold?",
    "Give this text a short title.",
    "What does the river leave along the fields every spring?",
)


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through e4m3 with one scale per head (values beyond 448 * scale saturate)."""
    s = scale.view(1, -1, 1).to(x.dtype)
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s


def fp8_token_round(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through e4m3 with one scale per token and head (its peak at 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [d, d] float32 (d a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def rotated(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to x [T, H, D] in the Hadamard-rotated basis, rotated back."""
    h = hadamard(x.shape[-1]).to(x.dtype)
    return fn(x @ h) @ h.T


def rotated_calibration(model, tokenizer, calibration):
    """Per layer (k_scale, v_scale) [Hkv] of the Hadamard-rotated centred keys and values, as
    kiln.engine.kv_scales calibrates the plain ones (the peak over the calibration text, headroom 2)."""
    from kiln.engine import kv_scales

    out, headroom = [], kv_scales.DEFAULT_HEADROOM / kv_scales.FP8_E4M3_MAX
    kv = kv_scales.prefill_keys_values(model, kv_scales.calibration_token_ids(tokenizer))
    for (_, _, shift), (keys, values) in zip(calibration, kv, strict=True):
        h = hadamard(keys.shape[-1])
        k_peak, v_peak = (((t @ h).abs().amax(dim=(0, 2))) for t in (keys - shift, values))
        out.append((k_peak * headroom, v_peak * headroom))
    return out


def int8_token_round(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] through symmetric int8 with one scale per token and head."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def sink_window(fmt: str) -> tuple[int, int] | None:
    """(S, W) of an fp8_sink<S>[_window<W>] format (W = 0 when absent), else None."""
    match = SINK_WINDOW.fullmatch(fmt)
    return None if match is None else (int(match.group(1)), int(match.group(2) or 0))


class RoundingWrite:
    """Stands in for kiln.ops.write_kv_cache and rounds what the layers write through one format.

    calibration: per layer (k_scale [Hkv], v_scale [Hkv], k_shift [Hkv, head_dim]) float32;
    rotated_scales: per layer fp8_rot's (k_scale, v_scale) (rotated_calibration), when run. The
    sink/window formats write exact rows, then round in place, layer by layer, every position in
    [S, length - W) not rounded yet; they need the slots written to be ONE sequence's positions in
    order, so those formats are run one prompt per engine (a batch interleaves sequences' slots, and
    a prefix-cache hit would skip the shared positions' writes).
    """

    def __init__(self, write, calibration, rotated_scales=None):
        self.write, self.calibration, self.rotated_scales = write, calibration, rotated_scales
        self.reset(None)

    def reset(self, fmt: str | None) -> None:
        """Start a new engine run (format None: write unchanged)."""
        num_layers = len(self.calibration)
        self.format, self.sink_window, self.calls = fmt, fmt and sink_window(fmt), 0
        self.slots = [[] for _ in range(num_layers)]  # per layer: the sequence's slots, position order
        self.rounded = [0] * num_layers  # per layer: positions [S, rounded) are rounded already

    def __call__(self, key, value, key_cache, value_cache, slots, k_scale=None, v_scale=None):
        layer = self.calls % len(self.calibration)  # every forward writes the layers in order
        self.calls += 1
        fmt = self.format
        k_s, v_s, shift = self.calibration[layer]
        if fmt in ("bf16", "fp16"):
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
            key, value = key.to(dtype).float(), value.to(dtype).float()
        elif fmt == "int8_token":
            key, value = int8_token_round(key), int8_token_round(value)
        elif fmt == "fp8_token":
            key, value = fp8_token_round(key - shift) + shift, fp8_token_round(value)
        elif fmt == "fp8_token_rot":
            key = rotated(fp8_token_round, key - shift) + shift
            value = rotated(fp8_token_round, value)
        elif fmt == "fp8_rot":
            k_rot, v_rot = self.rotated_scales[layer]
            key = rotated(lambda x: fp8_round(x, k_rot), key - shift) + shift
            value = rotated(lambda x: fp8_round(x, v_rot), value)
        elif fmt in ("fp8", "fp8_keys", "fp8_values"):
            if fmt in ("fp8", "fp8_keys"):
                key = fp8_round(key - shift, k_s) + shift
            if fmt in ("fp8", "fp8_values"):
                value = fp8_round(value, v_s)
        out = self.write(key, value, key_cache, value_cache, slots, k_scale, v_scale)
        if self.sink_window:
            self._round_outside(layer, slots, key_cache, value_cache)
        return out

    def _round_outside(self, layer, slots, key_cache, value_cache) -> None:
        sink, window = self.sink_window
        history = self.slots[layer]
        history.extend(s for s in slots.tolist() if s >= 0)
        start, end = max(self.rounded[layer], sink), len(history) - window
        if end <= start:
            return
        k_s, v_s, shift = self.calibration[layer]
        index = torch.tensor(history[start:end])
        keys = key_cache.view(-1, *key_cache.shape[2:])  # [slots, Hkv, D], views of the caches
        values = value_cache.view(-1, *value_cache.shape[2:])
        keys[index] = fp8_round(keys[index] - shift, k_s) + shift
        values[index] = fp8_round(values[index], v_s)
        self.rounded[layer] = end


def prompt_sets(tokenizer, which: str) -> dict[str, list[list[int]]]:
    """Name -> token ids of each prompt, for --prompts short or long."""
    if which == "long":
        from kiln.models.calibration import read_text

        text = read_text("perplexity.txt").strip()
        chats = [[{"role": "user", "content": f"{text}\n\n{q}"}] for q in LONG_QUESTIONS]
        return {"long": [tokenizer.encode_chat(c) for c in chats]}
    from fp8_kv_agreement import PROMPTS  # this folder is on sys.path

    return {
        "plain": [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS],
        "chat": [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prompts", choices=["short", "long"], default="short")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(f for f in set(formats) if f not in FORMATS and sink_window(f) is None)
    if unknown:
        expected = ", ".join(FORMATS) + ", fp8_sink<S>[_window<W>]"
        parser.error(f"unknown formats {unknown}; expected some of {expected}")
    one_at_a_time = any(sink_window(f) for f in formats)

    from fp8_kv_agreement import leading_equal  # this folder is on sys.path

    import kiln.ops
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.kv_scales import calibrate_kv_cache, calibration_token_ids
    from kiln.loaders import load_model

    loaded = load_model(device="cpu", dtype=torch.float32)
    calibration = calibrate_kv_cache(loaded.model, calibration_token_ids(loaded.tokenizer))
    rotated_scales = None
    if "fp8_rot" in formats:
        rotated_scales = rotated_calibration(loaded.model, loaded.tokenizer, calibration)
    rounding_write = RoundingWrite(kiln.ops.write_kv_cache, calibration, rotated_scales)
    kiln.ops.write_kv_cache = rounding_write  # the attention layers look it up at call time
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def generate(fmt: str | None, batch: list[list[int]]) -> list[list[int]]:
        llm = LLM(loaded=loaded, device="cpu", kv_cache_bytes=256 << 20)
        rounding_write.reset(fmt)  # after the engine's construction: only the prompts' writes count
        return [out.token_ids for out in llm.generate(batch, params)]

    width = max(10, *(len(f) for f in formats))
    for name, batch in prompt_sets(loaded.tokenizer, args.prompts).items():
        print(f"{name} prompt lengths in tokens {[len(p) for p in batch]}", flush=True)
        runs = {}
        for fmt in [None, *formats]:
            # every format, the reference included, runs the same way, so only the rounding differs
            if one_at_a_time:
                runs[fmt] = [generate(fmt, [prompt])[0] for prompt in batch]
            else:
                runs[fmt] = generate(fmt, batch)
        for fmt in formats:
            leads = [leading_equal(a, b) for a, b in zip(runs[None], runs[fmt], strict=True)]
            reached = sum(lead >= 16 for lead in leads)
            summary = f"{reached}/{len(leads)} reach 16"
            print(f"{name:5s} {fmt:{width}s} leading equal tokens {leads}; {summary}", flush=True)


if __name__ == "__main__":
    main()
