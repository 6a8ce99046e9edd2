"""How the attention ops meet compilers: torch.ops.kiln.* custom ops (schema, fakes, torch.compile
fullgraph) and the Triton kernels compiled ahead of time for sm_90, which the interpreter used by
the other CPU tests never checks."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ops
from kiln.ops.attention.paged_decode_attention.cpu import IN_GRAPH_MAX_CONTEXT
from kiln.ops.attention.paged_inputs import make_paged_kv
from kiln.verify import assert_close


def _paged(context_lens=(37, 5, 20), heads=9, kv_heads=3):
    g = torch.Generator().manual_seed(0)
    inputs = make_paged_kv(list(context_lens), kv_heads, 64, 16, torch.float32, "cpu", g)
    inputs["q"] = torch.randn(len(context_lens), heads, 64, generator=g)
    return inputs


def _step(q, key_cache, value_cache, block_tables, seq_lens, k, v, slots, cu_seqlens_q):
    """A toy layer: write the new tokens, decode, prefill over the same cache, plain flash."""
    torch.ops.kiln.write_kv_cache(k, v, key_cache, value_cache, slots)
    decode = torch.ops.kiln.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens)
    prefill = torch.ops.kiln.paged_prefill_attention(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, 1
    )
    flash, lse = torch.ops.kiln.flash_attention_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_q, 1, 1)
    return decode, prefill, flash, lse


def _step_args():
    p = _paged()
    k, v = torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    # the slots of tokens 36 and 19, the last of sequences 0 and 2; sequence 1's token is padding
    slots = torch.stack(
        [p["block_tables"][0, 2] * 16 + 4, torch.tensor(-1), p["block_tables"][2, 1] * 16 + 3]
    )
    slots = slots.long()
    cu = torch.arange(4, dtype=torch.int32)
    return (p["q"], p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"], k, v, slots, cu)


def test_attention_custom_ops_match_the_plain_functions_and_compile_fullgraph():
    args = _step_args()
    eager = _step(*[a.clone() for a in args])
    plain_k, plain_v = args[1].clone(), args[2].clone()
    kiln.ops.write_kv_cache(args[5], args[6], plain_k, plain_v, args[7])
    expected = kiln.ops.paged_decode_attention(args[0], plain_k, plain_v, args[3], args[4])
    assert_close(eager[0], expected, 0.0, "custom op vs plain function")
    compiled_args = [a.clone() for a in args]
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=True)(*compiled_args)
    assert torch.equal(compiled_args[1], plain_k), "write_kv_cache must mutate the cache under compile"
    for got, want in zip(compiled, eager, strict=True):
        assert_close(got, want, 0.0)


@pytest.mark.parametrize(
    "name",
    [
        "write_kv_cache",
        "flash_attention",
        "flash_attention_with_lse",
        "paged_prefill_attention",
        "paged_decode_attention",
    ],
)
def test_opcheck_attention_custom_ops(name):
    p = _paged()
    cu = torch.arange(4, dtype=torch.int32)
    k = torch.randn(3, 3, 64)
    args = {
        "write_kv_cache": (k, k.clone(), p["key_cache"], p["value_cache"], torch.tensor([3, -1, 70])),
        "flash_attention": (p["q"], k, k.clone(), cu, cu, 1, 1, True, None, 4, 30.0),
        "flash_attention_with_lse": (p["q"], k, k.clone(), cu, cu, 1, 1, True, None, 4, 30.0),
        "paged_prefill_attention": (
            p["q"],
            p["key_cache"],
            p["value_cache"],
            p["block_tables"],
            cu,
            p["seq_lens"],
            1,
        ),
        "paged_decode_attention": (
            p["q"],
            p["key_cache"],
            p["value_cache"],
            p["block_tables"],
            p["seq_lens"],
        ),
    }[name]
    torch.library.opcheck(getattr(torch.ops.kiln, name).default, args)


def test_fake_attention_ops_validate_without_reading_values():
    with FakeTensorMode():
        p = _paged()
        caches = (p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"])
        out = torch.ops.kiln.paged_decode_attention(p["q"], *caches)
        assert out.shape == p["q"].shape
        with pytest.raises(ValueError, match="head_dim 48"):
            torch.ops.kiln.paged_decode_attention(torch.empty(3, 9, 48), *caches)


# Compiles the kernel variants the GPU runs (bf16 and fp8 caches, paged and contiguous, split and
# single-partition decode) for sm_90 in a fresh process without TRITON_INTERPRET.
_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def build(module, kernel, signature, constexprs, **options):
        fn = getattr(importlib.import_module(f"kiln.ops.attention.{module}"), kernel)
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compile(source, target=GPUTarget("cuda", 90, 32), options=options)

    def ints(*names):
        return {n: "i32" for n in names}

    build("write_kv_cache.triton", "_write_kv_cache_kernel",
          {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*fp8e4nv",
           "value_cache_ptr": "*fp8e4nv", "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32",
           **ints("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kc_block", "stride_kc_slot",
                  "stride_kc_head", "stride_vc_block", "stride_vc_slot", "stride_vc_head", "num_kv_heads",
                  "head_dim", "num_slots")},
          {"BLOCK_SIZE": 16, "QUANTIZE": True, "BLOCK_H": 8, "BLOCK_D": 128}, num_warps=4)
    for paged, cache, head_dim, window, softcap, lse in (
        (False, "*bf16", 128, False, False, True), (True, "*fp8e4nv", 80, True, True, False),
    ):
        build("triton_prefill", "_prefill_kernel",
              {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16", "lse_ptr": "*fp32",
               "cu_seqlens_q_ptr": "*i32", "cu_seqlens_k_ptr": "*i32", "seq_lens_ptr": "*i32",
               "block_tables_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
               **ints("stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
                      "stride_vt", "stride_vh", "stride_ot", "stride_oh", "stride_lse_h", "stride_bt",
                      "num_blocks", "table_width", "num_queries_per_kv"),
               "sm_scale": "fp32", "softcap": "fp32", "window": "i32"},
              {"HEAD_DIM": head_dim, "PAGED": paged, "PAGE_SIZE": 16, "CAUSAL": True, "HAS_WINDOW": window,
               "HAS_SOFTCAP": softcap, "HAS_KV_SCALE": cache == "*fp8e4nv", "RETURN_LSE": lse, "IEEE": False,
               "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=8, num_stages=3)
    for cache, single in (("*bf16", True), ("*fp8e4nv", False)):
        build("paged_decode_attention.triton", "_decode_partition_kernel",
              {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
               "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "out_ptr": "*bf16",
               "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
               **ints("stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
                      "stride_vt", "stride_vh", "stride_bt", "stride_ob", "stride_oh", "stride_pb",
                      "stride_ph", "stride_ps", "stride_lb", "stride_lh", "num_blocks", "table_width",
                      "num_queries_per_kv"),
               "sm_scale": "fp32", "softcap": "fp32", "window": "i32", "partition_size": "i32"},
              {"HEAD_DIM": 128, "PAGE_SIZE": 16, "HAS_WINDOW": not single, "HAS_SOFTCAP": not single,
               "HAS_KV_SCALE": cache == "*fp8e4nv", "IEEE": False, "SINGLE_SPLIT": single, "BLOCK_G": 16,
               "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=4, num_stages=3)
    build("paged_decode_attention.triton", "_decode_combine_kernel",
          {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
           **ints("stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh", "stride_ob", "stride_oh",
                  "num_splits")},
          {"HEAD_DIM": 128, "BLOCK_S": 32, "BLOCK_D": 128}, num_warps=4)
    print("compiled")
    """
)


