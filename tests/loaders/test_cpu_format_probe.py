"""The CPU weight-format probe (kiln.loaders.cpu_format_probe): its choice is applied, cached (a second
load times nothing), overridden by an explicit format or KILN_CPU_FORMAT_PROBE=1, and a corrupt cache
is ignored with a warning. The timer is replaced so the choice is known; one test times for real."""

import json
import os

import pytest
import torch

from kiln.loaders import cpu_format_probe, load_model
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight

MODEL = "random:tiny"
FAKE_SECONDS = {"fp16": 2e-3, "fp32": 1e-3, "kquants": 4e-3}  # fp32 "wins" unless a test says otherwise


@pytest.fixture
def timed(monkeypatch):
    """Replace the per-format timer; returns the list of (role-sized weight count, format) timed."""
    calls = []

    def fake_time_format(weights, fmt, dtype):
        calls.append((len(weights), fmt))
        return FAKE_SECONDS[fmt]

    monkeypatch.setattr(cpu_format_probe, "_time_format", fake_time_format)
    monkeypatch.delenv("KILN_CPU_FORMATS", raising=False)
    monkeypatch.delenv("KILN_CPU_FORMAT_PROBE", raising=False)
    return calls


def layouts(loaded):
    return loaded.model.layers[0].mlp.gate_up_proj.prepared.layout, loaded.model.lm_head.prepared.layout


def test_probe_choice_is_applied_and_cached_so_a_second_load_times_nothing(timed):
    first = load_model(MODEL, cpu_format="auto", lm_head_format="auto")
    assert sorted(timed) == [(1, "fp16"), (1, "fp32"), (4, "fp16"), (4, "fp32")]  # LM head; 4 layer GEMMs
    assert layouts(first) == ("onednn", "onednn")  # fp32 timed faster: packed float32
    cache = json.loads(open(os.environ["KILN_TUNE_CACHE"]).read())["entries"]
    shapes = [key for key, entry in cache.items() if "from" not in entry]  # each also has its bucket's
    assert len(shapes) == 2 and all(e["config"] == {"cpu_format": "fp32"} for e in cache.values())
    timed.clear()
    second = load_model(MODEL, cpu_format="auto", lm_head_format="auto")
    assert timed == [] and layouts(second) == ("onednn", "onednn")


def test_another_cpu_generation_under_the_same_name_times_again(timed, monkeypatch):
    # virtual machines report e.g. "AMD EPYC" for several generations: the family/model/stepping and
    # the ISA flags are part of the key, so a cached choice from another one is not reused
    host = {"cpu_model": "AMD EPYC", "cpu_id": "family 25 model 1 stepping 1", "cpu_flags": ["avx2"]}
    monkeypatch.setattr(cpu_format_probe.environment, "cpu", lambda: dict(host))
    cpu_format_probe.cpu_model_name.cache_clear()
    monkeypatch.setattr(cpu_format_probe, "cpu_model_name", cpu_format_probe.cpu_model_name.__wrapped__)
    load_model(MODEL, cpu_format="auto")
    assert sorted(timed) == [(4, "fp16"), (4, "fp32")]
    timed.clear()
    load_model(MODEL, cpu_format="auto")
    assert timed == []  # same host: cached
    host.update(cpu_id="family 25 model 17 stepping 1", cpu_flags=["avx2", "avx512f", "avx512_bf16"])
    load_model(MODEL, cpu_format="auto")
    assert sorted(timed) == [(4, "fp16"), (4, "fp32")]
    entries = json.loads(open(os.environ["KILN_TUNE_CACHE"]).read())["entries"]
    assert any("model 17" in key and "avx512_bf16" in key for key in entries), list(entries)


