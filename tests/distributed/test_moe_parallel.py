"""Mixture-of-experts models split over two CPU ranks (gloo): tensor parallel (each expert split along
its intermediate size) and expert parallel (whole experts per rank, tokens sent to them with
all_to_all_single) give the single-process greedy tokens and logits on tiny Mixtral and Qwen2-MoE
checkpoints written by transformers; the dispatch / combine alone against fused_moe's float64
reference with uneven counts (a rank that owns no tokens, a rank that receives none); and the
named errors for an --ep that cannot split the model."""

import pytest
import torch

from kiln.distributed import TensorParallelEngine
from kiln.distributed.launch import parallel_ranks, start_engine
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.models.layers.expert_parallel import token_slice
from kiln.models.mixtral import load_experts
from kiln.models.sharding import ExpertShard
from kiln.models.weights import WeightStore
from kiln.verify import assert_close
from tests.distributed.checkpoints import record_logits, run_to_completion, write_checkpoint
from tests.distributed.moe_checkpoints import write_moe_checkpoint

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# a 19-token prefill batched with a 3-token one (a 16-token KV block crossed), then 2-token decodes
PROMPTS = [[5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3, 4]]


def compare_with_one_process(path, ep_size, prompts=PROMPTS, tol=1e-4, **engine_kwargs):
    """Greedy tokens equal and logits within `tol` (relative) of one process; returns the worst error
    and rank 0's first MoE layer (to check what it holds)."""
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32, **engine_kwargs)
    single = LLMEngine(config)
    single_logits = record_logits(single)
    single_tokens = run_to_completion(single, prompts, GREEDY)
    with TensorParallelEngine(config, tp_size=2, timeout_s=30, ep_size=ep_size) as engine:
        workers = list(engine.workers)
        moe = engine.runner.model.layers[0].mlp
        logits = record_logits(engine)
        tokens = run_to_completion(engine, prompts, GREEDY)
    margin = min(float((t[:, 0] - t[:, 1]).min()) for t in (x.topk(2, dim=-1).values for x in single_logits))
    assert margin > 1e-2, f"the prompts hit a near-tie (top-2 margin {margin:.1e}); pick other prompts"
    assert tokens == single_tokens
    assert len(logits) == len(single_logits)
    worst = max(
        assert_close(out, ref, tol, f"MoE {'EP' if ep_size > 1 else 'TP'} 2 logits, step {step}")
        for step, (out, ref) in enumerate(zip(logits, single_logits, strict=True))
    )
    assert all(p.exitcode == 0 for p in workers)
    return worst, moe


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "ep2"])
def test_moe_over_two_ranks_matches_one_process(family, ep_size, tmp_path):
    path = write_moe_checkpoint(tmp_path, family, seed=3)
    # fp32: the split only reorders sums (partial expert outputs all-reduced, or top-k rows summed on
    # the token's rank); measured ~1e-6
    worst, moe = compare_with_one_process(path, ep_size)
    print(f"{family} {'EP' if ep_size > 1 else 'TP'} 2: worst relative logits error {worst:.1e}")
    if ep_size == 2:  # whole experts: 2 of the 4 on rank 0, every intermediate row
        assert moe.w_gate_up.shape[:2] == (2, 2 * (96 if family == "mixtral" else 40))
    else:  # every expert, rank 0's slice of the rows (Mixtral: 64 of 96, whole 32-column units)
        assert moe.w_gate_up.shape[:2] == (4, 2 * (64 if family == "mixtral" else 20))


def test_fp8_experts_over_two_expert_parallel_ranks_match_one_process(tmp_path):
    """EngineConfig.expert_format reaches every rank: each holds its whole experts in fp8 with the
    scales one process gives them (per expert), so tokens and logits match the one-process fp8 model."""
    path = write_moe_checkpoint(tmp_path, "mixtral", seed=3)
    _, moe = compare_with_one_process(path, 2, expert_format="fp8")
    assert moe.w_gate_up.dtype == torch.float8_e4m3fn and moe.w_gate_up.shape[0] == 2


# ---- dispatch / combine alone ----


def _dispatch_rank(rank, init_method, cases):
    from kiln.distributed.groups import destroy_tp_group, init_tp_group
    from kiln.models.layers.expert_parallel import dispatch_combine, gather_token_slices
    from kiln.ops.moe.fused_moe.spec import fused_moe_reference

    torch.set_num_threads(1)
    group = init_tp_group(rank, 2, "cpu", init_method, timeout_s=30, ep_size=2)
    hidden, inter, experts, per_rank = 24, 12, 4, 2
    try:
        for num_tokens, ids in cases:
            g = torch.Generator().manual_seed(num_tokens)  # the same tensors on both ranks
            x = torch.randn(num_tokens, hidden, generator=g)
            w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
            w_down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
            weights = torch.rand(num_tokens, ids.shape[1], generator=g)
            mine = slice(*token_slice(num_tokens, 2, rank))
            local = slice(rank * per_rank, (rank + 1) * per_rank)
            received = []

            def local_experts(
                rows, local_ids, route, w_gu=w_gate_up[local], w_d=w_down[local], seen=received
            ):
                seen.append(rows.shape[0])
                return fused_moe_reference(rows, w_gu, w_d, route, local_ids)

            part = dispatch_combine(x[mine], weights[mine], ids[mine], per_rank, local_experts, group)
            out = gather_token_slices(part, num_tokens, group)
            ref = fused_moe_reference(x.double(), w_gate_up.double(), w_down.double(), weights.double(), ids)
            assert out.shape == (num_tokens, hidden)
            assert torch.isfinite(out).all()
            err = float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))
            assert err < 1e-5, f"rank {rank}, {num_tokens} tokens: relative error {err:.1e}"
            # what this rank's experts were sent: every (token, expert) pair whose expert it holds
            expected = int(((ids >= local.start) & (ids < local.stop)).sum())
            assert received == ([expected] if expected else []), (rank, num_tokens, received, expected)
    finally:
        destroy_tp_group()


