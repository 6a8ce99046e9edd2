"""fused_linear_cross_entropy's JAX backends (XLA: chunks of tokens in a lax.scan; pallas_tpu: the same
loop around a Mosaic row kernel, in the TPU interpreter here; pallas_gpu: the loop around a Pallas
Triton row kernel that computes the logits itself, in the Pallas interpreter) against float64: loss
and the three gradients, with ignored tokens, label smoothing, z-loss and both reductions; the TPU
row kernel alone over several row tiles and vocabulary blocks, with the interpreter's race detector
on two cores; the GPU row kernel alone over several row tiles, vocabulary and hidden blocks."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.loss.fused_linear_cross_entropy.pallas_gpu import (  # noqa: E402
    fused_linear_cross_entropy_pallas_gpu,
    rows_loss_and_grad_gpu,
)
from kiln.ops.loss.fused_linear_cross_entropy.pallas_tpu import (  # noqa: E402
    fused_linear_cross_entropy_pallas_tpu,
    rows_loss_and_grad_tpu,
    vocab_blocking,
)
from kiln.ops.pallas_common import tpu_interpret, tpu_interpreter  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 37, "hidden": 24, "vocab": 301, "ignored": True},  # several chunks
        {"tokens": 19, "hidden": 16, "vocab": 517, "label_smoothing": 0.1, "bias": True},
        {"tokens": 23, "hidden": 32, "vocab": 129, "z_loss": 1e-4, "reduction": "sum", "ignored": True},
    ],
)
def test_fused_linear_cross_entropy_jax_backends_match_float64(backend, shape, dtype):
    op = get_op("fused_linear_cross_entropy")
    case = run_case(op, backend, shape, dtype, torch.device("cpu"), seed=random.randrange(2**31))
    assert case.passed, case


def test_fused_linear_cross_entropy_pallas_gpu_half_precision_everything_at_once():
    shape = {"tokens": 29, "hidden": 40, "vocab": 613, "ignored": True, "label_smoothing": 0.05,
             "z_loss": 1e-4, "bias": True}  # fmt: skip
    op = get_op("fused_linear_cross_entropy")
    case = run_case(op, "pallas_gpu", shape, torch.float16, torch.device("cpu"), seed=random.randrange(2**31))
    assert case.passed, case


def test_vocab_blocking_pads_less_than_128_columns_per_block():
    for vocab in (1, 129, 2048, 2049, 4500, 49152, 128256, 151936):
        block_v, padded = vocab_blocking(vocab)
        assert block_v % 128 == 0 and block_v <= 2048 and padded % block_v == 0
        assert vocab <= padded < vocab + 128 * (padded // block_v)


def _row_reference(logits, labels, vocab, label_smoothing, z_loss, scale):
    """float64 row losses [C] and scale * d loss / d logits [C, vocab] by autograd (ignored rows: -1)."""
    z = torch.tensor(np.asarray(logits[:, :vocab], np.float64), requires_grad=True)
    target = torch.tensor(np.asarray(labels), dtype=torch.long)
    valid = target >= 0
    rows = torch.nn.functional.cross_entropy(
        z, target.clamp(min=0), label_smoothing=label_smoothing, reduction="none"
    )
    rows = torch.where(valid, rows + z_loss * z.logsumexp(-1) ** 2, 0.0)
    (grad,) = torch.autograd.grad(scale * rows.sum(), z)
    return rows.detach().numpy(), grad.numpy()


def assert_rows_match(row_loss, grad, logits, labels, vocab, label_smoothing, z_loss, scale):
    """A row kernel's losses [C] and gradient [C, padded vocab] against _row_reference: finite, zero on
    padded columns and ignored rows (every 5th), 1e-5 / 1e-6 relative on the gradient / losses."""
    ref_loss, ref_grad = _row_reference(logits, labels, vocab, label_smoothing, z_loss, scale)
    grad = np.asarray(grad, np.float64)
    assert np.isfinite(grad).all() and np.isfinite(np.asarray(row_loss)).all()
    assert np.all(grad[:, vocab:] == 0.0), "padded columns must get a zero gradient"
    assert np.all(grad[::5] == 0.0) and np.all(np.asarray(row_loss)[::5] == 0.0), "ignored rows"
    assert np.linalg.norm(grad[:, :vocab] - ref_grad) / np.linalg.norm(ref_grad) < 1e-5
    assert np.linalg.norm(np.asarray(row_loss, np.float64) - ref_loss) / np.linalg.norm(ref_loss) < 1e-6


def test_tpu_row_kernel_over_several_row_tiles_and_vocab_blocks_has_no_races():
    interpret_state = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    rows, vocab, label_smoothing, z_loss, scale = 128, 2100, 0.1, 1e-3, 0.37
    block_v, padded_vocab = vocab_blocking(vocab)
    assert padded_vocab // block_v == 2  # two vocabulary blocks, two row tiles of 64
    key_logits, key_labels = jax.random.split(jax.random.key(random.randrange(2**31)))
    logits = 3.0 * jax.random.normal(key_logits, (rows, padded_vocab), jnp.float32)
    logits = jnp.where(jnp.arange(padded_vocab) < vocab, logits, -jnp.inf)
    labels = jax.random.randint(key_labels, (rows,), 0, vocab, jnp.int32)
    labels = labels.at[::5].set(-1).at[3].set(vocab - 1).at[4].set(block_v)  # ignored rows, block edges
    with tpu_interpreter(detect_races=True, num_cores_or_threads=2):
        row_loss, grad = rows_loss_and_grad_tpu(
            logits, labels, jnp.float32(scale), vocab, label_smoothing, z_loss, block_v, tpu_interpret()
        )
        grad.block_until_ready()
    races = getattr(interpret_state, "races", None)
    if races is not None:
        assert races.races_found is False
    assert_rows_match(row_loss, grad, logits, labels, vocab, label_smoothing, z_loss, scale)


def test_fused_linear_cross_entropy_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    def loss_and_grads(hidden, weight, labels, bias):
        return fused_linear_cross_entropy_pallas_tpu(
            hidden, weight, labels, bias, label_smoothing=0.1, z_loss=1e-4, interpret=False
        )

    lower_for_tpu(
        loss_and_grads,
        jnp.ones((300, 64), jnp.bfloat16),
        jnp.ones((2300, 64), jnp.bfloat16),
        jnp.zeros((300,), jnp.int32),
        jnp.ones((2300,), jnp.bfloat16),
    )


def test_gpu_row_kernel_over_several_row_tiles_vocab_and_hidden_blocks_matches_float64():
    # 64 rows in 4 tiles of 16, vocabulary 100 in 7 blocks of 16 (the last one partly padding), hidden
    # 40 in 3 blocks of 16 (zero-padded): labels on block edges, ignored rows, a bias.
    rows, hidden, vocab, label_smoothing, z_loss, scale = 64, 40, 100, 0.1, 1e-3, 0.37
    keys = jax.random.split(jax.random.key(random.randrange(2**31)), 4)
    h = 2.0 * jax.random.normal(keys[0], (rows, hidden), jnp.float32)
    weight = jax.random.normal(keys[1], (vocab, hidden), jnp.float32) * hidden**-0.5
    bias = jax.random.normal(keys[2], (vocab,), jnp.float32)
    labels = jax.random.randint(keys[3], (rows,), 0, vocab, jnp.int32)
    labels = labels.at[::5].set(-1).at[3].set(vocab - 1).at[4].set(16).at[6].set(15).at[7].set(0)
    row_loss, grad = rows_loss_and_grad_gpu(
        jnp.pad(h, ((0, 0), (0, 8))), jnp.pad(weight, ((0, 12), (0, 8))), jnp.pad(bias, (0, 12)), labels,
        jnp.float32(scale), vocab, label_smoothing, z_loss, (16, 16, 16), interpret=True,
    )  # fmt: skip
    logits = np.asarray(h, np.float64) @ np.asarray(weight, np.float64).T + np.asarray(bias, np.float64)
    assert np.asarray(grad).shape == (rows, 112)
    assert_rows_match(row_loss, grad, logits, labels, vocab, label_smoothing, z_loss, scale)


def test_fused_linear_cross_entropy_gpu_kernels_lower_to_triton(lower_for_gpu):
    # The shared lowering test covers two fuzz shapes in bf16; here float32 (IEEE dots) with a bias,
    # label smoothing, z-loss, several chunks and vocabulary / hidden blocks.
    def loss_and_grads(hidden, weight, labels, bias):
        return fused_linear_cross_entropy_pallas_gpu(
            hidden, weight, labels, bias, label_smoothing=0.1, z_loss=1e-4, interpret=False
        )

    lower_for_gpu(
        loss_and_grads,
        jnp.ones((300, 100), jnp.float32),
        jnp.ones((2300, 100), jnp.float32),
        jnp.zeros((300,), jnp.int32),
        jnp.ones((2300,), jnp.float32),
    )
