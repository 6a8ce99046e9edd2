"""`kiln bench parallel` end to end on 2 CPU ranks (gloo) over a tiny Mixtral written by transformers:
expert parallelism reports its all-to-alls, pipeline parallelism its stages' point-to-point waits,
and the JSON records the host (CPU model and ISA flags)."""

import json

import pytest

from kiln.bench.parallel import main
from tests.distributed.moe_checkpoints import write_moe_checkpoint


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")


def _run(capsys, *args) -> dict:
    assert main(["--batch", "2", "--max-tokens", "4", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def test_expert_parallel_counts_the_token_dispatch_all_to_alls(mixtral, capsys):
    report = _run(capsys, "--model", mixtral, "--tp", "2", "--ep", "2")
    ep, single = report["tp2_pp1_ep2"], report["one_process"]
    assert ep["decode_steps"] == single["decode_steps"] == 3
    # 2 MoE layers, each: counts then rows, out and back (4 all_to_all_single per layer and step)
    assert ep["rank0_all_to_all_single_calls_per_step"] == 8
    assert 0 < ep["rank0_communication_ms_per_step"] < ep["step_ms"]
    assert single["rank0_communication_ms_per_step"] == 0
    assert report["environment"]["cpu_model"] and "cpu_flags" in report["environment"]


def test_pipeline_stages_report_compute_and_point_to_point_waits(mixtral, capsys):
    report = _run(capsys, "--model", mixtral, "--pp", "2", "--no-baseline")
    assert "one_process" not in report
    pp = report["tp1_pp2_ep1"]
    assert [r["rank"] for r in pp["pipeline_ranks"]] == [0, 1]
    assert all(r["compute_ms_per_step"] > 0 and r["p2p_wait_ms_per_step"] >= 0 for r in pp["pipeline_ranks"])
    assert 0 < pp["rank0_communication_share"] < 1
