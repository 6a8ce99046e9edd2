"""rejection_sample: the verify step of speculative decoding, exact rejection sampling of B
sequences' proposals against the target's distributions.

    target_probs:     [B, K+1, V] float32  p_j, the target's (filtered, tempered) distribution at each
                      proposal's position and one past the last; rows past num_draft_tokens[b] are not read
    draft_token_ids:  [B, K]      int64    proposals d_j in [0, V) (entries past num_draft_tokens[b]
                      are padding, ignored)
    num_draft_tokens: [B]         int64    k_b in [0, K]
    draft_probs:      [B, K, V]   float32  q_j, the distributions the proposals were drawn from, or None
                      for a deterministic proposer (n-gram): q_j one-hot at d_j
    uniforms:         [B, K]      float32  U[0, 1), one per proposal
    exponentials:     [B, K+1, V] float32  i.i.d. Exp(1) noise, positive
    returns (output_token_ids [B, K+1] int64 padded with -1, num_accepted [B] int64): sequence b
    emits output_token_ids[b, : num_accepted[b] + 1].

The rule (Leviathan et al. 2023, Chen et al. 2023). Walk j = 0 .. k_b - 1: proposal d_j is accepted
when u_j < min(1, p_j(d_j) / q_j(d_j)) (a proposal the draft could not have drawn, q_j(d_j) = 0, is
accepted iff p_j(d_j) > 0). At the first rejection, at j = a, the last token is drawn from the
residual max(0, p_a - q_a) / sum(max(0, p_a - q_a)) and the walk ends; when all k_b proposals are
accepted (a = k_b) a bonus token is drawn from p_{k_b}. Every emitted token is then distributed exactly
as sampling the target alone. Where the residual is zero everywhere (p_a <= q_a, so p_a = q_a up to
rounding and a rejection had probability 0) the draw falls back to p_a.
Deterministic proposer (draft_probs None): q_j is one-hot at d_j, so d_j is accepted with probability
p_j(d_j) and the residual is p_j with d_j's entry removed.

The draw: with e_v i.i.d. Exp(1), argmax_v dist_v / e_v is an exact sample of dist (the exponential
race), taken from row a of `exponentials`. The argmax is unchanged by a positive scale, so the residual
need not be normalized. Randomness comes in as arguments so the engine draws it from each request's
generator.

Exactness of the comparison with the float64 reference: the outputs are integers and must match
exactly (tolerance 0: a single different token or count fails). A float32 backend can differ from the
float64 reference only on a near-tie, u_j within float32 rounding of p/q, or two candidates' dist / e
within rounding of each other; on random inputs that is ~1e-7 per decision. Exact ties (equal values,
e.g. an all-zero row) go to the lowest index, as torch.argmax does.
"""

from __future__ import annotations

import torch

from kiln.ops.attention.validate import host_checkable
from kiln.ops.checks import check_same_dtype, check_tensor, device_of
from kiln.ops.registry import OpSpec, define_op

OP = "rejection_sample"
PROB_DTYPES = (torch.float32, torch.float64)  # float64 only for the verifier's reference


