"""Single-sequence decode speed of a Kiln model, without the engine:
`python -m kiln.models.decode_speed [--model PATH] [--cpu-format fp16|int4|fp32] [--steps 128] [--threads N]`.

Prefills a short prompt into a paged KV cache, then times `steps` greedy decode steps (forward of one
token + logits + argmax) with time.perf_counter; also reports process CPU time per token, which
stays meaningful on a shared machine where wall time is inflated by other processes.
"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.loaders import load_model
from kiln.models.attention_metadata import AttentionMetadata


def decode_tokens_per_second(
    model, prompt: list[int], steps: int, block_size: int = 16
) -> tuple[float, float]:
    """(wall tok/s, CPU-time tok/s) over `steps` greedy decode steps after prefilling `prompt`."""
    c, device = model.config, model.device
    num_blocks = (len(prompt) + steps + 8) // block_size + 1
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    kv_caches = [
        (
            torch.zeros(shape, dtype=model.kv_cache_dtype, device=device),
            torch.zeros(shape, dtype=model.kv_cache_dtype, device=device),
        )
        for _ in range(c.num_layers)
    ]
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]

    def step(tokens: list[int], start: int) -> int:
        n = len(tokens)
        positions = torch.arange(start, start + n, device=device)
        metadata = AttentionMetadata(
            slot_mapping=positions.clone(),  # blocks in order: slot == position
            block_tables=block_table,
            seq_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            max_seqlen_q=n,
            max_seqlen_k=start + n,
            decode_only=n == 1,
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        hidden = model(ids, positions, kv_caches, metadata)
        return int(model.compute_logits(hidden[-1:]).argmax())

    with torch.inference_mode():
        token, length = step(prompt, 0), len(prompt)
        for _ in range(4):  # warm-up
            token, length = step([token], length), length + 1
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            token, length = step([token], length), length + 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return steps / wall, steps / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    parser.add_argument("--cpu-format", default=None, help="fp16 | int4 | fp32 | bf16 (default: loader's)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, cpu_format=args.cpu_format, lm_head_format=args.cpu_format)
    prompt = loaded.tokenizer.encode("The history of pottery kilns begins")
    wall, cpu = decode_tokens_per_second(loaded.model, prompt, args.steps)
    print(
        f"decode, 1 sequence, {args.steps} steps, {torch.get_num_threads()} threads: {wall:.1f} tok/s wall "
        f"({1e3 / wall:.2f} ms/token); CPU time {1e3 / cpu:.2f} ms/token"
    )


if __name__ == "__main__":
    main()
