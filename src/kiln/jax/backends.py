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
import jax.numpy as jnp
import numpy as np
import torch

import kiln.jax as kjax
from kiln.ops import pallas_common as dispatch
from kiln.ops.jax_bridge import to_jax, to_torch
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
    """Where the jax arrays must live for a compiled Pallas kernel: the TPU for pallas_tpu on a TPU
    host, the GPU for pallas_gpu on a GPU host (CPU tensors are moved there and the results back);
    None (stay where DLPack put them) for xla and for interpreted kernels."""
    if implementation == "pallas_tpu" and dispatch.on_tpu():
        return jax.devices()[0]
    if implementation == "pallas_gpu" and dispatch.on_gpu():
        return jax.devices()[0]
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


def _linear_silu_mul(implementation: str):
    def linear_silu_mul(x, weight_gate_up):
        """Two kernels (GEMM into [M, 2N], then SiLU-and-mul): no fused-epilogue Pallas GEMM yet."""
        dev = compute_device(implementation)
        gate_up = kjax.matmul(to_jax(x, dev), to_jax(weight_gate_up, dev), implementation=implementation)
        return to_torch(kjax.silu_and_mul(gate_up, implementation=implementation), x)

    return linear_silu_mul


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


def _flash_attention(implementation: str):
    def flash_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
        sliding_window=None, softcap=None, return_lse=False,
    ):  # fmt: skip
        """Varlen [T, H, D] -> padded [B, S, H, D] rows (a gather), the kernel, and back."""
        dev = compute_device(implementation)
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        lens_q = np.diff(starts_q).astype(np.int32)
        lens_k = np.diff(starts_k).astype(np.int32)
        if q.shape[0] == 0 or k.shape[0] == 0:
            out = torch.zeros_like(q)
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
            return (out, lse) if return_lse else out
        rows_q = np.minimum(
            np.asarray(starts_q[:-1])[:, None] + np.arange(max(max_seqlen_q, 1)), q.shape[0] - 1
        )
        rows_k = np.minimum(
            np.asarray(starts_k[:-1])[:, None] + np.arange(max(max_seqlen_k, 1)), k.shape[0] - 1
        )
        qj, kj, vj = to_jax(q, dev), to_jax(k, dev), to_jax(v, dev)
        out, lse = kjax.flash_attention(
            qj[rows_q], kj[rows_k], vj[rows_k], causal, scale, implementation,
            sliding_window=sliding_window, softcap=softcap, q_lens=jnp.asarray(lens_q),
            kv_lens=jnp.asarray(lens_k), return_lse=True,
        )  # fmt: skip
        # Back to varlen: token t of sequence b is padded row (b, t - starts_q[b]).
        seq_of_token = np.repeat(np.arange(len(lens_q)), lens_q)
        pos_of_token = np.arange(q.shape[0]) - np.asarray(starts_q)[seq_of_token]
        out_t = to_torch(out[seq_of_token, pos_of_token], q)
        if not return_lse:
            return out_t
        return out_t, to_torch(lse[seq_of_token, :, pos_of_token].T, q)

    return flash_attention


def _paged_decode_attention(implementation: str):
    def paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
        k_scale=None, v_scale=None,
    ):  # fmt: skip
        dev = compute_device(implementation)
        out = kjax.paged_decode_attention(
            to_jax(q, dev), to_jax(key_cache, dev), to_jax(value_cache, dev), to_jax(block_tables, dev),
            to_jax(seq_lens, dev), scale, sliding_window, softcap, to_jax(k_scale, dev), to_jax(v_scale, dev),
            implementation=implementation,
        )  # fmt: skip
        return to_torch(out, q)

    return paged_decode_attention


register("softmax", _softmax)
register("silu_and_mul", _silu_and_mul)
register("gelu_tanh_and_mul", _gelu_tanh_and_mul)
register("rotary_embedding", _rotary_embedding, ("pallas_tpu", "xla"))
register("linear", _linear)
register("linear_silu_mul", _linear_silu_mul)
register("w8a16_linear", _w8a16_linear)
register("flash_attention", _flash_attention)
register("paged_decode_attention", _paged_decode_attention, ("pallas_tpu", "xla"))
