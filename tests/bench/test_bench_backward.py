"""`kiln bench --backward`: forward+backward timed against torch autograd in the same run, with peak
memory; the fused cross-entropy's peak is measured far below the unfused loss's."""

import json

import pytest
import torch

from kiln.bench.backward import bench_backward_case, peak_memory, resolve_backward_cases
from kiln.cli import main
from kiln.ops import all_ops

CPU = torch.device("cpu")
FAST = {"reps": 3}


def _case(op, shape, dtype=torch.float32):
    return resolve_backward_cases([op], "llm", json.dumps(shape), [str(dtype)[6:]], CPU)[0]


@pytest.mark.parametrize(
    ("op", "shape"),
    [
        ("silu_and_mul", {"rows": 33, "d": 96}),
        ("rms_norm", {"rows": 17, "hidden": 64, "residual": True}),
        ("rotary_embedding", {"tokens": 9, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "rotary_dim": 16}),
        ("flash_attention_with_lse", {"seqlens_q": [7, 5], "seqlens_k": [7, 9], "num_heads": 4,
                                      "num_kv_heads": 2, "head_dim": 64}),
    ],
)  # fmt: skip
def test_case_records_time_memory_and_eager_ratio(op, shape):
    record = bench_backward_case(_case(op, shape), CPU, compile_baseline=False, timing_kwargs=FAST)
    assert record["error"] is None, record["error"]
    assert record["mode"] == "fwd_bwd" and record["median_ms"] > 0
    assert record["peak_memory"]["method"] == "cpu-profiler-allocations"
    assert record["peak_memory"]["bytes"] > 0  # the gradients at least are allocated
    eager = record["baselines"]["torch_eager"]
    assert "error" not in eager, eager
    assert eager["speedup"] == pytest.approx(eager["median_ms"] / record["median_ms"])


def test_fused_cross_entropy_peak_is_far_below_unfused():
    shape = {"tokens": 512, "hidden": 32, "vocab": 4096}  # float32 logits: 8 MiB
    record = bench_backward_case(_case("fused_linear_cross_entropy", shape), CPU, compile_baseline=False,
                                 timing_kwargs=FAST)  # fmt: skip
    logits = 512 * 4096 * 4
    assert record["baselines"]["torch_eager"]["peak_memory"]["bytes"] >= logits
    assert record["peak_memory"]["bytes"] < logits / 4
    assert record["baselines"]["torch_eager"]["memory_ratio"] > 4


def test_peak_memory_sees_a_temporary():
    def make_and_drop(inputs):
        torch.empty(1 << 20, dtype=torch.uint8)  # freed at once: only a peak counter sees it

    assert peak_memory(make_and_drop, {}, CPU)["bytes"] >= 1 << 20


def test_cli_writes_json_with_the_baseline_and_torch_compile(tmp_path):
    argv = ["bench", "--backward", "--op", "softmax", "--shapes", '{"rows": 8, "cols": 40}',
            "--reps", "3", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("*fwd-bwd.json")
    payload = json.loads(path.read_text())
    assert payload["kind"] == "kiln-bench-backward"
    assert payload["metadata"]["environment"]["torch"] == torch.__version__
    (case,) = payload["cases"]
    assert set(case["baselines"]) == {"torch_eager", "torch_compile"}
    assert all("speedup" in b or "error" in b for b in case["baselines"].values())


def test_op_without_backward_is_refused():
    assert "linear" in all_ops()
    with pytest.raises(ValueError, match="have no backward"):
        resolve_backward_cases(["linear"], "llm", None, None, CPU)
