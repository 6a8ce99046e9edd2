"""Pipeline parallelism on the CPU (gloo, loopback): PP 2 (uneven layer split) and TP 2 x PP 2 give the
same greedy tokens and last-position logits as one process, with several micro-batches per step, on
tiny random Llama / Qwen2 (tied embeddings: the last stage reads the embedding for its LM head),
Qwen3, Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints written by transformers, and on the embedded
SmolLM2 (GGUF Q4 blocks)."""

import os

import pytest
import torch

from kiln.distributed import TensorParallelEngine
from kiln.distributed.micro_batches import micro_batch_bounds
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.models.sharding import check_pipeline_parallel, pipeline_stages
from kiln.verify import assert_close
from tests.distributed.checkpoints import run_to_completion, write_checkpoint
from tests.distributed.moe_checkpoints import write_moe_checkpoint
from tests.distributed.test_tensor_parallel import needs_embedded_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# three sequences (one longer than a 16-token KV block): the prefill step splits into micro-batches
PROMPTS = [[5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3, 4], [9, 8, 7, 6]]


def record_step_logits(engine) -> list[torch.Tensor]:
    """Every step's logits as rank 0's runner collects them (the rows it samples from)."""
    collect = engine.runner.collect
    seen: list[torch.Tensor] = []

    def recording(handle):
        logits = collect(handle)
        if logits is not None:
            seen.append(logits.clone())
        return logits

    engine.runner.collect = recording
    return seen


def _compare(path, tp_size, pp_size, tol, prompts=PROMPTS, **options):
    """One step at a time through the pipeline (lanes=1), each step split into micro-batches: every
    step's logits equal one process's."""
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32, **options)
    single = LLMEngine(config)
    single_logits = record_step_logits(single)
    single_tokens = run_to_completion(single, prompts, GREEDY)
    with TensorParallelEngine(config, tp_size=tp_size, pp_size=pp_size, timeout_s=30, lanes=1) as engine:
        workers = list(engine.workers)
        pp_logits = record_step_logits(engine)
        pp_tokens = run_to_completion(engine, prompts, GREEDY)
        stats = engine.stage_stats()
    margin = min(float((t[:, 0] - t[:, 1]).min()) for t in (x.topk(2, dim=-1).values for x in single_logits))
    assert margin > 1e-2, f"the prompts hit a near-tie (top-2 margin {margin:.1e}); pick other prompts"
    assert pp_tokens == single_tokens
    assert len(pp_logits) == len(single_logits)
    worst = max(
        assert_close(out, ref, tol, f"TP {tp_size} x PP {pp_size} logits, step {step}")
        for step, (out, ref) in enumerate(zip(pp_logits, single_logits, strict=True))
    )
    # every rank ran every step, and the prefill step really was split into micro-batches
    assert [s["steps"] for s in stats] == [len(single_logits)] * (tp_size * pp_size)
    assert all(s["micro_batches"] > s["steps"] for s in stats)
    for process in workers:
        assert process.exitcode == 0
        assert not os.path.exists(f"/proc/{process.pid}")
    return worst


def test_pp2_llama_with_uneven_layer_split_matches_one_process(tmp_path):
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    _compare(path, tp_size=1, pp_size=2, tol=1e-5)  # stages of 2 + 1 layers


@pytest.mark.parametrize("tp_size, pp_size", [(1, 2), (2, 1)])
def test_prompt_logprobs_under_pp2_or_tp2_match_one_process(tp_size, pp_size, tmp_path):
    """Prompt logprobs take the logits of prompt positions too: the pipeline's last stage returns
    those rows like sampling rows (over micro-batches and chunked prefill), tensor parallel ranks
    gather them like sampling rows."""
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32, max_num_batched_tokens=12)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def prompt_logprobs(engine):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({out.request_id: out for out in engine.step() if out.finished})
        return [finals[f"r{i}"].prompt_logprobs for i in range(len(PROMPTS))]

    single = prompt_logprobs(LLMEngine(config))
    with TensorParallelEngine(config, tp_size=tp_size, pp_size=pp_size, timeout_s=30, lanes=1) as engine:
        pipelined = prompt_logprobs(engine)
    for ours, ref, prompt in zip(pipelined, single, PROMPTS, strict=True):
        assert len(ours) == len(ref) == len(prompt) and ours[0] is None
        for got, want in zip(ours[1:], ref[1:], strict=True):
            assert got.keys() == want.keys()
            assert max(abs(got[t] - v) for t, v in want.items()) < 1e-4


