"""The MoE kernels compile for an H100 (sm_90) without a GPU, through Triton's bundled ptxas: catches
what the interpreter cannot (unsupported constructs, fp8 conversions, shared-memory overflow,
register spills, a K loop that is not software-pipelined) on a CPU-only machine. The compile runs in
a subprocess (this file as a script) because the test session sets TRITON_INTERPRET=1, under which
@triton.jit builds interpreter functions."""

import json
import os
import subprocess
import sys

import pytest

# Runtime specialization marks 16-aligned pointers and multiple-of-16 ints (K, N and the strides of
# LLM shapes); without those marks cp.async pipelining is off, so mark them as a real launch would.
DIV16 = {"N", "K", "N_OUT", "stride_x", "stride_we", "stride_wn", "stride_h", "stride_out", "hidden"}
GEMM_COMMON = {
    "sorted_pair_ids_ptr": "*i32", "block_expert_ids_ptr": "*i32", "num_padded_ptr": "*i32",
    "num_pairs": "i32", "num_m_blocks": "i32",
}  # fmt: skip


def _build(fn, signature, constexprs, num_warps, num_stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, ty) in enumerate(signature.items())
        if ty.startswith("*") or name in DIV16
    }
    source = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs=attrs,
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    path = f"/tmp/kiln_moe_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    os.remove(path)
    stack = [int(tok.split(":")[1]) for tok in usage.split() if tok.startswith("STACK:")]
    return {
        "stack": max(stack, default=-1),
        "shared": kernel.metadata.shared,
        "cp_async": "cp.async" in kernel.asm["ptx"],
    }


def _compile_all():
    import torch

    from kiln.ops.moe import align
    from kiln.ops.moe.fused_moe import triton as moe
    from kiln.ops.moe.moe_route import triton as route

    results = {}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for act, w in (("bf16", "bf16"), ("bf16", "fp8e4nv"), ("fp16", "fp16"), ("fp32", "fp32")):
        for num_pairs in (2, 8192):  # Mixtral decode, prefill
            cfg = moe.heuristic_config(num_pairs, 8, dtypes[act])
            tiles = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_K": cfg["BLOCK_K"], "GROUP_M": cfg["GROUP_M"]}
            flags = {"HAS_SCALE": w == "fp8e4nv", "DOT_PRECISION": "ieee" if act == "fp32" else None}
            launch = (cfg["num_warps"], cfg["num_stages"])
            sig = {"x_ptr": "*" + act, "w_ptr": "*" + w, "w_scale_ptr": "*fp32", "h_ptr": "*" + act,
                   **GEMM_COMMON, "N": "i32", "K": "i32", "stride_x": "i32", "stride_we": "i64",
                   "stride_wn": "i32", "stride_h": "i32"}  # fmt: skip
            consts = {"TOP_K": 2, **flags, **tiles, "BLOCK_N": cfg["BLOCK_N"]}
            results[f"gate_up {act}/{w} {cfg}"] = _build(moe._moe_gate_up_kernel, sig, consts, *launch)
            sig = {"h_ptr": "*" + act, "w_ptr": "*" + w, "w_scale_ptr": "*fp32", "topk_weights_ptr": "*fp32",
                   "out_ptr": "*fp32", **GEMM_COMMON, "N_OUT": "i32", "K": "i32", "stride_h": "i32",
                   "stride_we": "i64", "stride_wn": "i32", "stride_out": "i32"}  # fmt: skip
            consts = {**flags, **tiles, "BLOCK_N": cfg["BLOCK_N_DOWN"]}
            results[f"down {act}/{w} {cfg}"] = _build(moe._moe_down_kernel, sig, consts, *launch)
    sig = {"partial_ptr": "*fp32", "topk_ids_ptr": "*i32", "out_ptr": "*bf16", "hidden": "i32",
           "num_experts": "i32"}  # fmt: skip
    results["sum"] = _build(moe._moe_sum_kernel, sig, {"TOP_K": 2, "BLOCK_H": 1024}, 4, 1)
    sig = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "num_tokens": "i32",
           "num_experts": "i32", "logits_row_stride": "i32"}  # fmt: skip
    consts = {"TOP_K": 8, "SIGMOID": True, "RENORMALIZE": True, "BLOCK_T": 16, "BLOCK_E": 256, "K_PAD": 8}
    results["route"] = _build(route._moe_route_kernel, sig, consts, 4, 1)
    sig = {"topk_ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
           "num_pairs": "i32", "num_experts": "i32", "max_padded": "i32", "num_blocks": "i32"}  # fmt: skip
    for pairs, experts in ((16384 // 256, 256), (16384 // 8, 8)):  # the largest one-program alignments
        consts = {
            "BLOCK_M": 16,
            "BLOCK_P": pairs,
            "BLOCK_E": experts,
            "BLOCK_S": align.align_block_s(experts),
        }
        results[f"align {pairs}x{experts}"] = _build(align._moe_align_kernel, sig, consts, 8, 1)
    return results


def _bundled_tools_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.exists(os.path.join(bin_dir, "cuobjdump"))


@pytest.mark.skipif(
    not _bundled_tools_present(), reason="Triton's bundled CUDA tools (ptxas, cuobjdump) missing"
)
def test_moe_kernels_compile_for_h100_without_spills_and_with_async_copies():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 20
    for name, info in results.items():
        assert info["stack"] == 0, f"{name}: {info['stack']} bytes of register spills"
        assert info["shared"] <= 227 * 1024, (
            f"{name}: {info['shared']} bytes of shared memory (H100: 227 KiB)"
        )
        if name.startswith(("gate_up", "down")):
            assert info["cp_async"], f"{name}: the K loop is not software-pipelined (no cp.async)"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
