"""Every registered op has `pallas_tpu` and `xla` implementations (and `pallas_gpu` where Pallas-GPU can
express it), except the known gaps listed here with their reason (issue #23). The lists must stay true:
a new op without the backends fails, and so does a listed op that has gained them (remove its line).
The README's "Backends and dispatch" section lists the same exceptions."""

import pytest

pytest.importorskip("jax")

from kiln.ops import all_ops  # noqa: E402

# op -> why it has no pallas_tpu + xla pair. One line per op, sorted.
NO_TPU_AND_XLA = {
    "prepared_linear": "torch-only prepared weight layouts (kiln.ops.gemm.weight_formats), no JAX arrays",
}

# op -> why it has no pallas_gpu implementation (ops already in NO_TPU_AND_XLA are not repeated).
# One line per op, sorted.
NO_PALLAS_GPU: dict[str, str] = {}


def _implemented() -> dict[str, set[str]]:
    return {name: set(spec.jax_implementations) for name, spec in all_ops().items()}


def test_every_op_without_pallas_tpu_and_xla_is_a_listed_gap():
    missing = {name for name, impls in _implemented().items() if not {"pallas_tpu", "xla"} <= impls}
    unlisted = sorted(missing - NO_TPU_AND_XLA.keys())
    assert not unlisted, f"ops without pallas_tpu and xla implementations: {unlisted}"


def test_no_listed_tpu_and_xla_gap_is_already_closed():
    implemented = _implemented()
    closed = sorted(n for n in NO_TPU_AND_XLA if {"pallas_tpu", "xla"} <= implemented.get(n, set()))
    unknown = sorted(n for n in NO_TPU_AND_XLA if n not in implemented)
    assert not closed, f"remove from NO_TPU_AND_XLA, they have both backends now: {closed}"
    assert not unknown, f"NO_TPU_AND_XLA names ops that are not registered: {unknown}"


def test_every_op_without_pallas_gpu_is_a_listed_gap():
    implemented = _implemented()
    missing = {n for n, impls in implemented.items() if "pallas_gpu" not in impls and n not in NO_TPU_AND_XLA}
    unlisted = sorted(missing - NO_PALLAS_GPU.keys())
    closed = sorted(n for n in NO_PALLAS_GPU if "pallas_gpu" in implemented.get(n, set()))
    unknown = sorted(n for n in NO_PALLAS_GPU if n not in implemented)
    assert not unlisted, f"ops without a pallas_gpu implementation: {unlisted}"
    assert not closed, f"remove from NO_PALLAS_GPU, they have pallas_gpu now: {closed}"
    assert not unknown, f"NO_PALLAS_GPU names ops that are not registered: {unknown}"


def test_the_lists_are_sorted_and_every_reason_is_one_line():
    for table in (NO_TPU_AND_XLA, NO_PALLAS_GPU):
        assert list(table) == sorted(table)
        assert all(reason and "\n" not in reason for reason in table.values())
