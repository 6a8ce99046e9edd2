"""The compiled CPU decode step (kiln.engine.cpu_compiled_step) against the eager forward, on a tiny
random fp32 Llama: same logits step after step, padded batch sizes included, and a failing compile
falls back to eager decoding with the fallback recorded."""

import pytest
import torch

import kiln.ops
from kiln import fallbacks
from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kiln.engine.cpu_compiled_step import CPU_COMPILE_TO_EAGER, CompiledDecodeSteps
from kiln.loaders import load_model

MODEL = "random:tiny:seed=3"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, device="cpu", dtype=torch.float32)


def make_engine(loaded, compile_cpu_decode=True, **kw):
    config = EngineConfig(
        model=MODEL,
        device="cpu",
        max_num_seqs=4,
        num_kv_blocks=32,
        compile_cpu_decode=compile_cpu_decode,
        **kw,
    )
    return LLMEngine(config, loaded=loaded)


def add_requests(engine, num):
    for i in range(num):
        prompt = [(7 * i + 3 * j) % 300 + 1 for j in range(5 + 4 * i)]  # different lengths
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("logits_in_graph", [True, False])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_compiled_decode_logits_equal_eager_over_steps(loaded, num_seqs, logits_in_graph):
    """The compiled step's logits, the LM head in its graph (the default without tensor parallelism)
    or left to the eager compute_logits (as under tensor parallelism), equal the eager forward's."""
    engine = make_engine(loaded)
    runner, scheduler = engine.runner, engine.scheduler
    assert runner.compiled_decode.logits_in_graph
    runner.compiled_decode.logits_in_graph = logits_in_graph  # read when the graph is traced

    def compiled_logits(*args):
        out = runner.compiled_decode.run(*args)
        return out if logits_in_graph else loaded.model.compute_logits(out)

    add_requests(engine, num_seqs)
    engine.step()  # prefill (eager)
    for _ in range(4):
        batch = scheduler.schedule()
        inputs, _ = runner.prepare(batch)
        assert inputs.attn_metadata.decode_only and len(batch.seqs) == num_seqs
        args = (inputs.input_ids, inputs.positions, inputs.attn_metadata)
        with torch.inference_mode(), kiln.ops.trusted_inputs():
            eager = loaded.model.compute_logits(
                loaded.model.forward(args[0], args[1], runner.kv_caches, args[2])
            )
            compiled = compiled_logits(*args)
        assert compiled.shape == eager.shape == (num_seqs, loaded.config.vocab_size)
        assert not compiled.isnan().any()
        assert relative_error(compiled, eager) < 1e-5
        tokens, _ = runner.run(batch)  # the compiled step again (same slots, same values): advance
        scheduler.postprocess(batch, tokens)
    padded = 1 if num_seqs == 1 else 4
    assert runner.compiled_decode.compiled_sizes == {padded}
    assert not runner.compiled_decode.failed


def test_compiled_decode_on_w8a8_weights_equals_eager():
    """cpu_format "w8a8" (SmoothQuant-calibrated int8 copies, x quantized per row by the native op,
    one graph node per GEMM): three sequences padded to 4 rows, so every layer runs W8A8."""
    from kiln.ops.gemm import cpu_w8a8

    if not cpu_w8a8.load():
        pytest.skip("the native W8A8 op or oneDNN's int8 GEMM is not available here")
    w8a8 = load_model(MODEL, device="cpu", dtype=torch.float32, cpu_format="w8a8", lm_head_format="w8a8")
    assert w8a8.model.layers[0].mlp.down_proj.prepared.layout == "w8a8_packed"
    engine = make_engine(w8a8)
    runner, scheduler = engine.runner, engine.scheduler
    add_requests(engine, 3)
    engine.step()  # prefill (eager)
    for _ in range(3):
        batch = scheduler.schedule()
        inputs, _ = runner.prepare(batch)
        args = (inputs.input_ids, inputs.positions, inputs.attn_metadata)
        with torch.inference_mode(), kiln.ops.trusted_inputs():
            compiled = runner.compiled_decode.run(*args)
            eager = w8a8.model.compute_logits(w8a8.model.forward(args[0], args[1], runner.kv_caches, args[2]))
        assert not compiled.isnan().any()
        # measured ~1e-7; a graph whose fused float32 norms moved an element of x across an int8
        # rounding boundary would move that row by one step of 255 (~1e-4 here)
        assert relative_error(compiled, eager) < 1e-4
        tokens, _ = runner.run(batch)
        scheduler.postprocess(batch, tokens)
    assert runner.compiled_decode.compiled_sizes == {4} and not runner.compiled_decode.failed


