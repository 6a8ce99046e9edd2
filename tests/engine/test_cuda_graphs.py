"""CUDA-graph decode: padded batch sizes, a failed capture is recorded as a fallback, and (GPU only)
graphs give the eager path's greedy tokens on the random:tiny model (no model file needed)."""

import types

import pytest
import torch

from kiln import fallbacks
from kiln.engine import LLM, SamplingParams
from kiln.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes


@pytest.fixture
def no_fallbacks():
    fallbacks.clear()
    yield
    fallbacks.clear()


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    for max_num_seqs in (1, 3, 8, 17, 64, 100):
        sizes = graph_batch_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1
        assert all(any(s >= n for s in sizes) for n in range(1, max_num_seqs + 1))
        assert sizes[-1] < max_num_seqs + 16


def test_failed_capture_is_recorded_as_a_fallback_to_eager(no_fallbacks):
    def forward(*args):
        raise RuntimeError("op is not graph-safe")

    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(forward=forward),
        device=torch.device("cpu"),
        max_model_len=64,
        block_size=16,
        kv_caches=[],
        exact_kv=None,
    )
    with pytest.raises(RuntimeError, match="not graph-safe"):
        DecodeGraphs(runner, max_num_seqs=4)
    (entry,) = fallbacks.taken()
    assert entry["kind"] == fallbacks.CUDA_GRAPH_TO_EAGER and "not graph-safe" in entry["detail"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])  # fp8: with exact positions (the default)
def test_cuda_graph_decode_matches_eager_greedy_tokens(no_fallbacks, kv_cache_dtype):
    from kiln.loaders import load_model

    # float32: random weights give near-tied logits, which bf16 rounding could flip between the paths
    loaded = load_model("random:tiny", device="cuda", dtype=torch.float32)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    # 40 tokens: decode steps run past the first block and the 32-position window of an fp8 cache
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine_args = dict(device="cuda", max_num_seqs=8, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype)
    graphed = LLM(loaded=loaded, **engine_args)
    assert graphed.engine.runner.graphs is not None, f"CUDA graph capture failed: {fallbacks.taken()}"
    assert (graphed.engine.runner.exact_kv is not None) == (kv_cache_dtype == "fp8")
    eager = LLM(loaded=loaded, **engine_args, enforce_eager=True)
    ours = graphed.generate(prompts, params)
    ref = eager.generate(prompts, params)
    # batch-size-dependent kernels may still flip a near-tie late; the first tokens must agree
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids[:8] == b.token_ids[:8]
    assert fallbacks.taken() == []