def test_attention_triton_kernels_compile_for_sm90_without_a_gpu():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def _graph_ops(backend_graphs):
    """The call targets of every captured graph, as strings."""
    return {
        str(node.target) for gm in backend_graphs for node in gm.graph.nodes if node.op == "call_function"
    }


def _poison_past_lengths(p: dict, lens: list[int]) -> None:
    """NaN in every cache slot of a sequence's own blocks at or past its length (make_paged_kv's
    block_tables; block size 16): slots the contract never reads, which a gather still touches."""
    tables = p["block_tables"]
    for cache in (p["key_cache"], p["value_cache"]):
        for row, n in enumerate(lens):
            for i in range(n, tables.shape[1] * 16):
                block = int(tables[row, i // 16])
                if block >= 0:
                    cache[block, i % 16] = float("nan")


def _decode_layer(q, k, v, key_cache, value_cache, slots, block_tables, seq_lens, k_scale, v_scale, window):
    """What a compiled decode step does per layer: write this step's keys, then attend."""
    kiln.ops.write_kv_cache(k, v, key_cache, value_cache, slots, k_scale, v_scale)
    return kiln.ops.paged_decode_attention(
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        sliding_window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@pytest.mark.parametrize(
    ("dtype", "window", "extra_blocks", "opaque"),
    [
        (torch.float32, None, 2, set()),
        (torch.float16, 9, 2, set()),
        (torch.float8_e4m3fn, None, 2, {"kiln.write_kv_cache", "kiln.paged_decode_attention"}),
        (torch.float32, None, IN_GRAPH_MAX_CONTEXT // 16, {"kiln.paged_decode_attention"}),  # wider
    ],
)
def test_cpu_write_and_decode_compile_in_graph_for_float_caches(
    dtype, window, extra_blocks, opaque, native_decode
):
    """The CPU write and decode attention traced by torch.compile (the compiled decode step): float
    caches become graph code (the PyTorch form only up to IN_GRAPH_MAX_CONTEXT gathered positions; the
    native kernel, when built, is one graph node at any width), fp8 ones one opaque node each (the
    decode a native graph node when built); either way the same cache and output as eager. Row 1 is
    padding (slot -1), slots past each length hold NaN,
    and the block table is wider than any context with out-of-range entries, which the in-graph form
    gathers and masks and the native kernel never reads."""
    native = native_decode
    if native:
        opaque = opaque - {"kiln.paged_decode_attention"}
    g = torch.Generator().manual_seed(11)
    lens = [37, 1, 20]
    p = make_paged_kv(lens, 3, 64, 16, dtype, "cpu", g, extra_blocks=4)
    q_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    q = torch.randn(3, 9, 64, generator=g).to(q_dtype)
    k, v = (torch.randn(3, 3, 64, generator=g).to(q_dtype) for _ in range(2))
    tables = p["block_tables"]
    slots = torch.stack([tables[0, 2] * 16 + 4, torch.tensor(-1), tables[2, 1] * 16 + 3]).long()
    wide = torch.cat([tables, torch.full((3, extra_blocks), 10_000, dtype=torch.int32)], dim=1)
    _poison_past_lengths(p, lens)

    def run(fn):
        key_cache, value_cache = p["key_cache"].clone(), p["value_cache"].clone()
        out = fn(
            q, k, v, key_cache, value_cache, slots, wide, p["seq_lens"], p["k_scale"], p["v_scale"], window
        )
        return out, key_cache, value_cache

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with kiln.ops.trusted_inputs(), torch.no_grad():
        eager = run(_decode_layer)
        torch._dynamo.reset()
        compiled = run(torch.compile(_decode_layer, backend=backend, fullgraph=True))
    assert {op for op in _graph_ops(graphs) if op.startswith("kiln.")} == opaque
    native_op = "kiln_cpu.paged_decode_fp8" if dtype == torch.float8_e4m3fn else "kiln_cpu.paged_decode"
    assert (native_op in _graph_ops(graphs)) == native
    assert not compiled[0].isnan().any()
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.float8_e4m3fn: 2e-3}[dtype]
    assert_close(compiled[0].float(), eager[0].float(), tol, "decode attention")
    for got, want in zip(compiled[1:], eager[1:], strict=True):  # the caches, NaN slots included
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiles_the_in_graph_decode_attention_to_what_eager_computes(dtype):
    """The in-graph form through inductor itself (the fused kernel the compiled step runs, not only its
    traced code): an explicit scale, 4 query heads per KV head, ragged contexts across block
    boundaries, NaN past each length, and the queries computed in the graph (inductor must not lose
    them into the score loop). Against the eager implementation and a float64 reference."""
    from kiln.ops.attention.paged_decode_attention.spec import paged_decode_attention_reference

    g = torch.Generator().manual_seed(12)
    lens = [33, 5, 17, 48]
    p = make_paged_kv(lens, 2, 32, 16, dtype, "cpu", g)
    tables = p["block_tables"]
    _poison_past_lengths(p, lens)
    x = torch.randn(4, 8, 32, generator=g).to(dtype)
    width = -(-max(lens) // 16)

    def attend(x, key_cache, value_cache, block_tables, seq_lens):
        q = x * 1.5 + 0.25  # a producer inductor could inline into the attention's loops
        return kiln.ops.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=0.07)

    args = (x, p["key_cache"], p["value_cache"], tables[:, :width].contiguous(), p["seq_lens"])
    with kiln.ops.trusted_inputs(), torch.no_grad():
        eager = attend(*args)
        torch._dynamo.reset()
        compiled = torch.compile(attend, fullgraph=True)(*args)
    assert not compiled.isnan().any()
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    assert_close(compiled.float(), eager.float(), tol, "inductor vs eager")
    # the op's input as eager rounds it (inductor may keep it in float32: within the tolerance)
    q = (x * 1.5 + 0.25).double()
    caches = (p["key_cache"], p["value_cache"])
    reference = paged_decode_attention_reference(q, *caches, tables, p["seq_lens"], scale=0.07)
    assert_close(compiled.double(), reference.double(), tol, "inductor vs float64")


@pytest.mark.parametrize("slots", [[-1, 5, -1], [-1, -1, -1], [40, -1, 3]])
def test_cpu_write_in_graph_skips_padding_wherever_it_is(slots):
    """Padding rows (slot -1) first, last or alone: the in-graph write leaves every slot but the real
    rows' exactly as the eager write does (padding repeats the first real row's write, or with no
    real row rewrites slot 0 with its own value)."""
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(4, 16, 2, 64, generator=g) for _ in range(2)]
    k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    slot_mapping = torch.tensor(slots)

    def write(k, v, key_cache, value_cache, slot_mapping):
        kiln.ops.write_kv_cache(k, v, key_cache, value_cache, slot_mapping)

    results = []
    for fn in (write, torch.compile(write, backend="aot_eager", fullgraph=True)):
        key_cache, value_cache = (c.clone() for c in caches)
        with kiln.ops.trusted_inputs(), torch.no_grad():
            fn(k, v, key_cache, value_cache, slot_mapping)
        results.append((key_cache, value_cache))
    torch._dynamo.reset()
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
    written = sum(s >= 0 for s in slots)
    changed = (results[0][0] != caches[0]).any(dim=(2, 3)).sum().item()
    assert changed == written  # the eager reference itself wrote the real rows only