def test_compile_options_name_the_vector_width(loaded):
    """Each compile names inductor's vector width, so a graph cached on disk under one ISA is not
    compiled from under another (kiln.ops.cpu_inductor; tests/ops/test_cpu_inductor.py runs it)."""
    from kiln.ops.cpu_inductor import isa_options

    seen = {}

    def recording_compile(fn, **kwargs):
        seen.update(kwargs["options"])
        return fn

    CompiledDecodeSteps(make_engine(loaded).runner, 4, compile_fn=recording_compile)
    assert seen["cpp.simdlen"] == isa_options()["cpp.simdlen"] and seen["cpp_wrapper"]


def test_failed_compile_falls_back_to_eager_and_is_recorded(loaded):
    def failing_compile(fn, **options):
        def run(*args):
            raise RuntimeError("inductor says no")

        return run

    fallbacks.clear()
    eager_engine = make_engine(loaded, compile_cpu_decode=False)
    engine = make_engine(loaded)
    engine.runner.compiled_decode = CompiledDecodeSteps(engine.runner, 4, compile_fn=failing_compile)
    finished = []
    for e in (eager_engine, engine):
        add_requests(e, 2)
        tokens = {}
        while e.has_unfinished_requests():
            tokens.update({out.request_id: out.token_ids for out in e.step() if out.finished})
        finished.append(tokens)
    assert engine.runner.compiled_decode.failed
    assert [f["kind"] for f in fallbacks.taken()] == [CPU_COMPILE_TO_EAGER]
    assert "inductor says no" in fallbacks.taken()[0]["detail"]
    assert finished[1] == finished[0] and all(len(t) == 12 for t in finished[0].values())
    fallbacks.clear()


def test_enforce_eager_turns_the_compiled_step_off(loaded):
    assert make_engine(loaded, enforce_eager=True).runner.compiled_decode is None
    assert make_engine(loaded, compile_cpu_decode=False).runner.compiled_decode is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
