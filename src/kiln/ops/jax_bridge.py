"""Where an op's JAX implementations meet torch and the JAX API, generated from the spec.

A JAX implementation (`OpSpec.register_jax`, in an op's `pallas_tpu.py` / `pallas_gpu.py` / `xla.py`)
takes jax arrays with the op's signature and returns the custom op's outputs followed by the new
values of the arguments the op writes in place (JAX arrays are immutable). From it come:

  - `jax_function(spec)`: the `kiln.jax.<name>` entry point. Validates with the spec's own validator
    (on shapes and dtypes, at trace time), picks the implementation (`implementation=None`:
    pallas_tpu on a TPU, pallas_gpu on a GPU, xla on the CPU), and calls it. jit-compatible.
  - `torch_implementation(spec, name)`: a torch implementation for `kiln verify` / `kiln bench`:
    torch tensors viewed as jax arrays through DLPack (no copy for contiguous CPU tensors), the
    in-place outputs copied back into the caller's tensors.

Nothing here imports jax until it is used, so `import kiln.ops` never pays for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kiln.ops.checks import dtype_name

if TYPE_CHECKING:
    import jax

    from kiln.ops.registry import OpSpec

DESCRIPTIONS = {
    "pallas_tpu": "Pallas Mosaic TPU kernel (TPU interpreter on the CPU)",
    "pallas_gpu": "Pallas Triton kernel (Pallas interpreter on the CPU)",
    "xla": "jitted jax.numpy (XLA)",
}
_loaded = False


def jax_installed() -> bool:
    return importlib.util.find_spec("jax") is not None


def load_jax_backends() -> None:
    """Import every op's JAX backend modules (`kiln.ops.<family>.<op>.{pallas_tpu,pallas_gpu,xla}`),
    which register themselves, when jax is installed. Once per process."""
    global _loaded
    if _loaded or not jax_installed():
        return
    _loaded = True
    ops_dir = os.path.dirname(os.path.abspath(__file__))  # the kiln.ops package, without importing it
    for module in pkgutil.walk_packages([ops_dir], "kiln.ops."):
        if module.name.rsplit(".", 1)[-1] in DESCRIPTIONS:
            importlib.import_module(module.name)


# ---- torch <-> jax --------------------------------------------------------------------------------


def to_jax(tensor: torch.Tensor | None, device: jax.Device | None = None) -> jax.Array | None:
    """A jax array viewing `tensor` (made contiguous first if it is not; DLPack needs row-major).
    With `device`, the array is moved there (e.g. a TPU) after the zero-copy import. Without JAX's
    x64 mode an int64 tensor becomes int32, as JAX would make it, but only when its values fit:
    ValueError otherwise (JAX's own import keeps the low 32 bits, silently)."""
    import jax

    if tensor is None:
        return None
    if tensor.dtype == torch.int64 and not jax.config.jax_enable_x64:
        tensor = _narrowed_to_int32(tensor)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    array = jax.dlpack.from_dlpack(tensor.detach())
    if device is not None and array.devices() != {device}:
        array = jax.device_put(array, device)
    return array


def _narrowed_to_int32(tensor: torch.Tensor) -> torch.Tensor:
    info = torch.iinfo(torch.int32)
    low, high = (int(v) for v in tensor.aminmax()) if tensor.numel() else (0, 0)
    if low < info.min or high > info.max:
        raise ValueError(
            f"an int64 tensor {tuple(tensor.shape)} holds values outside int32 "
            f"[{low}, {high}], and JAX runs without x64 "
            "(jax.config.update('jax_enable_x64', True) keeps int64)"
        )
    return tensor.to(torch.int32)


def to_torch(array: jax.Array, like: torch.Tensor | None = None) -> torch.Tensor:
    """A torch tensor viewing `array` (moved to `like`'s device if JAX computed elsewhere, e.g. a TPU)."""
    import jax

    if like is not None and like.device.type == "cpu" and next(iter(array.devices())).platform != "cpu":
        array = jax.device_put(array, jax.devices("cpu")[0])
    return torch.from_dlpack(array)


def available(implementation: str) -> Callable[[torch.device | None], bool]:
    """CPU tensors: every implementation (Pallas interpreted off its accelerator; a TPU gets the
    data moved to it). CUDA tensors: pallas_gpu and xla, when jax has a GPU backend."""

    def available(device: torch.device | None) -> bool:
        if not jax_installed():
            return False
        if device is None or device.type == "cpu":
            return True
        from kiln.ops import pallas_common

        return device.type == "cuda" and implementation != "pallas_tpu" and pallas_common.on_gpu()

    return available


def _compute_device(implementation: str, tensor_device: torch.device) -> jax.Device | None:
    """Where the jax arrays must live for a compiled Pallas kernel: the TPU for pallas_tpu on a TPU
    host, a GPU for CPU tensors under pallas_gpu on a GPU host; None (stay where DLPack put them)
    otherwise: CUDA tensors are on their own GPU already (cuda:1 stays on JAX's second GPU)."""
    import jax

    from kiln.ops import pallas_common

    if implementation == "pallas_tpu" and pallas_common.on_tpu():
        return jax.devices()[0]
    if implementation == "pallas_gpu" and tensor_device.type == "cpu" and pallas_common.on_gpu():
        return jax.devices()[0]
    return None


def torch_function(spec: OpSpec, implementation: str) -> Callable[..., Any]:
    """The torch-facing function of implementation `implementation` of `spec`, over its JAX function."""
    n_out = spec.num_outputs
    names = list(spec.signature.parameters)
    written_positions = [names.index(name) for name in spec.mutated_args]

    def run(*args: Any, **kwargs: Any) -> Any:
        bound = spec.bind(args, kwargs)
        like = next(a for a in bound if isinstance(a, torch.Tensor))
        device = _compute_device(implementation, like.device)
        jax_args = [to_jax(a, device) if isinstance(a, torch.Tensor) else a for a in bound]
        result = spec.jax_implementations[implementation](*jax_args)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        outputs = _contract_integers(spec, bound, [to_torch(r, like) for r in results[:n_out]])
        written = [bound[i] for i in written_positions if bound[i] is not None]
        if len(results) != n_out + len(written):
            raise RuntimeError(
                f"{spec.name}/{implementation}: returned {len(results)} arrays, expected {n_out} outputs "
                f"and {len(written)} in-place arguments"
            )
        for target, new in zip(written, results[n_out:], strict=True):
            target.copy_(to_torch(new, target))
        op_result = None if n_out == 0 else outputs[0] if n_out == 1 else tuple(outputs)
        if spec.public_result is not None:
            return spec.public_result(op_result, bound)
        return op_result

    run.__name__ = f"{spec.name}_{implementation}"
    return run


def _contract_integers(spec: OpSpec, bound: tuple, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Integer outputs widened to the dtype the op's fake says: JAX without x64 computes int32 where the
    torch op returns int64 (token ids). Other dtype differences are left for the verifier to report."""
    if spec.fake is None or not any(not o.is_floating_point() for o in outputs):
        return outputs
    fakes = spec.contract_outputs(bound)

    def widened(out: torch.Tensor, want: Any) -> torch.Tensor:
        if not isinstance(want, torch.Tensor) or out.is_floating_point() or want.is_floating_point():
            return out
        return out.to(want.dtype)

    return [widened(o, f) for o, f in zip(outputs, fakes, strict=False)] + outputs[len(fakes) :]


def _torch_dtype(value: Any) -> Any:
    """A dtype given the JAX way (jnp.float32, np.dtype("bfloat16"), "float16") as the torch dtype of the
    same name; torch dtypes and None pass through, anything else is left for the validator to name."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        dtype = getattr(torch, dtype_name(value), None)
    except TypeError:
        return value
    return dtype if isinstance(dtype, torch.dtype) else value


def jax_function(spec: OpSpec) -> Callable[..., Any]:
    """The `kiln.jax.<name>` entry point of `spec` (see the module docstring). Returns the op's
    outputs followed by the new values of the in-place arguments (a lone array when that is one)."""
    from kiln.ops import pallas_common

    available = tuple(spec.jax_implementations)

    # ScalarType arguments (out_dtype, ...): the parsed schema types them as int, so go by name
    dtype_positions = [i for i, name in enumerate(spec.signature.parameters) if name.endswith("dtype")]

    def entry(*args: Any, implementation: str | None = None, **kwargs: Any) -> Any:
        try:
            bound = list(spec.bind(args, kwargs))
        except TypeError as error:
            raise ValueError(f"{spec.name}: {error}") from None
        for i in dtype_positions:  # out_dtype=jnp.float32 means torch.float32 to the validator/kernels
            bound[i] = _torch_dtype(bound[i])
        bound = spec.check(*bound)
        chosen = pallas_common.resolve(spec.name, implementation, available)
        return spec.jax_implementations[chosen](*bound)

    entry.__name__ = entry.__qualname__ = spec.name
    entry.__doc__ = (spec.doc or spec.description) + (
        "\n\nJAX: takes jax arrays; `implementation` is None (this device's best), or one of "
        f"{', '.join(available)}. Arguments the torch op writes in place are returned as new arrays "
        "after the outputs."
    )
    entry.__module__ = "kiln.jax"
    return entry
