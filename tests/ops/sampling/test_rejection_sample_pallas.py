"""rejection_sample's JAX backends (the Mosaic TPU kernels in the TPU interpreter, the Pallas Triton
kernel in the Pallas interpreter, XLA) against the float64 reference (integer outputs: exact); the
kernels' tokens and counts equal XLA's on random inputs; ties and the zero-residual fallback across
vocabulary blocks; the Mosaic and Triton lowering."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.sampling.rejection_sample import pallas_gpu  # noqa: E402
from kiln.ops.sampling.rejection_sample.pallas_gpu import rejection_sample_pallas_gpu  # noqa: E402
from kiln.ops.sampling.rejection_sample.pallas_tpu import MAX_BLOCK_V, rejection_sample_pallas_tpu  # noqa: E402
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE, rejection_sample_reference  # noqa: E402
from kiln.ops.sampling.rejection_sample.xla import rejection_sample_xla  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")
# each kernel and the vocabulary columns of one step of its draw
KERNELS = {
    "pallas_tpu": (rejection_sample_pallas_tpu, MAX_BLOCK_V),
    "pallas_gpu": (rejection_sample_pallas_gpu, pallas_gpu.MAX_BLOCK_V),
}


def seed() -> int:
    return random.randrange(2**31)


def as_jax(inputs: dict) -> dict:
    return {name: None if value is None else jnp.asarray(value.numpy()) for name, value in inputs.items()}


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize(
    "shape",
    [
        {"batch": 9, "num_draft": 5, "vocab": 1000, "draft_probs": True},
        {"batch": 5, "num_draft": 3, "vocab": 333},
        {"batch": 1, "num_draft": 1, "vocab": 1},
    ],
)
def test_rejection_sample_jax_backends_match_float64(backend, shape):
    case = run_case(get_op("rejection_sample"), backend, shape, torch.float32, CPU, seed())
    assert case.passed, case


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("num_draft, draft_probs", [(1, False), (2, True), (8, True)])
def test_rejection_sample_pallas_equals_xla_on_random_inputs(kernel, num_draft, draft_probs):
    """Odd batch; a vocabulary over two draw blocks and not a multiple of 128; ragged k_b."""
    fn, block_v = KERNELS[kernel]
    shape = {"batch": 5, "num_draft": num_draft, "vocab": block_v + 77, "draft_probs": draft_probs}
    inputs = REJECTION_SAMPLE.make_inputs(shape, torch.float32, CPU, torch.Generator().manual_seed(seed()))
    tokens, accepted = fn(**as_jax(inputs))
    want_tokens, want_accepted = jax.jit(rejection_sample_xla)(**as_jax(inputs))
    assert np.array_equal(np.asarray(tokens), np.asarray(want_tokens))
    assert np.array_equal(np.asarray(accepted), np.asarray(want_accepted))
    ref_tokens, ref_accepted = rejection_sample_reference(**inputs)
    assert np.array_equal(np.asarray(tokens), ref_tokens.numpy())
    assert np.array_equal(np.asarray(accepted), ref_accepted.numpy())


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rejection_sample_pallas_ties_go_to_the_lowest_index_across_blocks(kernel):
    """Equal maxima in different vocabulary blocks (block: the kernel's draw step) and lanes: the
    lowest index wins, as jnp.argmax. Sequence 0 takes its bonus row (ties at 5 + block and
    3 + 2 * block, the second in a later block but a lower lane); sequence 1 rejects its proposal
    (token 9) and its residual ties at 9 + block and 2 * block; sequence 2 rejects with p <= q
    everywhere, so it falls back to p (ties at 1 and block + 1)."""
    fn, block = KERNELS[kernel]
    vocab = 2 * block + 40
    target = np.zeros((3, 2, vocab), np.float32)
    target[0, 0, 0] = 1.0
    target[0, 1, [5 + block, 3 + 2 * block]] = 0.5
    target[1, 0, [9, 9 + block, 2 * block]] = [0.2, 0.4, 0.4]
    target[2, 0, [1, block + 1]] = 0.25
    draft = np.zeros((3, 1, vocab), np.float32)
    draft[0, 0, 0] = draft[1, 0, 9] = 1.0
    draft[2, 0] = target[2, 0] * 2.0  # p(d) / q(d) = 0.5 and the residual is zero everywhere
    arrays = {
        "target_probs": target,
        "draft_token_ids": np.array([[0], [9], [1]], np.int32),
        "num_draft_tokens": np.array([1, 1, 1], np.int32),
        "draft_probs": draft,
        "uniforms": np.array([[0.5], [0.5], [0.9]], np.float32),  # accept, reject (0.2), reject (0.5)
        "exponentials": np.ones((3, 2, vocab), np.float32),
    }
    inputs = {name: jnp.asarray(value) for name, value in arrays.items()}
    tokens, accepted = fn(**inputs)
    assert accepted.tolist() == [1, 0, 0]
    assert tokens.tolist() == [[0, 5 + block], [9 + block, -1], [1, -1]]
    as_torch = {name: torch.from_numpy(value) for name, value in arrays.items()}
    for name in ("draft_token_ids", "num_draft_tokens"):
        as_torch[name] = as_torch[name].long()
    assert tokens.tolist() == rejection_sample_reference(**as_torch)[0].tolist()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_sample_pallas_without_proposals_draws_the_bonus_token(kernel, draft_probs):
    inputs = REJECTION_SAMPLE.make_inputs(
        {"batch": 3, "num_draft": 0, "vocab": 7, "draft_probs": draft_probs},
        torch.float32,
        CPU,
        torch.Generator().manual_seed(seed()),
    )
    tokens, accepted = KERNELS[kernel][0](**as_jax(inputs))
    want_tokens, _ = rejection_sample_reference(**inputs)
    assert accepted.tolist() == [0, 0, 0] and tokens.tolist() == want_tokens.tolist()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rejection_sample_pallas_on_zero_sequences_returns_empty_outputs(kernel):
    tokens, accepted = KERNELS[kernel][0](
        jnp.ones((0, 3, 5)), jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32), None,
        jnp.ones((0, 2)), jnp.ones((0, 3, 5)),
    )  # fmt: skip
    assert tokens.shape == (0, 3) and accepted.shape == (0,)


def test_rejection_sample_tpu_kernels_lower_to_mosaic(lower_for_tpu):
    batch, k, vocab = 3, 4, MAX_BLOCK_V + 129
    for draft_probs in (jnp.ones((batch, k, vocab)), None):
        text = lower_for_tpu(
            lambda *a: rejection_sample_pallas_tpu(*a, interpret=False),
            jnp.ones((batch, k + 1, vocab)),
            jnp.zeros((batch, k), jnp.int32),
            jnp.ones((batch,), jnp.int32),
            draft_probs,
            jnp.ones((batch, k)),
            jnp.ones((batch, k + 1, vocab)),
        )
        assert text.count("tpu_custom_call") >= 2  # the walk and the draw


def test_rejection_sample_gpu_kernel_lowers_to_triton(lower_for_gpu):
    """A vocabulary over several draw steps and not a power of two; K + 1 not a power of two."""
    batch, k, vocab = 3, 4, 2 * pallas_gpu.MAX_BLOCK_V + 129
    for draft_probs in (jnp.ones((batch, k, vocab)), None):
        text = lower_for_gpu(
            lambda *a: rejection_sample_pallas_gpu(*a, interpret=False),
            jnp.ones((batch, k + 1, vocab)),
            jnp.zeros((batch, k), jnp.int32),
            jnp.ones((batch,), jnp.int32),
            draft_probs,
            jnp.ones((batch, k)),
            jnp.ones((batch, k + 1, vocab)),
        )
        assert text.count("xla.gpu.triton") == 1  # the walk, the draw and the output row in one kernel
