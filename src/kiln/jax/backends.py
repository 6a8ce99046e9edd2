"""Registers the JAX implementations ("pallas_tpu", "pallas_gpu", "xla") on Kiln's torch OpSpecs.

Each adapter has the torch op's signature: it views the torch tensors as jax arrays (DLPack, no copy
for contiguous CPU tensors), calls `kiln.jax`, and views the results as torch tensors again; in-place
outputs (rms_norm's residual, rotary_embedding's q and k) are copied back into the caller's tensors.
So `kiln verify --backend pallas_tpu` and `kiln bench --backend pallas_gpu` work on the same specs.

Imported by `kiln.ops.registry.all_ops()` when jax is installed. Ops whose spec has not been
registered (yet) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import torch

import kiln.jax as kjax
from kiln.jax import dispatch
from kiln.jax.dlpack import to_jax, to_torch
from kiln.ops.registry import Implementation, get_op

DESCRIPTIONS = {
    "pallas_tpu": "Pallas Mosaic TPU kernel (TPU interpreter on the CPU)",
    "pallas_gpu": "Pallas Triton kernel (Pallas interpreter on the CPU)",
    "xla": "jitted jax.numpy (XLA)",
}


def is_available(implementation: str) -> Callable[[torch.device | None], bool]:
    """CPU tensors: every implementation (Pallas interpreted off its accelerator; a TPU gets the
    data moved to it). CUDA tensors: pallas_gpu and xla, when jax has a GPU backend."""

    def available(device: torch.device | None) -> bool:
        if device is None or device.type == "cpu":
            return True
        return device.type == "cuda" and implementation != "pallas_tpu" and dispatch.on_gpu()

    return available


def compute_device(implementation: str) -> jax.Device | None:
    """Where the jax arrays must live: the TPU for pallas_tpu on a TPU host, else where DLPack put them."""
    if implementation == "pallas_tpu" and dispatch.on_tpu():
        return jax.devices("tpu")[0]
    return None


def register(
    op_name: str,
    make_fn: Callable[[str], Callable],
    implementations: tuple[str, ...] = dispatch.IMPLEMENTATIONS,
) -> bool:
    """Register `make_fn(implementation)` for each of `implementations` on op `op_name`, if it exists."""
    try:
        spec = get_op(op_name)
    except ValueError:
        return False
    for implementation in implementations:
        if implementation not in spec.implementations:
            spec.register(
                Implementation(
                    implementation,
                    make_fn(implementation),
                    is_available(implementation),
                    description=DESCRIPTIONS[implementation],
                )
            )
    return True


def _rms_norm(implementation: str):
    def rms_norm(x, weight, eps=1e-6, residual=None):
        dev = compute_device(implementation)
        out = kjax.rms_norm(
            to_jax(x, dev), to_jax(weight, dev), eps, to_jax(residual, dev), implementation=implementation
        )
        if residual is None:
            return to_torch(out, x)
        residual.copy_(to_torch(out[1], x))
        return to_torch(out[0], x), residual

    return rms_norm


def _softmax(implementation: str):
    def softmax(x, temperature=1.0):
        dev = compute_device(implementation)
        return to_torch(kjax.softmax(to_jax(x, dev), temperature, implementation=implementation), x)

    return softmax


def _silu_and_mul(implementation: str):
    def silu_and_mul(x):
        dev = compute_device(implementation)
        return to_torch(kjax.silu_and_mul(to_jax(x, dev), implementation=implementation), x)

    return silu_and_mul


def _gelu_tanh_and_mul(implementation: str):
    def gelu_tanh_and_mul(x):
        dev = compute_device(implementation)
        return to_torch(kjax.gelu_tanh_and_mul(to_jax(x, dev), implementation=implementation), x)

    return gelu_tanh_and_mul


def _rotary_embedding(implementation: str):
    def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
        dev = compute_device(implementation)
        q_out, k_out = kjax.rope(
            to_jax(positions, dev),
            to_jax(q, dev),
            to_jax(k, dev),
            to_jax(cos_sin_cache, dev),
            is_neox,
            implementation=implementation,
        )
        q.copy_(to_torch(q_out, q))
        k.copy_(to_torch(k_out, k))
        return q, k

    return rotary_embedding


def _linear(implementation: str):
    def linear(x, weight, bias=None):
        dev = compute_device(implementation)
        out = kjax.matmul(
            to_jax(x, dev), to_jax(weight, dev), to_jax(bias, dev), implementation=implementation
        )
        return to_torch(out, x)

    return linear


def _w8a16_linear(implementation: str):
    def w8a16_linear(x, weight, weight_scale, bias=None):
        dev = compute_device(implementation)
        out = kjax.w8a16_matmul(
            to_jax(x, dev),
            to_jax(weight, dev),
            to_jax(weight_scale.to(torch.float32), dev),
            to_jax(bias, dev),
            implementation=implementation,
        )
        return to_torch(out, x)

    return w8a16_linear


register("rms_norm", _rms_norm)
register("softmax", _softmax)
register("silu_and_mul", _silu_and_mul)
register("gelu_tanh_and_mul", _gelu_tanh_and_mul)
register("rotary_embedding", _rotary_embedding, ("pallas_tpu", "xla"))
register("linear", _linear, ("pallas_tpu", "xla"))
register("w8a16_linear", _w8a16_linear, ("pallas_tpu", "xla"))
