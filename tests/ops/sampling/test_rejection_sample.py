"""kiln.ops.rejection_sample against its float64 per-sequence reference: the Triton kernel (interpreted
on the CPU) and the vectorized torch path must emit exactly the reference's tokens and counts."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ops
from kiln.ops.sampling.rejection_sample import REJECTION_SAMPLE
from kiln.ops.sampling.rejection_sample.spec import rejection_sample_reference
from kiln.verify import relative_error, run_case

BACKENDS = ["triton", "cpu"]

FUZZ = [
    {"batch": 3, "num_draft": 2, "vocab": 7, "draft_probs": True},
    {"batch": 1, "num_draft": 1, "vocab": 1},
    {"batch": 9, "num_draft": 5, "vocab": 1000, "draft_probs": True},
    {"batch": 5, "num_draft": 3, "vocab": 1000},
    {"batch": 2, "num_draft": 4, "vocab": 32001, "draft_probs": True, "full": True},
    {"batch": 4, "num_draft": 1, "vocab": 32001},
    {"batch": 7, "num_draft": 5, "vocab": 333, "full": True},
]


def _inputs(shape, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return REJECTION_SAMPLE.make_inputs(shape, torch.float32, torch.device(device), generator)


def _run(backend, monkeypatch, **inputs):
    monkeypatch.setenv("KILN_BACKEND", backend)
    return kiln.ops.rejection_sample(**inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", FUZZ, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_rejection_sample_matches_float64_reference_exactly(backend, shape, device):
    case = run_case(REJECTION_SAMPLE, backend, shape, torch.float32, device, seed=random.randrange(2**31))
    assert case.passed, case


def test_fuzz_inputs_reach_every_outcome_of_the_walk():
    """The fuzz cases are not vacuous: across them the reference sees sequences with no proposals,
    rejections at the first and at later proposals, all proposals accepted, and proposals with
    q(d) = 0 or p(d) = 0."""
    counts = {"k=0": 0, "rejected first": 0, "rejected later": 0, "all accepted": 0, "q(d)=0": 0, "p(d)=0": 0}
    for seed in range(4):
        for shape in FUZZ:
            inputs = _inputs(shape, seed)
            _, accepted = rejection_sample_reference(**inputs)
            k = inputs["num_draft_tokens"]
            counts["k=0"] += int((k == 0).sum())
            counts["rejected first"] += int(((accepted == 0) & (k > 0)).sum())
            counts["rejected later"] += int(((accepted > 0) & (accepted < k)).sum())
            counts["all accepted"] += int(((accepted == k) & (k > 0)).sum())
            valid = torch.arange(shape["num_draft"])[None, :] < k[:, None]
            tokens = inputs["draft_token_ids"][..., None]
            p = inputs["target_probs"][:, :-1].gather(-1, tokens).squeeze(-1)
            counts["p(d)=0"] += int(((p == 0) & valid).sum())
            if inputs["draft_probs"] is not None:
                q = inputs["draft_probs"].gather(-1, tokens).squeeze(-1)
                counts["q(d)=0"] += int(((q == 0) & valid).sum())
    assert all(n > 0 for n in counts.values()), counts


def test_a_single_wrong_token_or_count_fails_the_comparison():
    inputs = _inputs(FUZZ[2])
    tokens, accepted = rejection_sample_reference(**inputs)
    expected = REJECTION_SAMPLE.output_tensors((tokens, accepted), inputs)
    wrong_token = tokens.clone()
    wrong_token[3, int(accepted[3])] += 1
    wrong_count = accepted.clone()
    wrong_count[0] += 1
    for got in ((wrong_token, accepted), (tokens, wrong_count)):
        outputs = REJECTION_SAMPLE.output_tensors(got, inputs)
        error = max(relative_error(o, e) for o, e in zip(outputs, expected, strict=True))
        assert error > REJECTION_SAMPLE.tolerance[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_deterministic_proposals_emit_accepted_prefix_then_one_token(backend, device, monkeypatch):
    # sequence 0 proposes 2 tokens the target surely takes, sequence 1 one it can never take,
    # sequence 2 none (its bonus token comes from row 0)
    target = torch.zeros(3, 3, 4, device=device)
    target[0, 0, 1] = target[0, 1, 2] = target[0, 2, 3] = 1.0
    target[1, 0, 0] = target[1, 1, 3] = 1.0
    target[2, 0, 2] = 1.0
    out, accepted = _run(
        backend,
        monkeypatch,
        target_probs=target,
        draft_token_ids=torch.tensor([[1, 2], [2, 0], [7, 7]], device=device),  # padding: anything
        num_draft_tokens=torch.tensor([2, 1, 0], device=device),
        draft_probs=None,
        uniforms=torch.full((3, 2), 0.5, device=device),
        exponentials=torch.ones(3, 3, 4, device=device),
    )
    assert accepted.tolist() == [2, 0, 0]
    assert out.tolist() == [[1, 2, 3], [0, -1, -1], [2, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_residual_falls_back_to_the_target_row(backend, device, monkeypatch):
    """p <= q everywhere (unnormalized rows): a forced rejection has no residual to draw from, and the
    token is drawn from p instead, with the noise of that row."""
    target = torch.tensor([[[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]]], device=device)
    draft = torch.tensor([[[0.4, 0.3, 0.5]]], device=device)  # ratio at token 0: 0.5
    noise = torch.tensor([[[0.1, 5.0, 5.0], [1.0, 1.0, 1.0]]], device=device)
    args = dict(
        target_probs=target,
        draft_token_ids=torch.tensor([[0]], device=device),
        num_draft_tokens=torch.tensor([1], device=device),
        draft_probs=draft,
        uniforms=torch.tensor([[0.9]], device=device),
        exponentials=noise,
    )
    out, accepted = _run(backend, monkeypatch, **args)
    assert accepted.tolist() == [0] and out.tolist() == [[0, -1]]  # argmax of p / noise: token 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_go_to_the_lowest_index_across_vocab_blocks(backend, device, monkeypatch):
    vocab = 5000  # two of the Triton kernel's 4096-wide blocks
    target = torch.zeros(1, 1, vocab, device=device)
    target[0, 0, [4100, 4500, 4999]] = 0.25
    target[0, 0, 7] = 0.25 / 2
    noise = torch.ones(1, 1, vocab, device=device)
    noise[0, 0, 7] = 0.5  # score 0.25 as well, in the first block
    out, accepted = _run(
        backend,
        monkeypatch,
        target_probs=target,
        draft_token_ids=torch.zeros(1, 0, dtype=torch.int64, device=device),
        num_draft_tokens=torch.zeros(1, dtype=torch.int64, device=device),
        draft_probs=None,
        uniforms=torch.zeros(1, 0, device=device),
        exponentials=noise,
    )
    assert out.tolist() == [[7]] and accepted.tolist() == [0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(num_draft_tokens=a["num_draft_tokens"] + 3), "num_draft_tokens has values"),
        (lambda a: a["draft_token_ids"].fill_(7), r"draft_token_ids has token 7\.\.7"),
        (lambda a: a.update(uniforms=a["uniforms"][:, :1]), r"uniforms has shape \(3, 1\)"),
        (lambda a: a.update(exponentials=a["exponentials"].double()), "tensors must share one dtype"),
        (lambda a: a.update(draft_token_ids=a["draft_token_ids"].int()), "draft_token_ids has dtype int32"),
        (lambda a: a.update(draft_probs=a["draft_probs"][..., :5]), r"draft_probs has shape \(3, 2, 5\)"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(change, message):
    args = _inputs({"batch": 3, "num_draft": 2, "vocab": 7, "draft_probs": True, "full": True})
    change(args)
    with pytest.raises(ValueError, match=f"rejection_sample: {message}"):
        kiln.ops.rejection_sample(**args)


def test_custom_op_fake_gives_the_output_shapes():
    with FakeTensorMode():
        out, accepted = torch.ops.kiln.rejection_sample(
            torch.empty(4, 3, 11),
            torch.empty(4, 2, dtype=torch.int64),
            torch.empty(4, dtype=torch.int64),
            None,
            torch.empty(4, 2),
            torch.empty(4, 3, 11),
        )
    assert out.shape == (4, 3) and accepted.shape == (4,)
    assert out.dtype == accepted.dtype == torch.int64


def test_custom_op_matches_the_public_function():
    inputs = _inputs(FUZZ[0], seed=3)
    got = torch.ops.kiln.rejection_sample(*inputs.values())
    want = kiln.ops.rejection_sample(**inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# The kernel compiled ahead of time for sm_90 (bf16 is not an input dtype here: float32), in a fresh
# process without TRITON_INTERPRET: the interpreter accepts things the compiler rejects.
_AOT_SCRIPT = textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from kiln.ops.sampling.rejection_sample.triton import _rejection_sample_kernel

    f32, i32, i64 = "*fp32", "i32", "*i64"
    signature = {"target_ptr": f32, "draft_probs_ptr": f32, "draft_ids_ptr": i64, "num_draft_ptr": i64,
                 "uniforms_ptr": f32, "noise_ptr": f32, "out_ids_ptr": i64, "num_accepted_ptr": i64,
                 "target_seq_stride": i32, "target_row_stride": i32, "draft_probs_seq_stride": i32,
                 "draft_probs_row_stride": i32, "noise_seq_stride": i32, "noise_row_stride": i32,
                 "k_max": i32, "vocab": i32}
    for has_draft in (True, False):
        constexprs = {"HAS_DRAFT_PROBS": has_draft, "BLOCK_K": 8, "BLOCK_V": 4096}
        source = ASTSource(fn=_rejection_sample_kernel,
                           signature={**signature, **{k: "constexpr" for k in constexprs}},
                           constexprs=constexprs)
        compile(source, target=GPUTarget("cuda", 90, 32))
    print("compiled")
    """
)


def test_rejection_sample_kernel_compiles_for_sm90_without_a_gpu():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
