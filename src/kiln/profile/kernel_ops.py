"""Which registered op a kernel is, from the kernel itself: for kernels that run outside any declared
op call (a CUDA graph's replay, the CPU's flat native decode), where no enclosing `kiln::<op>` range
says it.

  - Triton kernels defined in kiln: the op whose package defines the @triton.jit function
    (`kiln.ops.norm.rms_norm.triton._rms_norm_kernel` -> rms_norm). A kernel of a module several ops
    share (`kiln.ops.gemm.scaled_triton`: fp8_linear and int8_linear; the autograd backward kernels)
    is Kiln's but no one op's: None.
  - Kiln's native CPU kernels, `kiln_cpu::<name>` (torch.ops.kiln_cpu, and the same names recorded
    inside the native flat decode): NATIVE_OPS.

A kernel that is neither (aten, cuBLAS, copies) has no op of its own: it is an op's only inside that
op's declared call.
"""

from __future__ import annotations

import re
import sys

# kiln_cpu kernel name patterns -> op. The GEMV/GEMM kernels and the activation quantizer behind them
# are the prepared weight layouts' (prepared_linear); causal_attention serves both flash_attention and
# paged_prefill_attention, so it is left to the declared call.
NATIVE_OPS = {
    r"(q4|q8)_(blocks|blocks_a8|blocks_mins_a8|tiles)_gem[mv]|kquants_a8_gem[mv]|w8a8(_amx)?_linear"
    r"|quantize_q8_[0k]": "prepared_linear",
    r"paged_decode(_fp8)?": "paged_decode_attention",
    r"rms_norm": "rms_norm",
    r"rotary_embedding_": "rotary_embedding",
    r"silu_and_mul": "silu_and_mul",
    r"gelu_tanh_and_mul": "gelu_tanh_and_mul",
    r"write_kv_cache": "write_kv_cache",
}


def triton_kernel_ops() -> dict[str, str | None]:
    """Name of every @triton.jit function in kiln's imported modules (kiln.ops imports every kernel
    module) -> its op (None: shared by several ops). Empty without Triton."""
    try:
        from triton.runtime.jit import JITFunction, KernelInterface
    except ImportError:
        return {}
    kernels: tuple[type, ...] = (JITFunction,)
    try:  # what triton.jit returns under TRITON_INTERPRET=1
        from triton.runtime.interpreter import InterpretedFunction

        kernels += (InterpretedFunction,)
    except ImportError:
        pass
    from kiln.ops import all_ops

    op_names = set(all_ops())
    found: dict[str, str | None] = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("kiln.") or module is None:
            continue
        for value in vars(module).values():
            # autotune / heuristics wrappers are KernelInterfaces too, holding the kernel in .fn
            while isinstance(value, KernelInterface) and not isinstance(value, kernels):
                value = getattr(value, "fn", None)
            if isinstance(value, kernels):
                fn = value.fn
                packages = [part for part in fn.__module__.split(".") if part in op_names]
                op = packages[-1] if packages else None
                if found.get(fn.__name__, op) != op:
                    op = None  # two kernels of one name in different ops' packages: no one op
                found[fn.__name__] = op
    return found


def kiln_kernel_op(name: str, triton_ops: dict[str, str | None]) -> tuple[bool, str | None]:
    """(whether `name` is one of Kiln's kernels, its op or None), given `triton_kernel_ops()`. A GPU
    kernel's name may carry its launch signature after "(": the function name is what counts."""
    if name.startswith("kiln_cpu::"):
        native = name[len("kiln_cpu::") :]
        for pattern, op in NATIVE_OPS.items():
            if re.fullmatch(pattern, native):
                return True, op
        return True, None
    function = name.split("(")[0].strip()
    if function in triton_ops:
        return True, triton_ops[function]
    return False, None