def test_a_lower_aten_capability_times_again(timed, monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host runs other kernels (Kiln's native build follows it):
    # the same CPU's cached choice is not theirs
    from kiln.ops import native_cpu

    native_cpu.load()  # built (or not) for the real capability before the fake one is in place
    load_model(MODEL, cpu_format="auto")
    timed.clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "KILN_TEST_ISA")
    load_model(MODEL, cpu_format="auto")
    assert sorted(timed) == [(4, "fp16"), (4, "fp32")]
    entries = json.loads(open(os.environ["KILN_TUNE_CACHE"]).read())["entries"]
    assert any("KILN_TEST_ISA" in key for key in entries), list(entries)


def test_explicit_format_overrides_the_probe(timed):
    loaded = load_model(MODEL, cpu_format="fp16", lm_head_format="fp16")
    assert timed == [] and layouts(loaded) == ("fp16_onednn", "fp16_onednn")


def test_reprobe_env_times_again_and_replaces_the_cached_choice(timed, monkeypatch):
    load_model(MODEL, cpu_format="auto")
    monkeypatch.setitem(FAKE_SECONDS, "fp16", 1e-4)
    assert layouts(load_model(MODEL, cpu_format="auto"))[0] == "onednn"  # cached: fp32 still
    monkeypatch.setenv("KILN_CPU_FORMAT_PROBE", "1")
    timed.clear()
    assert layouts(load_model(MODEL, cpu_format="auto"))[0] == "fp16_onednn"
    assert sorted(timed) == [(4, "fp16"), (4, "fp32")]


def test_corrupt_cache_entry_is_ignored_with_a_warning(timed):
    load_model(MODEL, cpu_format="auto")
    path = os.environ["KILN_TUNE_CACHE"]
    data = json.loads(open(path).read())
    for entry in data["entries"].values():
        entry["config"] = {"cpu_format": "fp64"}
    open(path, "w").write(json.dumps(data))
    from kiln.ops import tuned_configs

    tuned_configs._user_entries = None  # the process-wide copy of the file
    timed.clear()
    with pytest.warns(UserWarning, match="ignoring a cached entry with cpu_format 'fp64'"):
        loaded = load_model(MODEL, cpu_format="auto")
    assert sorted(timed) == [(4, "fp16"), (4, "fp32")] and layouts(loaded)[0] == "onednn"


def test_unreadable_cache_file_is_ignored_with_a_warning(timed):
    with open(os.environ["KILN_TUNE_CACHE"], "w") as f:
        f.write("{ not json")
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        loaded = load_model(MODEL, cpu_format="auto")
    assert len(timed) == 2 and layouts(loaded)[0] == "onednn"


def test_random_checkpoint_keeps_the_model_dtype_without_auto(timed):
    loaded = load_model(MODEL)
    assert timed == [] and layouts(loaded) == ("onednn", "onednn")


def test_candidates_exclude_int4_for_dense_weights_and_reject_unknown_names(monkeypatch):
    weights = [torch.randn(32, 64)]
    monkeypatch.setenv("KILN_CPU_FORMATS", "fp16,int4,bf16")
    assert cpu_format_probe.candidate_formats(weights) == ("fp16", "bf16")
    monkeypatch.setenv("KILN_CPU_FORMATS", "fp16,fp8")
    with pytest.raises(ValueError, match="fp8"):
        cpu_format_probe.candidate_formats(weights)


def test_candidates_keep_int8_blocks_only_for_q8_0_matrices(monkeypatch):
    monkeypatch.setenv("KILN_CPU_FORMATS", "fp16,int8_blocks,int4")
    q8 = GGUFWeight("Q8_0", quantize_blocks(torch.randn(32, 64), "Q8_0"), (32, 64))
    q4 = GGUFWeight("Q4_1", quantize_blocks(torch.randn(32, 64), "Q4_1"), (32, 64))
    assert cpu_format_probe.candidate_formats([q8]) == ("fp16", "int8_blocks")
    assert cpu_format_probe.candidate_formats([q8, q4]) == ("fp16",)
    assert cpu_format_probe.candidate_formats([torch.randn(32, 64)]) == ("fp16",)


def test_real_timer_picks_one_of_the_candidates(monkeypatch):
    monkeypatch.delenv("KILN_CPU_FORMATS", raising=False)
    weights = [torch.randn(48, 64), torch.randn(64, 32)]
    assert cpu_format_probe.choose_format(weights, torch.float32, "layers") in ("fp16", "fp32")


def test_default_candidates_time_the_blocks_formats_only_for_their_gguf_types(monkeypatch):
    monkeypatch.delenv("KILN_CPU_FORMATS", raising=False)
    q4 = [GGUFWeight(t, quantize_blocks(torch.randn(32, 64), t), (32, 64)) for t in ("Q4_0", "Q4_1")]
    q8 = GGUFWeight("Q8_0", quantize_blocks(torch.randn(32, 64), "Q8_0"), (32, 64))
    assert cpu_format_probe.candidate_formats(q4) == ("fp16", "fp32", "q4_blocks")
    assert cpu_format_probe.candidate_formats([q8]) == ("fp16", "fp32", "q8_blocks")  # a GGUF LM head
    assert cpu_format_probe.choose_format([q8], torch.float32, "lm_head") in ("fp16", "fp32", "q8_blocks")
    # a mixed file's layer (Q4_K_M: Q4_K beside Q6_K; a fused projection whose parts mixed types comes
    # as a float matrix): the two exact formats prepare it alike, the first named is timed
    q6, q5 = (GGUFWeight(t, quantize_blocks(torch.randn(32, 256), t), (32, 256)) for t in ("Q6_K", "Q5_0"))
    assert cpu_format_probe.candidate_formats([*q4, q8]) == ("fp16", "fp32", "q4_blocks")
    mixed_layer = [q4[0], q6, torch.randn(32, 64)]
    # with a K-quant matrix, "kquants" too where it runs on an AVX-512 build (its file-blocks layout)
    kquants = ("kquants",) if cpu_format_probe.kquants_probed() else ()
    assert cpu_format_probe.candidate_formats(mixed_layer) == ("fp16", "fp32", "q4_blocks", *kquants)
    q4k = GGUFWeight("Q4_K", quantize_blocks(torch.randn(8, 256), "Q4_K"), (8, 256))
    stacked = GGUFStackedWeight.stack([q6, q4k])  # a Q4_K_M file's fused QKV
    assert cpu_format_probe.candidate_formats([stacked]) == ("fp16", "fp32", "q4_blocks", *kquants)
    assert cpu_format_probe.candidate_formats([q5]) == ("fp16", "fp32", "q4_blocks")
    monkeypatch.setenv("KILN_CPU_FORMATS", "fp16,q8_blocks,q4_blocks")
    assert cpu_format_probe.candidate_formats([q5, q6]) == ("fp16", "q8_blocks")
    monkeypatch.delenv("KILN_CPU_FORMATS")
    assert cpu_format_probe.candidate_formats([torch.randn(32, 64)]) == ("fp16", "fp32")


def test_the_probe_times_cache_cold_passes_without_timing_the_eviction(monkeypatch):
    """Each timed pass (and the warm-up) follows a write of EVICT_BYTES, so the weights come from memory
    as in a decode step; the write itself is outside the timed region."""
    import time

    evictions = []
    monkeypatch.setattr(cpu_format_probe, "_cache_evictor", lambda: lambda: evictions.append(1))
    weights = [torch.randn(48, 64), torch.randn(64, 32)]
    cpu_format_probe._time_format(weights, "fp32", torch.float32)
    assert len(evictions) == cpu_format_probe.REPEATS + 1
    slow_before = cpu_format_probe.time_call(lambda: None, before=lambda: time.sleep(0.02))
    assert slow_before < 0.01  # the median of the timed calls alone


def test_an_a8_layers_format_gives_the_head_the_same_unless_one_is_asked_for(timed, tmp_path, monkeypatch):
    """--cpu-format q4_blocks_a8 alone: the head takes it too, untimed (a K-quant head then keeps only
    its file's blocks, "kquants_a8", instead of an exact format's float32 copy); an explicit head format
    or "auto" still rules."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q

    from kiln.ops.gemm import cpu_kquants_a8
    from tests.loaders.gguf_tiny import write_tiny_gguf
    from tests.loaders.test_gguf_loader import tiny_llama

    if not cpu_kquants_a8.load():
        pytest.skip("Kiln's native CPU library could not be built here")
    hf = tiny_llama(
        seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {**dict.fromkeys(names, Q.Q4_K), "token_embd": Q.Q8_0, "output": Q.Q6_K}
    path = str(tmp_path / "k_quants.gguf")
    write_tiny_gguf(hf, path, tensor_types=types)
    assert layouts(load_model(path, cpu_format="q4_blocks_a8")) == ("kquants_a8", "kquants_a8")
    assert timed == []
    assert layouts(load_model(path, cpu_format="q4_blocks_a8", lm_head_format="fp32")) == (
        "kquants_a8",
        "onednn",
    )
    for fmt in ("q4_blocks", "q8_blocks"):  # the exact blocks formats are candidates for a GGUF head
        monkeypatch.setitem(FAKE_SECONDS, fmt, 3e-3)
    load_model(path, cpu_format="q4_blocks_a8", lm_head_format="auto")
    assert timed and all(count == 1 for count, _ in timed)  # the head timed, the layers as asked
