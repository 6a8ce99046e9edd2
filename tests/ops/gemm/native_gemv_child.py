"""The fresh-process check shared by the native one-row GEMVs' tests (q4_blocks, q8_blocks, a8): the
engine's compiled decode step is traced before any one-row call ran eagerly (prefill runs the float32
copy), so packing the weight must have loaded the op, else the graph holds the tensor form. A child
process, where nothing has loaded it yet, compiles one call with the tensor form replaced by a
function that fails."""

import subprocess
import sys

CHILD = """
import torch
import kiln.ops
from kiln.ops.gemm.prepared_linear.spec import prepared_linear_reference
from kiln.ops.gemm.weight_formats import prepare_linear_weight
{setup}
p = prepare_linear_weight(weight, device=torch.device("cpu"), dtype=torch.float32, cpu_format="{fmt}")


def refuse(*args):
    raise AssertionError("the compiled graph traced the tensor form, not the native op")


{tensor_form} = refuse
x = torch.randn(1, weight.shape[1])
step = torch.compile(lambda x: kiln.ops.prepared_linear(x, p.layout, p.tensors, None, None), fullgraph=True)
error = (step(x).double() - prepared_linear_reference(x.double(), p.layout, p.tensors)).norm()
print("ok", float(error))
"""


def assert_compiled_call_holds_native_op(setup: str, fmt: str, tensor_form: str) -> None:
    """setup: code defining `weight` (a GGUFWeight) and importing the module of `tensor_form`, the
    dotted name of the tensor-form function the child replaces; fmt: the cpu_format to pack it in."""
    script = CHILD.format(setup=setup, fmt=fmt, tensor_form=tensor_form)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
    assert float(done.stdout.split()[1]) < 1e-3