def test_pp2_fp8_cache_with_exact_positions_matches_one_process(tmp_path):
    """Each stage keeps its layers' fp8 caches and exact rings (window 4, so a 30-token prompt's
    positions 16-25 onward are read from fp8): the same logits as one process. Scales 1.0 in both, since
    pipeline ranks do not calibrate."""
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    prompts = [[*PROMPTS[0], *range(40, 51)], *PROMPTS[1:]]
    options = {"kv_cache_dtype": "fp8", "kv_cache_scales": "unit", "kv_cache_exact_window": 4}
    _compare(path, tp_size=1, pp_size=2, tol=1e-5, prompts=prompts, **options)


def test_tp2_pp2_qwen2_with_tied_embeddings_matches_one_process(tmp_path):
    path = write_checkpoint(tmp_path, "qwen2", num_hidden_layers=3)
    _compare(path, tp_size=2, pp_size=2, tol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_pp2_moe_matches_one_process(family, tmp_path):
    # 2 layers, one per stage; Qwen2-MoE: the routed experts + shared expert on stage 0, a dense MLP
    # on stage 1. The fused MoE kernels run inside each stage.
    path = write_moe_checkpoint(tmp_path, family)
    _compare(path, tp_size=1, pp_size=2, tol=1e-5)


def test_tp2_pp2_qwen3_moe_matches_one_process(tmp_path):
    from tests.distributed.test_tp_qwen3 import _checkpoint
    from tests.models.test_qwen3 import qwen3_moe

    _compare(_checkpoint(qwen3_moe, tmp_path), tp_size=2, pp_size=2, tol=1e-5)


def test_pp2_qwen3_with_q_k_norms_matches_one_process(tmp_path):
    from tests.distributed.test_tp_qwen3 import _checkpoint
    from tests.models.test_qwen3 import qwen3

    _compare(_checkpoint(qwen3, tmp_path), tp_size=1, pp_size=2, tol=1e-5)


def test_pp2_phi3_with_fused_projections_matches_one_process(tmp_path):
    from tests.models.test_phi3 import _saved, _write_word_tokenizer

    _saved("longrope_partial_rotary", tmp_path)
    _write_word_tokenizer(tmp_path, 128)
    _compare(str(tmp_path), tp_size=1, pp_size=2, tol=1e-5)


@needs_embedded_model
def test_pp2_embedded_smollm2_matches_one_process():
    from kiln.loaders import default_model_path

    # the stages run the same kernels on the same weights as one process; only the micro-batch
    # shapes differ: the CPU GEMMs over fewer rows take other paths (measured 3.2e-4 relative on the
    # prefill step with the default low-precision CPU weight formats)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 4649, 314, 253]]
    worst = _compare(default_model_path(), 1, 2, tol=3e-3, prompts=prompts)
    print(f"worst relative logits error PP2 vs one process: {worst:.2e}")


def test_pipeline_stages_split_layers_contiguously_larger_first():
    assert pipeline_stages(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert pipeline_stages(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="at least one layer"):
        pipeline_stages(2, 3)


def test_a_model_without_pipeline_stages_is_refused_by_name():
    from types import SimpleNamespace

    gemma = SimpleNamespace(architecture="Gemma3ForCausalLM", num_layers=4)
    with pytest.raises(ValueError, match="'Gemma3ForCausalLM' cannot be split into stages"):
        check_pipeline_parallel(gemma, 2)
    assert check_pipeline_parallel(gemma, 1) == [(0, 4)]  # one stage is no split


def test_micro_batches_are_contiguous_nonempty_and_token_balanced():
    assert micro_batch_bounds([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 4)]
    assert micro_batch_bounds([0, 100, 101, 102], 2) == [(0, 1), (1, 3)]  # a long prefill alone
    assert micro_batch_bounds([0, 5], 4) == [(0, 1)]  # never more micro-batches than sequences
    assert micro_batch_bounds([0, 1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
