"""The backward Triton kernels (kiln.ops.autograd) and fused_linear_cross_entropy's row kernel compile
for a real GPU (sm_90) ahead of time, without one: the interpreter that runs every other CPU test
accepts things the compiler rejects. A fresh process, TRITON_INTERPRET unset."""

import os
import subprocess
import sys
import textwrap

import pytest

_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def build(module, kernel, signature, constexprs):
        fn = getattr(importlib.import_module(module), kernel)
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compile(source, target=GPUTarget("cuda", 90, 32))

    bf16, i32, f32 = "*bf16", "i32", "fp32"
    for activation in ("silu", "gelu_tanh"):
        build("kiln.ops.autograd.gated_backward_triton", "_gated_backward_kernel",
              {"x_ptr": bf16, "grad_y_ptr": bf16, "grad_x_ptr": bf16, "x_row_stride": i32,
               "grad_y_row_stride": i32, "grad_x_row_stride": i32, "d": i32},
              {"ACTIVATION": activation, "BLOCK_D": 1024})
    for flag in (True, False):
        build("kiln.ops.autograd.norm_backward_triton", "_rms_norm_backward_kernel",
              {"x_ptr": bf16, "weight_ptr": bf16, "grad_y_ptr": bf16, "grad_sum_ptr": bf16,
               "grad_x_ptr": bf16, "partial_dw_ptr": "*fp32", "x_row_stride": i32,
               "grad_y_row_stride": i32, "grad_sum_row_stride": i32, "grad_x_row_stride": i32,
               "rows": i32, "hidden": i32, "rows_per_program": i32, "eps": f32, "weight_offset": f32},
              {"HAS_GRAD_SUM": flag, "BLOCK_N": 4096})
        build("kiln.ops.autograd.norm_backward_triton", "_layer_norm_backward_kernel",
              {"x_ptr": bf16, "weight_ptr": bf16, "grad_y_ptr": bf16, "grad_x_ptr": bf16,
               "partial_dw_ptr": "*fp32", "partial_db_ptr": "*fp32", "x_row_stride": i32,
               "grad_y_row_stride": i32, "grad_x_row_stride": i32, "rows": i32, "hidden": i32,
               "rows_per_program": i32, "eps": f32},
              {"HAS_BIAS": flag, "BLOCK_N": 4096})
    build("kiln.ops.autograd.softmax_backward_triton", "_softmax_backward_kernel",
          {"y_ptr": bf16, "grad_y_ptr": bf16, "grad_x_ptr": bf16, "y_row_stride": i32,
           "grad_y_row_stride": i32, "grad_x_row_stride": i32, "n_cols": i32, "inv_temperature": f32},
          {"BLOCK_N": 4096})
    build("kiln.ops.loss.fused_linear_cross_entropy.triton", "_cross_entropy_rows_kernel",
          {"logits_ptr": bf16, "logits_row_stride": i32, "labels_ptr": "*i64", "row_loss_ptr": "*fp32",
           "scale_ptr": "*fp32", "vocab": i32, "ignore_index": i32, "label_smoothing": f32, "z_loss": f32},
          {"BLOCK_V": 4096})
    print("compiled")
    """
)


def test_backward_kernels_compile_for_sm90_without_a_gpu():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
