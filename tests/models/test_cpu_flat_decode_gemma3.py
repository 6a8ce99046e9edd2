"""Gemma 3's layers through the one-token CPU decode as one flat loop (kiln.models.cpu_flat_decode), in
Python and as one native call (kiln_cpu.FlatDecode), on a tiny Gemma 3 GGUF of GGUF blocks with
sliding-window layers whose window the sequences exceed and global layers: the modules' floats bit for
bit, transformers' greedy tokens; and a loop that drops any one Gemma piece gives other floats."""

import pytest
import torch

from kiln.loaders import load_model
from kiln.models.cpu_flat_decode import NO_QK_NORM, FlatDecodeLayers, _native_decode
from kiln.models.gemma3 import Gemma3ForCausalLM
from kiln.ops import native_cpu
from kiln.ops.activation.silu_and_mul.cpu import silu_and_mul_cpu
from tests.models.test_cpu_flat_decode import _counting, _declared_decode_work, _engine, _run

pytest.importorskip("gguf")
pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.models.test_gemma3 import (  # noqa: E402
    GGUF_CASES,
    PROMPT,
    WINDOW,
    _gemma3,
    _hf_greedy,
    write_gemma3_gguf,
)

pytestmark = pytest.mark.skipif(not native_cpu.load(), reason="Kiln's native CPU library is not built here")

# every layer matrix in GGUF blocks with a native one-row kernel (the q4_blocks / q8_blocks layouts)
BLOCK_TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
               "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}  # fmt: skip
PROMPTS = [PROMPT, PROMPT[3:10]]  # 13 and 7 tokens, then 12 decode steps: past the local layers' window 4


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """(path of a tiny Gemma 3 GGUF: local and global layers, window 4; transformers' model on the
    weights the file holds)."""
    # the GGUF keys that say which layers are local (LOCAL_GLOBAL), their RoPE base, the scale
    overrides, metadata = GGUF_CASES["explicit_keys"]
    hf = _gemma3(**overrides, head_dim=32)  # one the native paged decode is built for (not 24)
    path = tmp_path_factory.mktemp("flat_gemma3") / "gemma3.gguf"
    stored = write_gemma3_gguf(hf, path, metadata=metadata, tensor_types=BLOCK_TYPES)
    with torch.no_grad():
        hf.load_state_dict(stored, strict=False)
    return str(path), hf


def _load(path):
    loaded = load_model(path, device="cpu", cpu_format="q4_blocks", lm_head_format="q8_blocks")
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    windows = [layer.self_attn.sliding_window for layer in loaded.model.layers]
    assert WINDOW in windows and None in windows  # local and global layers
    return loaded


def _one_at_a_time(engine, flat, max_tokens=12):
    """Greedy outputs (tokens, top-3 logprobs) of PROMPTS one at a time with `flat` as the model's loop
    (None: the modules)."""
    engine.runner.model.flat_decode = flat
    return [_run(engine, [p], max_tokens)[0] for p in PROMPTS]


def test_gemma3_native_flat_decode_gives_the_python_loops_the_modules_and_transformers_tokens(
    gemma_gguf, monkeypatch
):
    path, hf = gemma_gguf
    loaded = _load(path)
    engine = _engine(path, loaded, block_size=4)
    native = engine.runner.model.flat_decode
    assert native is not None and native.native is not None  # every linear has a native kernel
    calls = _counting(engine, monkeypatch)
    built = _one_at_a_time(engine, native)
    assert len(calls) == 2 * 11 and set(calls) == {1}
    monkeypatch.setenv("KILN_CPU_FLAT_DECODE", "python")
    python_loop = FlatDecodeLayers.build(loaded.model, engine.runner.kv_caches)
    assert python_loop is not None and python_loop.native is None
    assert _one_at_a_time(engine, python_loop) == built  # token ids and logprobs, bit for bit
    assert _one_at_a_time(engine, None) == built
    assert len(calls) == 4 * 11  # the modules did not call the loop
    assert [tokens for tokens, _ in built] == [_hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.skipif(native_cpu.blocks_gemm_rows() < 3, reason="no multi-row blocks kernels in this build")
def test_gemma3_native_flat_decode_runs_batched_steps_as_the_modules_do(gemma_gguf, monkeypatch):
    path, _ = gemma_gguf
    loaded = _load(path)
    engine = _engine(path, loaded, block_size=4)
    calls = _counting(engine, monkeypatch)
    prompts = [PROMPT, PROMPT[3:10], PROMPT[1:6]]
    batched = _run(engine, prompts, max_tokens=10)  # three sequences a decode step, one native call
    assert 3 in calls and set(calls) <= {1, 2, 3}
    loaded.model.flat_decode = None
    assert _run(engine, prompts, max_tokens=10) == batched  # token ids and logprobs, bit for bit


def _without(args, piece: str, model):
    """The layers' bound arguments with one Gemma piece dropped (Llama's in its place)."""
    if piece == "local_rope":  # every layer on the global layers' RoPE
        return [a._replace(cos_sin=model.rotary_global.cos_sin_cache) for a in args]
    dropped = {
        "post_feedforward_norm": {"norm_post_ff": None},
        "gelu_tanh": {"act_and_mul": silu_and_mul_cpu},
        "qk_norm": {"q_norm": None, "k_norm": None, "qk_norm_kind": NO_QK_NORM},
        "norm_offset": {"norm_offset": 0.0},
        "sliding_window": {"window": -1},
    }[piece]
    return [a._replace(**dropped) for a in args]


@pytest.mark.parametrize(
    "piece", ["post_feedforward_norm", "gelu_tanh", "qk_norm", "norm_offset", "sliding_window", "local_rope"]
)
def test_a_flat_decode_without_a_gemma_piece_gives_other_logprobs(gemma_gguf, piece):
    """The bit-for-bit checks above would fail if the loop dropped any one of these: each changes the
    logprobs of both the Python loop and the native call."""
    path, _ = gemma_gguf
    loaded = _load(path)
    engine = _engine(path, loaded, block_size=4)
    flat = engine.runner.model.flat_decode
    modules = _one_at_a_time(engine, None)
    args = _without(flat.layers, piece, loaded.model)
    kv_caches = engine.runner.kv_caches
    python_loop = FlatDecodeLayers(args, kv_caches, None, flat.layouts)
    native = FlatDecodeLayers(args, kv_caches, _native_decode(args), flat.layouts)
    assert native.native is not None
    for dropped in (python_loop, native):
        outputs = _one_at_a_time(engine, dropped)
        assert [logprobs for _, logprobs in outputs] != [logprobs for _, logprobs in modules], dropped.native


def test_gemma3_flat_decode_declares_to_a_profile_the_op_calls_the_modules_make(gemma_gguf):
    path, _ = gemma_gguf
    loaded = _load(path)
    engine = _engine(path, loaded, block_size=4)
    assert engine.runner.model.flat_decode.native is not None
    flat = _declared_decode_work(engine, PROMPTS[:1])
    engine.runner.model.flat_decode = None
    modules = _declared_decode_work(engine, PROMPTS[:1])
    assert flat == modules
    ops = [op for op, _, _ in flat]
    layers = len(loaded.model.layers)
    assert ops.count("rms_norm") == 6 * layers + 1  # four a layer, q and k heads, and the final norm
    assert ops.count("gelu_tanh_and_mul") == layers and "silu_and_mul" not in ops
