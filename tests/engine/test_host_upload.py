"""A step's host arrays in one copy (kiln.engine.host_upload): the packed buffer gives back every array's
values, dtype and shape (odd byte lengths, empty and transposed arrays between others), and an engine
whose model runner packs its inputs (the CUDA default, forced here on the CPU) computes the same
logits step for step as one that sends them one by one, on an fp8 cache with exact positions and a
prefix hit (every array prepare makes, the exact-fill pairs included)."""

import numpy as np
import pytest
import torch

from kiln.engine import EngineConfig, LLMEngine, SamplingParams
from kiln.engine.host_upload import upload
from kiln.loaders import load_model
from tests.distributed.checkpoints import record_logits, run_to_completion


def arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.integers(-(2**40), 2**40, size=5, dtype=np.int64),
        rng.integers(-(2**30), 2**30, size=(3, 7), dtype=np.int32),
        np.empty(0, dtype=np.int64),
        rng.integers(0, 2**20, size=(2, 3), dtype=np.int64).T,  # not contiguous
        rng.random(3) < 0.5,  # 3 bytes: the next array starts past a pad
        rng.standard_normal(9).astype(np.float32),
        rng.integers(0, 100, size=1, dtype=np.int32),
        np.array(rng.integers(0, 100), dtype=np.int64),  # 0-d
    ]


@pytest.mark.parametrize("pack", [True, False])
def test_every_array_comes_back_with_its_values_dtype_and_shape(pack):
    given = arrays(np.random.default_rng())
    sent = upload(torch.device("cpu"), given, pack)
    assert len(sent) == len(given)
    for tensor, array in zip(sent, given, strict=True):
        assert tensor.is_contiguous() and tuple(tensor.shape) == array.shape
        assert tensor.dtype == torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        assert np.array_equal(tensor.numpy(), array)
    storages = {t.untyped_storage().data_ptr() for t in sent}
    assert (len(storages) == 1) == pack  # packed: views of the one buffer that was sent


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny:seed=3", device="cpu", dtype=torch.float32)


def step_logits(tiny, pack: bool) -> tuple[dict, list[torch.Tensor]]:
    config = EngineConfig(device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8", kv_cache_exact_window=8)
    engine = LLMEngine(config, loaded=tiny)
    engine.runner.pack_uploads = pack
    logits = record_logits(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 72)), list(range(40, 49))]
    try:
        tokens = run_to_completion(engine, prompts, params)
        tokens.update({f"again-{k}": v for k, v in run_to_completion(engine, prompts[:1], params).items()})
    finally:
        del tiny.model.compute_logits  # record_logits' wrapper: the module's own method again
    assert engine.stats().prefix_cache_hits > 0  # the second run filled its ring from the fp8 cache
    return tokens, logits


def test_an_engine_packing_its_inputs_computes_the_same_logits(tiny, monkeypatch):
    import kiln.engine.model_runner as model_runner

    fills = []
    real = model_runner.copy_exact_fill
    monkeypatch.setattr(model_runner, "copy_exact_fill", lambda *a: fills.append(a[1].numel()) or real(*a))
    packed_tokens, packed = step_logits(tiny, pack=True)
    assert fills and min(fills) > 0  # the exact-fill pairs were among the packed arrays
    tokens, logits = step_logits(tiny, pack=False)
    assert packed_tokens == tokens and len(packed) == len(logits)
    for a, b in zip(packed, logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_packed_arrays_reach_a_gpu_from_pinned_memory_in_one_buffer():
    given = arrays(np.random.default_rng())
    sent = upload(torch.device("cuda"), given)  # packs on CUDA by default
    torch.cuda.synchronize()
    assert {t.device.type for t in sent} == {"cuda"}
    assert len({t.untyped_storage().data_ptr() for t in sent}) == 1
    for tensor, array in zip(sent, given, strict=True):
        assert tuple(tensor.shape) == array.shape and np.array_equal(tensor.cpu().numpy(), array)