def rejection_sample_reference(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials
):
    """One sequence, one proposal at a time, in float64."""
    batch, k_max = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    output_token_ids = torch.full((batch, k_max + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    for b in range(batch):
        k = int(num_draft_tokens[b])
        emitted: list[int] = []
        last_dist = target_probs[b, k].double()  # the bonus row, unless a proposal is rejected
        for j in range(k):
            d = int(draft_token_ids[b, j])
            p = target_probs[b, j].double()
            if draft_probs is None:
                q = torch.zeros(vocab, dtype=torch.float64, device=device)
                q[d] = 1.0
            else:
                q = draft_probs[b, j].double()
            if q[d] > 0:
                accept = float(uniforms[b, j]) < min(1.0, float(p[d] / q[d]))
            else:
                accept = float(p[d]) > 0
            if not accept:
                residual = (p - q).clamp_min(0.0)
                last_dist = residual / residual.sum() if residual.sum() > 0 else p
                break
            emitted.append(d)
        a = len(emitted)
        last_token = int(torch.argmax(last_dist / exponentials[b, a].double()))
        output_token_ids[b, : a + 1] = torch.tensor(emitted + [last_token], dtype=torch.int64)
        num_accepted[b] = a
    return output_token_ids, num_accepted


def validate_rejection_sample(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials
) -> None:
    device = device_of(target_probs)
    check_tensor(OP, "target_probs", target_probs, ndim=3, dtypes=PROB_DTYPES)
    batch, rows, vocab = target_probs.shape
    if rows < 1 or vocab < 1:
        raise ValueError(
            f"{OP}: target_probs has shape {tuple(target_probs.shape)}; it needs K+1 >= 1 rows and V >= 1"
        )
    k_max = rows - 1
    expected = {
        "draft_token_ids": (batch, k_max),
        "num_draft_tokens": (batch,),
        "uniforms": (batch, k_max),
        "exponentials": (batch, k_max + 1, vocab),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (batch, k_max, vocab)
    args = {
        "draft_token_ids": draft_token_ids,
        "num_draft_tokens": num_draft_tokens,
        "draft_probs": draft_probs,
        "uniforms": uniforms,
        "exponentials": exponentials,
    }
    # JAX arrays may be int32 (JAX's default integer without jax_enable_x64); torch tensors are int64
    id_dtypes = (torch.int64,) if isinstance(draft_token_ids, torch.Tensor) else (torch.int64, torch.int32)
    for name, shape in expected.items():
        dtypes = id_dtypes if name in ("draft_token_ids", "num_draft_tokens") else PROB_DTYPES
        tensor = check_tensor(OP, name, args[name], ndim=len(shape), dtypes=dtypes, device=device)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{OP}: {name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(from target_probs [B, K+1, V] = {tuple(target_probs.shape)})"
            )
    check_same_dtype(
        OP, target_probs=target_probs, draft_probs=draft_probs, uniforms=uniforms, exponentials=exponentials
    )
    _check_index_values(draft_token_ids, num_draft_tokens, k_max, vocab)


def _check_index_values(draft_token_ids, num_draft_tokens, k_max: int, vocab: int) -> None:
    """Host-side range checks of the index tensors, where their values may be read."""
    if not host_checkable(num_draft_tokens) or num_draft_tokens.numel() == 0:  # JAX: not checkable
        return
    low, high = int(num_draft_tokens.min()), int(num_draft_tokens.max())
    if low < 0 or high > k_max:
        raise ValueError(
            f"{OP}: num_draft_tokens has values in [{low}, {high}], expected each in [0, K={k_max}]"
        )
    if k_max == 0 or not host_checkable(draft_token_ids):
        return
    positions = torch.arange(k_max, device=draft_token_ids.device)
    proposed = draft_token_ids[positions[None, :] < num_draft_tokens[:, None]]
    if proposed.numel() and (int(proposed.min()) < 0 or int(proposed.max()) >= vocab):
        raise ValueError(
            f"{OP}: draft_token_ids has token {int(proposed.min())}..{int(proposed.max())} among the "
            f"proposals, expected each in [0, V={vocab})"
        )


def _fake(target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials):
    batch, rows, _ = target_probs.shape
    return (
        target_probs.new_empty((batch, rows), dtype=torch.int64),
        target_probs.new_empty((batch,), dtype=torch.int64),
    )


def make_inputs(shape, dtype, device, generator):
    """Random valid distributions: softmax of random logits, some rows cut to their top few tokens
    (so p = 0 and q = 0 are both hit); draft distributions near the target's (so runs of acceptances
    happen); proposals mostly drawn from q (or from p for a deterministic proposer), some uniform
    (possibly a token q or p gives 0)."""
    batch, k_max, vocab = shape["batch"], shape["num_draft"], shape["vocab"]

    def distributions(logits):
        cut = torch.rand(logits.shape[:-1], generator=generator) < 0.3
        kth = logits.topk(min(3, vocab), dim=-1).values[..., -1:]
        logits = torch.where(cut[..., None] & (logits < kth), float("-inf"), logits)
        return logits.softmax(dim=-1)

    logits = torch.randn(batch, k_max + 1, vocab, generator=generator) * 2.0
    target_probs = distributions(logits)
    draft_probs = None
    if shape.get("draft_probs"):
        draft_probs = distributions(logits[:, :k_max] + torch.randn(batch, k_max, vocab, generator=generator))
    proposal_source = (draft_probs if draft_probs is not None else target_probs[:, :k_max]).reshape(-1, vocab)
    if proposal_source.shape[0]:
        sampled = torch.multinomial(proposal_source, 1, generator=generator).view(batch, k_max)
    else:
        sampled = torch.zeros(batch, k_max, dtype=torch.int64)
    anything = torch.randint(0, vocab, (batch, k_max), generator=generator)
    draft_token_ids = torch.where(torch.rand(batch, k_max, generator=generator) < 0.2, anything, sampled)
    if shape.get("full"):
        num_draft_tokens = torch.full((batch,), k_max, dtype=torch.int64)
    else:
        num_draft_tokens = torch.randint(0, k_max + 1, (batch,), generator=generator)
    exponentials = torch.empty(batch, k_max + 1, vocab).exponential_(generator=generator)
    inputs = {
        "target_probs": target_probs,
        "draft_token_ids": draft_token_ids,
        "num_draft_tokens": num_draft_tokens,
        "draft_probs": draft_probs,
        "uniforms": torch.rand(batch, k_max, generator=generator),
        "exponentials": exponentials.clamp_min_(torch.finfo(torch.float32).tiny),
    }
    return {
        name: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        if value is not None
        else None
        for name, value in inputs.items()
    }


def fuzz_shapes(rng):
    shapes = [
        {"batch": 3, "num_draft": 2, "vocab": 7, "draft_probs": True},
        {"batch": 1, "num_draft": 1, "vocab": 1},  # one token: every proposal is token 0
        {"batch": 9, "num_draft": 5, "vocab": 1000, "draft_probs": True},
        {"batch": 5, "num_draft": 3, "vocab": 1000},
        {"batch": 2, "num_draft": 4, "vocab": 32001, "draft_probs": True, "full": True},
        {"batch": 4, "num_draft": 1, "vocab": 32001},
    ]
    shapes += [
        {
            "batch": rng.randint(1, 9),
            "num_draft": rng.randint(1, 5),
            "vocab": rng.choice([1, 7, 333, 1000, 5003]),
            "draft_probs": rng.random() < 0.5,
        }
        for _ in range(3)
    ]
    return shapes


def bench_shapes():
    return [
        {"batch": batch, "num_draft": 4, "vocab": vocab, "draft_probs": draft, "full": True}
        for vocab in (32000, 128256)  # Llama-2, Llama-3 vocabularies
        for batch in (1, 8, 64)
        for draft in (False, True)
    ]


def op_flops(shape, dtype):
    """Per sequence, the residual row: subtract, clamp, divide by the noise, compare (4 per token)."""
    return shape["batch"] * shape["vocab"] * 4


def op_bytes(shape, dtype):
    """What the fused kernel must read: per sequence the k gathered p(d) and q(d), the uniforms and
    proposals, then one row each of p, q (with a draft) and the noise; the outputs."""
    batch, k_max, vocab = shape["batch"], shape["num_draft"], shape["vocab"]
    rows = 3 if shape.get("draft_probs") else 2
    per_sequence = rows * vocab * 4 + k_max * (4 + 4 + 4 + 8) + 8 + (k_max + 1) * 8 + 8
    return batch * per_sequence


REJECTION_SAMPLE = OpSpec(
    name=OP,
    description="speculative decoding's verify step: accept proposals by min(1, p/q), draw the residual",
    reference=rejection_sample_reference,
    make_inputs=make_inputs,
    fuzz_shapes=fuzz_shapes,
    dtypes=(torch.float32,),
    # Integer outputs: any different token or count is an error (see "Exactness" above).
    tolerance={torch.float32: 0.0},
    flops=op_flops,
    bytes=op_bytes,
    outputs=lambda result, inputs: (result[0], result[1]),
    bench_shapes={"llm": bench_shapes()},
    # baselines: cpu.py adds the vectorized torch function (it runs on any device) as "torch_vectorized"
    schema=(
        "(Tensor target_probs, Tensor draft_token_ids, Tensor num_draft_tokens, Tensor? draft_probs, "
        "Tensor uniforms, Tensor exponentials) -> (Tensor, Tensor)"
    ),
    validate=validate_rejection_sample,
    fake=_fake,
    call_case=lambda target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials: (
        {"batch": draft_token_ids.shape[0], "num_draft": draft_token_ids.shape[1],
         "vocab": target_probs.shape[-1], "draft_probs": draft_probs is not None},
        target_probs.dtype,
    ),  # fmt: skip
    doc=__doc__,
)

rejection_sample = define_op(REJECTION_SAMPLE, "kiln.ops")
