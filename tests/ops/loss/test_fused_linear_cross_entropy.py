"""fused_linear_cross_entropy: loss and gradients against torch's cross_entropy on full float64
logits, the autograd formula (gradcheck in float64), chunking, torch.compile, and peak memory."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.autograd import fused_linear_cross_entropy_loss
from kiln.ops.loss.fused_linear_cross_entropy import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.loss.fused_linear_cross_entropy.cpu import fused_linear_cross_entropy_cpu
from kiln.ops.loss.fused_linear_cross_entropy.spec import fused_linear_cross_entropy_reference
from kiln.ops.loss.fused_linear_cross_entropy.triton import fused_linear_cross_entropy_triton
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


SHAPES = [
    {"tokens": 37, "hidden": 24, "vocab": 301, "ignored": True},
    {"tokens": 19, "hidden": 16, "vocab": 517, "label_smoothing": 0.1, "bias": True},
    {"tokens": 23, "hidden": 32, "vocab": 129, "z_loss": 1e-3, "reduction": "sum", "ignored": True},
]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_linear_cross_entropy_matches_float64_reference_fp32(backend, shape, device):
    case = run_case(FUSED_LINEAR_CROSS_ENTROPY, backend, shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_linear_cross_entropy_half_precision_everything_at_once(backend, dtype, device):
    shape = {
        "tokens": 29,
        "hidden": 40,
        "vocab": 613,
        "ignored": True,
        "label_smoothing": 0.05,
        "z_loss": 1e-4,
    }
    case = run_case(FUSED_LINEAR_CROSS_ENTROPY, backend, {**shape, "bias": True}, dtype, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("impl", [fused_linear_cross_entropy_triton, fused_linear_cross_entropy_cpu])
def test_chunks_of_odd_sizes_give_the_same_loss_and_gradients(impl, device):
    # 13 tokens in chunks of 4 (the last one short) and of 1: chunk boundaries change nothing.
    inputs = FUSED_LINEAR_CROSS_ENTROPY.make_inputs(
        {"tokens": 13, "hidden": 8, "vocab": 70, "ignored": True, "label_smoothing": 0.2, "z_loss": 1e-2},
        torch.float32,
        device,
        torch.Generator().manual_seed(_seed()),
    )
    expected = fused_linear_cross_entropy_reference(**{k: _f64(v) for k, v in inputs.items()})
    for chunk in (4, 1):
        got = impl(**inputs, config={"chunk_tokens": chunk})
        for out, ref in zip(got[:3], expected[:3], strict=True):
            assert_close(out, ref, 2e-5, f"chunk_tokens={chunk}")


@pytest.mark.parametrize("backend", ["triton", "cpu", "xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_confident_predictions_keep_float32_gradient_precision(backend, z_loss, device):
    # p_y within 1e-3 of 1: lse - z_y and p_y - 1 computed directly lose 3-5 digits in float32; written
    # through the sum of the other probabilities they keep float32's precision.
    if backend in ("xla", "pallas_tpu", "pallas_gpu"):
        pytest.importorskip("jax")
        device = torch.device("cpu")
    g = torch.Generator().manual_seed(_seed())
    tokens, hidden, vocab = 6, 16, 50
    for _ in range(100):
        h = torch.randn(tokens, hidden, generator=g)
        w = torch.randn(vocab, hidden, generator=g)
        labels = torch.randperm(vocab, generator=g)[:tokens]  # distinct: each token owns its label's row
        # + 3 |h| max|w| to the label's logit: it then leads every unmodified word (Cauchy-Schwarz);
        # another token's boosted label row can still win when the two h align: draw again then
        w[labels] += 3.0 * w.norm(dim=-1).max() * h / h.norm(dim=-1, keepdim=True)
        logits = h.double() @ w.double().T
        runner_up = logits.scatter(1, labels[:, None], -torch.inf).amax(-1, keepdim=True)
        gap = logits.gather(1, labels[:, None]) - runner_up
        if (gap > 0).all():
            break
    # scale each row's logits so the label leads the runner-up by 12 (p_y ~ 1 - 50 e^-12)
    h = (h * (12.0 / gap).float()).to(device)
    w, labels = w.to(device), labels.to(device)
    ref = fused_linear_cross_entropy_reference(h.double(), w.double(), labels, z_loss=z_loss)
    p_label = (h.double() @ w.double().T).softmax(-1).gather(1, labels[:, None])
    assert (p_label > 0.999).all() and (p_label < 1 - 1e-7).all(), p_label  # the case it claims to be
    impl = kiln.ops.get_op("fused_linear_cross_entropy").implementation(backend)  # get_op loads "xla"
    got = impl.fn(h, w, labels, z_loss=z_loss)
    for name, out, expected in zip(("loss", "grad_hidden", "grad_weight"), got[:3], ref[:3], strict=True):
        assert_close(out, expected, 1e-5, f"{backend} {name}")


def test_ignored_tokens_get_zero_gradient_and_no_loss(device):
    inputs = FUSED_LINEAR_CROSS_ENTROPY.make_inputs(
        {"tokens": 9, "hidden": 8, "vocab": 33}, torch.float32, device, torch.Generator().manual_seed(_seed())
    )
    inputs["labels"][[1, 4, 8]] = -100
    loss, grad_hidden, _, _ = kiln.ops.fused_linear_cross_entropy(**inputs)
    assert torch.equal(grad_hidden[[1, 4, 8]], torch.zeros_like(grad_hidden[[1, 4, 8]]))
    kept = [0, 2, 3, 5, 6, 7]
    full = torch.nn.functional.cross_entropy(
        inputs["hidden"][kept].double() @ inputs["weight"].double().T, inputs["labels"][kept]
    )
    assert_close(loss, full, 1e-6, "loss over the kept tokens")


def test_gradcheck_float64_with_every_option(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")  # the CPU path keeps float64 throughout
    g = torch.Generator().manual_seed(_seed())
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=g)
    labels[3] = -100

    def loss(hidden, weight, bias):
        return fused_linear_cross_entropy_loss(
            hidden, weight, labels, bias, label_smoothing=0.1, z_loss=0.05, reduction="mean"
        )

    assert torch.autograd.gradcheck(loss, (hidden, weight, bias))


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_backward_scales_the_gradients_by_the_incoming_gradient(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    inputs = FUSED_LINEAR_CROSS_ENTROPY.make_inputs(
        {"tokens": 11, "hidden": 12, "vocab": 90, "bias": True, "reduction": "sum"},
        torch.float32,
        device,
        torch.Generator().manual_seed(_seed()),
    )
    leaves = {k: inputs[k].requires_grad_() for k in ("hidden", "weight", "bias")}
    (0.37 * fused_linear_cross_entropy_loss(**inputs)).backward()
    _, *ref_grads = fused_linear_cross_entropy_reference(**{k: _f64(v) for k, v in inputs.items()})
    for (name, leaf), ref in zip(leaves.items(), ref_grads, strict=True):
        assert_close(leaf.grad, 0.37 * ref, 2e-5, name)


def test_torch_compile_fullgraph_backpropagates_through_the_loss(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    g = torch.Generator().manual_seed(_seed())
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (6,), generator=g)

    def step(hidden, weight):
        return fused_linear_cross_entropy_loss(torch.tanh(hidden), weight, labels, label_smoothing=0.1)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(hidden, weight).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(torch.tanh(h64) @ w64.T, labels, label_smoothing=0.1).backward()
    assert_close(hidden.grad, h64.grad, 2e-5, "grad_hidden")
    assert_close(weight.grad, w64.grad, 2e-5, "grad_weight")


def _peak_cpu_bytes(fn) -> int:
    """Peak of PyTorch's CPU allocations while fn runs (the profiler's allocation events, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def test_fused_peak_memory_is_far_below_materialized_logits(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    tokens, hidden_size, vocab = 1024, 64, 8192  # fp32 logits: 32 MiB
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    def unfused():
        torch.nn.functional.cross_entropy(hidden @ weight.T, labels).backward()

    def fused():
        fused_linear_cross_entropy_loss(hidden, weight, labels).backward()

    unfused_peak = _peak_cpu_bytes(unfused)
    fused_peak = _peak_cpu_bytes(fused)
    logits_bytes = tokens * vocab * 4
    assert unfused_peak >= logits_bytes  # the measurement sees the logits when they exist
    # The fused path holds the gradients (grad_weight 2 MiB, grad_hidden 256 KiB) and one chunk.
    assert fused_peak < logits_bytes / 4, (fused_peak, unfused_peak)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"labels": torch.zeros(4, dtype=torch.int64)}, "labels has 4 tokens"),
        ({"labels": torch.zeros(5)}, "labels has dtype float32"),
        ({"weight": torch.randn(7, 6)}, "weight has last dim 6"),
        ({"reduction": "none"}, "reduction must be one of mean, sum"),
        ({"label_smoothing": 1.5}, "label_smoothing must be in"),
        ({"z_loss": -1.0}, "z_loss must be"),
        ({"bias": torch.randn(8)}, "bias has 8 elements"),
        # were an index error from inside the CPU kernel
        ({"labels": torch.tensor([0, 1, 7, 2, 3])}, r"labels has 7, outside the vocabulary \[0, 7\)"),
        ({"labels": torch.tensor([0, -5, 1, 2, 3])}, r"labels has -5, .*not ignore_index \(-100\)"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_them(change, message):
    args = {
        "hidden": torch.randn(5, 4),
        "weight": torch.randn(7, 4),
        "labels": torch.zeros(5, dtype=torch.int64),
    }
    with pytest.raises(ValueError, match=message):
        kiln.ops.fused_linear_cross_entropy(**{**args, **change})


def _f64(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_strided_labels_give_what_contiguous_labels_give(backend, device):
    """The Triton row kernel read labels at unit stride: a strided view (labels[:, 0] of a [T, 2]
    tensor) gave a wrong loss and gradients, silently."""
    inputs = FUSED_LINEAR_CROSS_ENTROPY.make_inputs(
        {"tokens": 13, "hidden": 16, "vocab": 70}, torch.float32, device, torch.Generator().manual_seed(3)
    )
    pairs = torch.stack([inputs["labels"], torch.flip(inputs["labels"], (0,))], dim=1)
    strided = pairs[:, 0]
    assert not strided.is_contiguous()
    impl = kiln.ops.get_op("fused_linear_cross_entropy").implementation(backend)
    want = impl.fn(**inputs)
    got = impl.fn(**{**inputs, "labels": strided})
    for name, out, expected in zip(("loss", "grad_hidden", "grad_weight"), got[:3], want[:3], strict=True):
        assert torch.equal(out, expected), name


def test_under_autocast_the_gemms_run_in_autocasts_dtype_as_the_lm_head_would(monkeypatch):
    """float32 weights under torch.autocast (HF Trainer's bf16=True): the loss crashed (bf16 logits met
    the float32 grad_weight accumulator). Now the GEMMs take autocast's dtype, as the unfused LM head
    does, and the gradients come back float32."""
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    g = torch.Generator().manual_seed(_seed())
    hidden = torch.randn(21, 24, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(97, 24, generator=g)).requires_grad_()
    labels = torch.randint(0, 97, (21,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy_loss(hidden, weight, labels)
    loss.backward()
    h64 = hidden.detach().bfloat16().double().requires_grad_()
    w64 = weight.detach().bfloat16().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(h64 @ w64.T, labels)
    want.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert_close(loss, want, 2e-3, "loss")
    assert_close(hidden.grad, h64.grad, 2.5e-2, "grad_hidden")
    assert_close(weight.grad, w64.grad, 2.5e-2, "grad_weight")


@pytest.mark.parametrize("backend", ["triton", "cpu", "xla"])
def test_without_compute_grads_the_loss_comes_alone_and_the_same(backend, device):
    inputs = FUSED_LINEAR_CROSS_ENTROPY.make_inputs(
        {"tokens": 17, "hidden": 16, "vocab": 90, "bias": True, "ignored": True, "z_loss": 1e-3},
        torch.float32,
        device,
        torch.Generator().manual_seed(_seed()),
    )
    impl = kiln.ops.get_op("fused_linear_cross_entropy").implementation(backend)
    full = impl.fn(**inputs)
    alone = impl.fn(**inputs, compute_grads=False)
    assert torch.equal(alone[0], full[0])
    assert [tuple(g.shape) for g in alone[1:]] == [(0,), (0,), (0,)]


def test_the_loss_entry_point_skips_the_gradients_only_when_nothing_needs_them(monkeypatch):
    """Evaluation through kiln.patch (no_grad) paid for both gradient GEMMs of every chunk: 488 ms
    against 94 ms for the unfused loss in the reviewer's run."""
    from kiln.ops.loss.fused_linear_cross_entropy import chunked

    monkeypatch.setenv("KILN_BACKEND", "cpu")
    seen, original = [], chunked._chunked
    monkeypatch.setattr(chunked, "_chunked", lambda *args: seen.append(args[-1]) or original(*args))
    g = torch.Generator().manual_seed(_seed())
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (9,), generator=g)
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy_loss(hidden.requires_grad_(), weight, labels)
    frozen = fused_linear_cross_entropy_loss(hidden.detach(), weight, labels)  # nothing requires grad
    trained = fused_linear_cross_entropy_loss(hidden, weight, labels)
    assert seen == [False, False, True]
    assert torch.equal(evaluated, trained.detach()) and torch.equal(frozen, evaluated)
    trained.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_a_backward_through_a_loss_computed_without_gradients_is_refused(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    hidden = torch.randn(5, 8, requires_grad=True)
    weight, labels = torch.randn(12, 8), torch.randint(0, 12, (5,))
    args = (hidden, weight, labels, None, -100, 0.0, 0.0, "mean", False)
    loss = torch.ops.kiln.fused_linear_cross_entropy(*args)[0]
    with pytest.raises(RuntimeError, match="compute_grads=False"):
        loss.backward()