def test_compiled_decode_over_a_growing_context_equals_eager_and_compiles_once(loaded, kv_cache_dtype):
    """Three sequences (padded to 4) decode from 5-13 tokens past 50, across three block boundaries:
    the float cache's write and attention are graph code reading a block table whose width grows
    step by step (a dynamic dimension), the fp8 cache's stay opaque nodes; either way the logits
    equal eager ones every step (the compiled step runs first, so its attention reads its own
    write), and the batch size compiles one graph."""
    from torch._dynamo.utils import counters

    engine = make_engine(loaded, kv_cache_dtype=kv_cache_dtype, kv_cache_scales="unit")
    runner, scheduler = engine.runner, engine.scheduler
    for i in range(3):
        prompt = [(7 * i + 3 * j) % 300 + 1 for j in range(5 + 4 * i)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill (eager)
    graphs_before = counters["stats"]["unique_graphs"]
    widths = set()
    while engine.has_unfinished_requests():
        batch = scheduler.schedule()
        inputs, _ = runner.prepare(batch)
        args = (inputs.input_ids, inputs.positions, inputs.attn_metadata)
        widths.add(-(-inputs.attn_metadata.max_seqlen_k // runner.block_size))
        with torch.inference_mode(), kiln.ops.trusted_inputs():
            # compiled first: its attention reads the keys its own write put in the cache
            compiled = runner.compiled_decode.run(*args)  # logits: the LM head is in the graph
            eager = loaded.model.compute_logits(
                loaded.model.forward(args[0], args[1], runner.kv_caches, args[2])
            )
        assert not compiled.isnan().any()
        # bf16: the graph's fused float32 code (RoPE, norms) differs from eager's in the last bits,
        # and rounding q, k, v to bf16 turns that into a whole bf16 step where an element sits at a
        # rounding boundary (measured up to 1.0e-3 over 30 layers; fp8 rounds in its opaque write)
        assert relative_error(compiled, eager) < {"auto": 1e-5, "bfloat16": 3e-3, "fp8": 1e-4}[kv_cache_dtype]
        tokens, _ = runner.run(batch)
        scheduler.postprocess(batch, tokens)
    assert widths >= {2, 3, 4}
    assert runner.compiled_decode.compiled_sizes == {4}
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert not runner.compiled_decode.failed


def test_llm_compiles_each_batch_size_with_no_fallback():
    """The path users take (LLM.generate, several batch sizes in one engine, validation on): every
    size compiles with no fallback taken, and the tokens equal an eager engine's."""
    fallbacks.clear()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for compile_cpu_decode in (False, True):
        llm = LLM(MODEL, device="cpu", max_num_seqs=4, compile_cpu_decode=compile_cpu_decode)
        tokens = []
        for n in (1, 2, 3, 1):  # 3 pads to 4: a padding row's write
            prompts = [[5 + n + i, 6, 7, 8 + i] for i in range(n)]
            tokens += [out.token_ids for out in llm.generate(prompts, params)]
        outputs.append(tokens)
    assert fallbacks.taken() == []
    assert llm.engine.runner.compiled_decode.compiled_sizes == {1, 2, 4}
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
def test_an_engine_built_in_inference_mode_compiles_its_decode_steps(kv_cache_dtype):
    """The caches must be ordinary tensors (the compiled step writes them outside inference mode),
    however the engine was built; fp8 with its calibrated scales (made by a prefill in inference mode)."""
    fallbacks.clear()
    with torch.inference_mode():
        llm = LLM(MODEL, device="cpu", max_num_seqs=2, compile_cpu_decode=True, kv_cache_dtype=kv_cache_dtype)
    caches = [t for layer in llm.engine.runner.kv_caches for t in layer if t is not None]
    assert not any(t.is_inference() for t in caches)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert llm.engine.runner.compiled_decode.compiled_sizes == {1}
    assert fallbacks.taken() == []


@pytest.mark.parametrize("native", [False, True])
def test_a_context_past_the_in_graph_limit_compiles_a_second_graph(monkeypatch, native):
    """Past IN_GRAPH_MAX_CONTEXT (lowered to 256 here) the tensor-form decode attention becomes an
    opaque node in a second graph of the same batch size: one more compile, no fallback, eager's
    tokens. With the native kernel (loaded when the engine starts) the attention is one node at any
    context: one graph."""
    import importlib

    from torch._dynamo.utils import counters

    from kiln.ops.attention.paged_decode_attention import cpu_native

    cpu_attention = importlib.import_module("kiln.ops.attention.paged_decode_attention.cpu")
    monkeypatch.setattr(cpu_attention, "IN_GRAPH_MAX_CONTEXT", 256)
    if not native:  # no head dim built: the tensor form runs (as where the library cannot be built)
        cpu_native.load()
        monkeypatch.setitem(cpu_native._state, "head_dims", frozenset())
    elif not cpu_native.load():
        pytest.skip("Kiln's native CPU library could not be built here")
    fallbacks.clear()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [[(7 * j) % 300 + 1 for j in range(250)]]  # decodes from 251 to 265 positions
    outputs = []
    for compile_cpu_decode in (False, True):
        llm = LLM(MODEL, device="cpu", max_num_seqs=2, compile_cpu_decode=compile_cpu_decode)
        graphs_before = counters["stats"]["unique_graphs"]
        outputs.append(llm.generate(prompt, params)[0].token_ids)
    assert counters["stats"]["unique_graphs"] - graphs_before == (1 if native else 2)
    assert fallbacks.taken() == []
    assert outputs[1] == outputs[0]


def test_contexts_reaching_the_cache_capacity_at_batch_size_4_compile_once():
    """Three sequences (padded to 4, finishing together) decode until the longest reaches
    max_model_len: the cut block table reaches the buffer's full width (where a view of it would
    turn contiguous and recompile); one graph."""
    from torch._dynamo.utils import counters

    fallbacks.clear()
    engine = make_engine(loaded=load_model(MODEL, device="cpu", dtype=torch.float32), max_model_len=64)
    for i in range(3):
        prompt = [(5 * i + 3 * j) % 300 + 1 for j in range(20 + i)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=42, temperature=0.0, ignore_eos=True))
    graphs_before = counters["stats"]["unique_graphs"]
    while engine.has_unfinished_requests():
        engine.step()
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert engine.runner.compiled_decode.compiled_sizes == {4}
    assert fallbacks.taken() == []
