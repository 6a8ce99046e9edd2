"""Index inputs the engine builds itself are not checked inside `kiln.ops.trusted_inputs()`: the Triton
kernels must still never read or write outside the cache when one is wrong (a bad entry may give
wrong values for its own sequence, nothing more). Run in a child process, since an out-of-bounds
access used to kill the process (segfault) rather than raise."""

import textwrap

from tests.ops.attention.paged_cases import assert_triton_child_prints_ok

CHILD = textwrap.dedent(
    """
    import sys, torch, kiln.ops
    device = torch.device(sys.argv[1])
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, device=device)
    cache = torch.randn(4, 16, 2, 64, device=device)
    with kiln.ops.trusted_inputs():
        for bad in (1000, 2**31 - 1, -1, -(2**31)):
            tables = torch.tensor([[0, 1], [2, bad]], dtype=torch.int32, device=device)
            lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
            out = kiln.ops.paged_decode_attention(q, cache, cache.clone(), tables, lens)
            assert out.isfinite().all(), ("decode", bad)
            # seq_len past the table row (2 blocks x 16): the kernel reads only the row it has.
            out = kiln.ops.paged_decode_attention(q, cache, cache.clone(), tables, lens.new_tensor([20, 90]))
            assert out.isfinite().all(), ("decode, long seq_len", bad)
            qp = torch.randn(5, 4, 64, device=device)
            cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
            out = kiln.ops.paged_prefill_attention(qp, cache, cache.clone(), tables, cu, lens, max_seqlen_q=3)
            assert out.isfinite().all(), ("prefill", bad)
            key = torch.randn(3, 2, 64, device=device)
            kc, vc = cache.clone(), cache.clone()
            slots = torch.tensor([5, bad if bad >= 0 else 2**31 - 1, 64], dtype=torch.int64, device=device)
            kiln.ops.write_kv_cache(key, key.clone(), kc, vc, slots)
            expected = cache.clone().view(64, 2, 64)
            expected[5] = key[0]
            assert torch.equal(kc.view(64, 2, 64), expected), ("write_kv_cache", bad)
    print("ok")
    """
)


def test_triton_paged_kernels_stay_inside_the_cache_with_unchecked_bad_indices(device):
    assert_triton_child_prints_ok(CHILD, device)