def test_dispatch_combine_with_uneven_counts_matches_the_reference():
    from kiln.distributed.groups import free_port

    cases = [
        # 5 tokens (3 on rank 0, 2 on rank 1), top 2, every pair to experts 0-1: rank 1 receives none
        (5, torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])),
        # 1 token: rank 1 owns no token (an empty slice) yet receives both of its pairs
        (1, torch.tensor([[3, 2]])),
        # 7 tokens, top 3, skewed: rank 0 gets 3 pairs, rank 1 gets 18
        (7, torch.tensor([[2, 3, 0], [3, 1, 2], [2, 3, 0], [3, 2, 1], [2, 3, 1], [3, 2, 0], [2, 3, 1]])),
    ]
    context = torch.multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    worker = context.Process(target=_dispatch_rank, args=(1, init_method, cases), daemon=True)
    worker.start()
    try:
        _dispatch_rank(0, init_method, cases)
    finally:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0, "rank 1's checks failed (its traceback is on stderr)"


# ---- pure pieces: no processes ----


def test_token_slices_cover_the_batch_larger_first():
    for tokens in range(0, 9):
        slices = [token_slice(tokens, 3, r) for r in range(3)]
        assert slices[0][0] == 0 and slices[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))
        sizes = [b - a for a, b in slices]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_stacked_experts_are_sliced_by_expert_and_by_intermediate_row():
    experts, inter, hidden = 4, 6, 8
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    p = "model.layers.0.mlp."
    tensors = {p + "experts.gate_up_proj": gate_up, p + "experts.down_proj": down}
    store = WeightStore("test", {n: (t.shape, lambda t=t: t) for n, t in tensors.items()})
    names = ("gate_proj", "up_proj", "down_proj")
    # expert parallel: experts 2-3 whole
    w_gu, w_d = load_experts(store, p, names, experts, hidden, inter, torch.float32,
                             ExpertShard((2, 4), (0, inter), experts, inter))  # fmt: skip
    assert torch.equal(w_gu, gate_up[2:4]) and torch.equal(w_d, down[2:4])
    # tensor parallel: rows 2-5 of every expert's gate and of its up, the matching down columns
    w_gu, w_d = load_experts(store, p, names, experts, hidden, inter, torch.float32,
                             ExpertShard((0, 4), (2, 6), experts, inter))  # fmt: skip
    assert torch.equal(w_gu, torch.cat([gate_up[:, 2:6], gate_up[:, inter + 2 : inter + 6]], dim=1))
    assert torch.equal(w_d, down[:, :, 2:6])


# ---- errors ----


def test_an_ep_that_does_not_divide_the_experts_is_refused_before_workers_start(tmp_path):
    path = write_moe_checkpoint(tmp_path, "mixtral")
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"--ep 3 must divide the number of routed experts \(4\)"):
        start_engine(config, 1, ep_size=3)
    assert not [p for p in torch.multiprocessing.active_children() if p.name.startswith("kiln-tp-worker")]


def test_ep_on_a_dense_model_and_mismatched_tp_are_refused(tmp_path):
    path = write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        start_engine(EngineConfig(model=path, device="cpu", num_kv_blocks=8), 1, ep_size=2)
    with pytest.raises(ValueError, match="--tp 2 --ep 4: expert parallelism runs over the tensor-parallel"):
        parallel_ranks(2, 4)
    assert parallel_ranks(1, 4) == parallel_ranks(4, 4) == 4


def test_kiln_generate_ep2_prints_the_one_process_completion_and_names_a_bad_ep(
    tmp_path, capsys, monkeypatch
):
    import kiln.distributed.launch
    from kiln.cli import main

    engines = []  # the command leaves its engine to atexit; this process runs more tests after it

    def recording_start_engine(*args, **kwargs):
        engines.append(start_engine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(kiln.distributed.launch, "start_engine", recording_start_engine)

    path = write_moe_checkpoint(tmp_path, "qwen2_moe", seed=5)
    args = [
        "generate",
        "t5 t77 t3 t101",
        "--model",
        path,
        "--device",
        "cpu",
        "--max-tokens",
        "5",
        "--ignore-eos",
    ]
    # refused in this process, before any worker starts
    assert main(args + ["--ep", "3"]) == 2
    message = "kiln generate: expert parallel: --ep 3 must divide the number of routed experts (4)"
    assert message in capsys.readouterr().err
    outputs = {}
    try:
        for ep in ("1", "2"):  # in this process (rank 0), as the command would run
            assert main(args + ["--ep", ep]) == 0
            outputs[ep] = capsys.readouterr()
    finally:
        for engine in engines:
            engine.shutdown()
    assert len(engines) == 1
    assert (
        "expert parallel over the same ranks (rank 0: experts 0-1, rank 1: experts 2-3)" in outputs["2"].err
    )
    completion = outputs["1"].out.rsplit("\n--- ", 1)[0]
    assert completion.strip() and outputs["2"].out.rsplit("\n--- ", 1)[0] == completion
