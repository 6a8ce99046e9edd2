"""How far greedy decoding in each CPU weight format agrees with the float32 weights (the checkpoint's
values, the format whose tokens equal HF transformers'), on the embedded SmolLM2-135M-Instruct or
--model (a GGUF file; --no-chat for one without a chat template).

For each format (layers and LM head both in it, or the head in --lm-head-format; a weight the format
cannot hold keeps the fallback kiln.ops.gemm.weight_formats gives it), the 8 prompts of
scripts/fp8_kv_agreement.py, plain and through the chat template, generate --max-tokens greedy
tokens; prints per prompt the leading tokens equal to the fp32 run's, and where they part the fp32
run's top-1 minus top-2 logprob there (a near tie, which any rounding can flip).

By default the 8 prompts run as one batch, so prefill and decode give every layer several rows;
--one-at-a-time runs each prompt alone, so decode takes the one-row paths (single-stream decode: the
int4 kernel of "int4_bf16", the fp16 GEMV of "fp16"). --compile-cpu-decode decodes the formats (not
the fp32 reference) through the compiled step, as the fast configuration does (its first step per
batch size compiles: minutes).

    OMP_NUM_THREADS=2 python scripts/cpu_format_agreement.py --max-tokens 64 [--formats fp16,int4_bf16]
        [--one-at-a-time] [--lm-head-format int8_blocks] [--compile-cpu-decode] [--kv-cache-dtype bfloat16]
        [--model FILE.gguf] [--no-chat]
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", default="fp16,bf16,int4,int4_bf16,int8")
    parser.add_argument("--one-at-a-time", action="store_true", help="one prompt per generate call")
    parser.add_argument(
        "--lm-head-format", help="the LM head's format in every run but fp32's (default: each format)"
    )
    parser.add_argument(
        "--compile-cpu-decode", action="store_true", help="decode the formats through the compiled step"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="the formats' KV cache (the fp32 reference keeps float32)"
    )
    parser.add_argument("--model", help="a GGUF file or HF directory (default: the embedded one)")
    parser.add_argument("--no-chat", action="store_true", help="plain prompts only (no chat template)")
    args = parser.parse_args()

    import torch
    from fp8_kv_agreement import PROMPTS, leading_equal  # this folder is on sys.path

    from kiln.engine import LLM, SamplingParams
    from kiln.loaders import load_model
    from kiln.ops.gemm.weight_formats import CPU_WEIGHT_FORMATS

    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(CPU_WEIGHT_FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; expected some of {', '.join(CPU_WEIGHT_FORMATS)}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for fmt in ["fp32", *formats]:
        head = fmt if fmt == "fp32" else args.lm_head_format or fmt
        loaded = load_model(
            args.model, device="cpu", dtype=torch.float32, cpu_format=fmt, lm_head_format=head
        )
        tokenizer = loaded.tokenizer
        prompts = {"plain": [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]}
        if not args.no_chat:
            prompts["chat"] = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        compiled = args.compile_cpu_decode and fmt != "fp32"
        kv_cache_dtype = "auto" if fmt == "fp32" else args.kv_cache_dtype
        llm = LLM(
            loaded=loaded,
            device="cpu",
            kv_cache_bytes=256 << 20,
            compile_cpu_decode=compiled,
            kv_cache_dtype=kv_cache_dtype,
        )
        if args.one_at_a_time:
            runs[fmt] = {name: [llm.generate([p], params)[0] for p in ps] for name, ps in prompts.items()}
        else:
            runs[fmt] = {name: llm.generate(batch, params) for name, batch in prompts.items()}
    for fmt in formats:
        for name in runs["fp32"]:
            leads, gaps = [], []
            for ref, out in zip(runs["fp32"][name], runs[fmt][name], strict=True):
                lead = leading_equal(ref.token_ids, out.token_ids)
                leads.append(lead)
                if lead < len(ref.token_ids):
                    top = sorted(ref.logprobs[lead].values(), reverse=True)
                    gaps.append(round(top[0] - top[1], 3))
            reached = sum(lead >= 16 for lead in leads)
            print(
                f"{fmt:9s} {name:5s} leading equal tokens {leads}; median {statistics.median(leads)}; "
                f"{reached}/{len(leads)} reach 16; fp32 top-2 gaps where they part {gaps}",
                flush=True,
            )


if __name__ == "__main__":
    main()
