"""Phi-3 (`Phi3ForCausalLM`): tiny random checkpoints written by transformers' `save_pretrained`
(fused qkv_proj / gate_up_proj; plain rope with a sliding window, LongRoPE, LongRoPE with partial
rotary, an early "su" config.json) against transformers: logits, greedy tokens, through the engine and
`kiln generate`; the same weights as a llama.cpp-style GGUF ("phi3": attn_qkv, ffn_up holding gate and
up, rope_factors_short/long tensors); tensor-parallel shards of the fused tensors."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kiln.loaders import load_model  # noqa: E402
from kiln.loaders.safetensors import load_safetensors_dir  # noqa: E402
from kiln.models.phi3 import FusedProjectionWeights, Phi3ForCausalLM  # noqa: E402
from kiln.models.registry import get_model_class  # noqa: E402
from kiln.models.sharding import ShardedWeightStore, ShardPlan  # noqa: E402
from kiln.models.weights import GGUFWeight, WeightStore  # noqa: E402
from tests.loaders.gguf_tiny import roundtrip  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]  # 13 tokens: crosses 8-token blocks
NEW_TOKENS = 10
# Same float32 weights and math, different summation order: float32 rounding through 2 layers.
TOL = 1e-5
ORIGINAL = 32  # LongRoPE's pre-training length: prompt + generated tokens (23) stay below it


def _factors(pairs, low, high, seed):
    generator = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(pairs, generator=generator, dtype=torch.float64)).tolist()


def _longrope(rotary_dim):
    pairs = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": _factors(pairs, 1.0, 1.6, 0),
        "long_factor": _factors(pairs, 1.0, 20.0, 1),
    }


def _config(case):
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    if case == "plain_sliding_window":  # Phi-3-mini-4k: no rope scaling, a sliding window
        return transformers.Phi3Config(**COMMON, max_position_embeddings=64, sliding_window=5)
    if case == "longrope":  # Phi-3.5-mini: LongRoPE
        return transformers.Phi3Config(
            **COMMON, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_theta": 10000.0, **_longrope(head_dim)},
        )  # fmt: skip
    assert case == "longrope_partial_rotary"  # Phi-4-mini: LongRoPE on 3/4 of each head
    return transformers.Phi3Config(
        **COMMON, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.75, **_longrope(head_dim * 3 // 4)},
    )  # fmt: skip


CASES = ("plain_sliding_window", "longrope", "longrope_partial_rotary")


def _hf(case, seed=0):
    hf = transformers.Phi3ForCausalLM(_config(case))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that next-token logits are far from ties
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    hf.generation_config.eos_token_id = None  # greedy comparisons run the full length
    return hf.eval()


def _write_word_tokenizer(directory, vocab_size):
    """A word-level tokenizer.json ("t0" .. "tN") so kiln's loader can open the directory as a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def _saved(case, directory, seed=0):
    hf = _hf(case, seed)
    hf.save_pretrained(directory)
    return hf


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _check_against_hf(hf, model, block_size=8):
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = prompt_logits(model, PROMPT, block_size=block_size)
    rel = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    assert rel.max() < TOL, f"relative logits error {rel.max():.2e}"
    assert greedy(model, PROMPT, NEW_TOKENS, block_size=block_size) == _hf_greedy(hf, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("case", CASES)
def test_tiny_phi3_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf = _saved(case, tmp_path)
    config, weights = load_safetensors_dir(str(tmp_path))
    model = get_model_class(config.architecture)(config, weights)
    assert isinstance(model, Phi3ForCausalLM)
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights.names()  # read fused, not pre-split
    _check_against_hf(hf, model)


def test_phi3_config_is_read_with_longrope_partial_rotary_and_sliding_window(tmp_path):
    _saved("longrope_partial_rotary", tmp_path / "partial")
    config, _ = load_safetensors_dir(str(tmp_path / "partial"))
    assert config.rope_scaling["rope_type"] == "longrope" and config.rotary_dim == 12
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert config.rope_scaling["factor"] == 4.0  # max_position_embeddings / original, as transformers
    assert len(config.rope_scaling["short_factor"]) == 6
    _saved("plain_sliding_window", tmp_path / "plain")
    config, weights = load_safetensors_dir(str(tmp_path / "plain"))
    assert config.rope_scaling is None and config.rotary_dim is None and config.sliding_window == 5
    assert all(layer.self_attn.sliding_window == 5 for layer in Phi3ForCausalLM(config, weights).layers)


def test_early_su_config_json_loads_as_longrope(tmp_path):
    """Phi-3-mini-128k's first config.json: rope_scaling {"type": "su", ...} and the pre-training
    length at the top level (transformers reads it as longrope)."""
    hf = _saved("longrope", tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {
        "type": "su",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
    }
    raw["original_max_position_embeddings"] = ORIGINAL
    path.write_text(json.dumps(raw))
    config, weights = load_safetensors_dir(str(tmp_path))
    assert config.rope_scaling["rope_type"] == "longrope"
    _check_against_hf(hf, Phi3ForCausalLM(config, weights))


def test_phi3_in_the_engine_batches_chunked_prefills_and_decodes_like_transformers(tmp_path):
    from kiln import LLM, SamplingParams

    hf = _saved("longrope", tmp_path, seed=3)
    _write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    prompts = [PROMPT, PROMPT[:4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    # A 16-token step budget splits the longest prompt into chunks and mixes prefills with decodes.
    llm = LLM(model=str(tmp_path), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(hf, prompt, 6), f"prompt of {len(prompt)} tokens"


def test_kiln_generate_runs_a_phi3_directory(tmp_path, capsys):
    from kiln.cli import build_parser

    hf = _saved("longrope", tmp_path, seed=4)
    _write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    prompt = "t5 t77 t3 t101 t42"
    args = build_parser().parse_args(
        ["generate", prompt, "--model", str(tmp_path), "--max-tokens", "5", "--ignore-eos", "--device", "cpu"]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    text, stats = "\n".join(lines[:-1]), lines[-1]
    expected = _hf_greedy(hf, [5, 77, 3, 101, 42], 5)
    assert text.split() == [f"t{i}" for i in expected]
    assert "5 tokens generated" in stats


# GGUF as llama.cpp's converter writes Phi-3: fused tensors under attn_qkv / ffn_up, not permuted,
# LongRoPE as two factor tensors and metadata. Quantization types mixed on purpose.
Q = gguf.GGMLQuantizationType
GGUF_TENSORS = {
    "attn_qkv": ("self_attn.qkv_proj", Q.Q8_0), "attn_output": ("self_attn.o_proj", Q.F16),
    "ffn_up": ("mlp.gate_up_proj", Q.Q4_1), "ffn_down": ("mlp.down_proj", Q.Q4_0),
    "attn_norm": ("input_layernorm", Q.F32), "ffn_norm": ("post_attention_layernorm", Q.F32),
}  # fmt: skip


def write_phi3_gguf(hf, path) -> dict:
    """Write a transformers Phi3ForCausalLM as a llama.cpp "phi3" GGUF; returns {hf_name: tensor} of
    the weights as stored (after quantization)."""
    c, rope = hf.config, hf.config.rope_parameters
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    head_dim = c.hidden_size // c.num_attention_heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    if rope.get("rope_type") == "longrope":
        original = c.original_max_position_embeddings
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    tokens = [f"<t{i}>" for i in range(c.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    writer.add_token_merges([])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    stored = {}

    def add(gguf_name, hf_name, qtype):
        w = sd[hf_name]
        stored[hf_name] = torch.from_numpy(roundtrip(w, qtype))
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, w.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", Q.F32)
    add("output.weight", "lm_head.weight", Q.F32)
    for i in range(c.num_hidden_layers):
        for short, (hf_short, qtype) in GGUF_TENSORS.items():
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{hf_short}.weight", qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("case", ["plain_sliding_window", "longrope_partial_rotary"])
def test_phi3_gguf_matches_transformers_on_the_stored_weights(case, tmp_path):
    hf = _hf(case, seed=6)
    stored = write_phi3_gguf(hf, tmp_path / "phi3.gguf")
    hf.load_state_dict(stored, strict=False)  # transformers on exactly the (quantized) stored values
    loaded = load_model(str(tmp_path / "phi3.gguf"), cpu_format="fp32", lm_head_format="fp32")
    model, config = loaded.model, loaded.config
    assert isinstance(model, Phi3ForCausalLM) and config.architecture == "Phi3ForCausalLM"
    assert config.sliding_window == hf.config.sliding_window
    if case == "longrope_partial_rotary":
        assert config.rotary_dim == 12 and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["short_factor"] == pytest.approx(hf.config.rope_parameters["short_factor"])
    _check_against_hf(hf, model)


def test_phi3_gguf_fused_blocks_split_into_q_k_v_and_gate_up_blocks(tmp_path):
    from kiln.loaders.gguf import load_gguf

    hf = _hf("longrope", seed=8)
    write_phi3_gguf(hf, tmp_path / "phi3.gguf")
    config, store, _, _ = load_gguf(str(tmp_path / "phi3.gguf"))
    view = FusedProjectionWeights(store, config)
    fused_qkv = store.get("model.layers.1.self_attn.qkv_proj.weight", (128, 64))
    fused_gate_up = store.get("model.layers.1.mlp.gate_up_proj.weight", (192, 64))
    rows = {"self_attn.q_proj": (0, 64), "self_attn.k_proj": (64, 96), "self_attn.v_proj": (96, 128)}
    rows.update({"mlp.gate_proj": (0, 96), "mlp.up_proj": (96, 192)})
    for short, (start, end) in rows.items():
        fused = fused_qkv if short.startswith("self_attn") else fused_gate_up
        part = view.get(f"model.layers.1.{short}.weight", (end - start, 64))
        # row slices of the raw blocks (Q8_0 / Q4_1), no dequantization on the way
        assert isinstance(part, GGUFWeight) and part.qtype == fused.qtype
        assert torch.equal(part.dequantize(torch.float32), fused.dequantize(torch.float32)[start:end])


def test_phi3_gguf_without_the_original_context_length_is_rejected(tmp_path):
    from kiln.models import ModelLoadError

    hf = _hf("longrope", seed=7)
    path = tmp_path / "phi3.gguf"
    write_phi3_gguf(hf, path)
    raw = path.read_bytes().replace(
        b"phi3.rope.scaling.original_context_length", b"phi3.rope.scaling.original_context_lengtX"
    )
    path.write_bytes(raw)
    with pytest.raises(ModelLoadError, match="original_context_length"):
        load_model(str(path))


def test_tensor_parallel_shards_of_fused_tensors_equal_a_split_checkpoints(tmp_path):
    """TP over Phi-3: every rank's q/k/v and gate/up slices, read through the fused tensors, are the
    slices the Llama rules give for the same weights stored split (which tests/distributed checks)."""
    hf = _saved("longrope", tmp_path)
    config, fused = load_safetensors_dir(str(tmp_path))
    sd = hf.state_dict()
    q, kv, inter = 64, 32, COMMON["intermediate_size"]
    split = {}
    for name, tensor in sd.items():
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            parts = dict(zip("qkv", tensor.split([q, kv, kv]), strict=True))
            split.update({f"{base}{p}_proj.weight": t for p, t in parts.items()})
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            split.update({f"{base}gate_proj.weight": tensor[:inter], f"{base}up_proj.weight": tensor[inter:]})
        else:
            split[name] = tensor
    plain = WeightStore("split", {n: (tuple(t.shape), lambda t=t: t.clone()) for n, t in split.items()})
    for tp in (2, 4):
        plan = ShardPlan(config, tp)
        for rank in range(tp):
            ours = ShardedWeightStore(FusedProjectionWeights(fused, config), plan, rank)
            theirs = ShardedWeightStore(plain, plan, rank)
            rank_config = plan.rank_config(rank)
            d, hidden = config.head_dim, config.hidden_size
            shapes = {
                "self_attn.q_proj": (rank_config.num_heads * d, hidden),
                "self_attn.k_proj": (rank_config.num_kv_heads * d, hidden),
                "self_attn.v_proj": (rank_config.num_kv_heads * d, hidden),
                "mlp.gate_proj": (rank_config.intermediate_size, hidden),
                "mlp.up_proj": (rank_config.intermediate_size, hidden),
            }
            for layer in range(config.num_layers):
                for short, shape in shapes.items():
                    name = f"model.layers.{layer}.{short}.weight"
                    assert torch.equal(ours.get(name, shape), theirs.get(name, shape)), (tp, rank, name)
