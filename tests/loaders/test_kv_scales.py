"""kiln.loaders.kv_scales: load_model keeps the FP8 KV-cache scales a checkpoint ships on
LoadedModel.kv_scales (compressed-tensors' self_attn.k_scale / v_scale, per tensor or per kv head;
AutoFP8's k_proj.k_scale / v_proj.v_scale, k_proj / v_proj.output_scale and kv_scale), for the layers it
builds and, under tensor parallelism, sliced to the rank's kv heads as its k/v projections are; they are
no longer reported as unused tensors. Checkpoints: tests/loaders/ct_checkpoints.py."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.loaders import load_model
from kiln.models.layers.tp import TPGroup

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tests.loaders.ct_checkpoints import CONFIG, write_kv_scaled_llama  # noqa: E402

HEADS = CONFIG["num_key_value_heads"]


@pytest.fixture(scope="module")
def per_tensor(tmp_path_factory):
    return write_kv_scaled_llama(tmp_path_factory.mktemp("tensor"), "tensor")


@pytest.fixture(scope="module", params=["tensor", "attn_head"])
def checkpoint(request, tmp_path_factory):
    if request.param == "tensor":
        return "tensor", request.getfixturevalue("per_tensor")
    return request.param, write_kv_scaled_llama(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module", params=["tensor", "attn_head"])
def fp8_checkpoint(request, tmp_path_factory):
    """FP8 weights (per-channel scales shard with their rows; W4A16's groups of 128 cannot split
    intermediate 384 over 2 ranks) and KV scales per tensor or per kv head."""
    return write_kv_scaled_llama(tmp_path_factory.mktemp(request.param), request.param, preset="FP8")


def test_load_model_keeps_the_checkpoints_kv_scales(checkpoint, caplog):
    strategy, path = checkpoint
    stored = load_file(f"{path}/model.safetensors")
    with caplog.at_level(logging.WARNING, logger="kiln.loaders"):
        loaded = load_model(path)
    scales = loaded.kv_scales
    assert scales.source == path and scales.num_kv_heads == HEADS and scales.kv_heads == (0, HEADS)
    per_head = scales.per_head()
    assert len(scales.layers) == len(per_head) == CONFIG["num_hidden_layers"]
    for i, ((k_name, k), (v_name, v)) in enumerate(scales.layers):
        assert (k_name, v_name) == (
            f"model.layers.{i}.self_attn.k_scale",
            f"model.layers.{i}.self_attn.v_scale",
        )
        assert torch.equal(k, stored[k_name]) and torch.equal(v, stored[v_name])
        assert k.shape == ((1,) if strategy == "tensor" else (HEADS, 1, 1))
        for got, tensor in zip(per_head[i], (k, v), strict=True):
            assert got.dtype == torch.float32 and torch.equal(got, tensor.reshape(-1).expand(HEADS))
    assert "not used by the model" not in caplog.text  # the scales used to be reported unused


def _renamed(source: str, directory, renames: dict[str, str | None]) -> str:
    """A copy of `source` whose tensors are renamed (None: dropped) and stored 0-d, as AutoFP8 did."""
    import shutil

    shutil.copytree(source, directory)
    tensors = load_file(f"{directory}/model.safetensors")
    for old, new in renames.items():
        tensor = tensors.pop(old)
        if new is not None:
            tensors[new] = tensor.reshape(())
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return str(directory)


def test_older_autofp8_names_are_read_as_vllm_reads_them(per_tensor, tmp_path):
    """Layer 0: k_proj.k_scale / v_proj.v_scale; layer 1: one kv_scale for keys and values alike (vLLM
    copies it to both). k_proj / v_proj.output_scale are read the same way (another copy)."""
    path = per_tensor
    p = "model.layers.{}.self_attn."
    renames = {
        p.format(0) + "k_scale": p.format(0) + "k_proj.k_scale",
        p.format(0) + "v_scale": p.format(0) + "v_proj.v_scale",
        p.format(1) + "k_scale": p.format(1) + "kv_scale",
        p.format(1) + "v_scale": None,
    }
    stored = load_file(f"{path}/model.safetensors")
    loaded = load_model(_renamed(path, tmp_path / "autofp8", renames))
    names = [(k[0], v[0]) for k, v in loaded.kv_scales.layers]
    assert names == [
        (p.format(0) + "k_proj.k_scale", p.format(0) + "v_proj.v_scale"),
        (p.format(1) + "kv_scale", p.format(1) + "kv_scale"),
    ]
    (k0, v0), (k1, v1) = loaded.kv_scales.per_head()
    assert torch.equal(k0, stored[p.format(0) + "k_scale"].expand(HEADS))
    assert torch.equal(v0, stored[p.format(0) + "v_scale"].expand(HEADS))
    assert torch.equal(k1, v1) and torch.equal(k1, stored[p.format(1) + "k_scale"].expand(HEADS))
    renames = {
        p.format(i) + f"{kind}_scale": p.format(i) + f"{kind}_proj.output_scale"
        for i in (0, 1)
        for kind in "kv"
    }
    loaded = load_model(_renamed(path, tmp_path / "output_scale", renames))
    assert loaded.kv_scales.layers[1][1][0] == p.format(1) + "v_proj.output_scale"


def test_a_checkpoint_without_kv_scales_has_none(tmp_path):
    assert load_model(write_kv_scaled_llama(tmp_path, None)).kv_scales is None
    assert load_model("random:tiny").kv_scales is None


def _rank(rank: int, world_size: int) -> TPGroup:
    """A rank's place in a group, for building its shard (nothing here runs a collective)."""
    return TPGroup(rank, world_size, 0, device_group=None, cpu_group=None, setup_group=None, timeout_s=1.0)


@pytest.mark.parametrize(
    ("tp", "heads_of_rank"),
    [(2, [(0, 1), (1, 2)]), (4, [(0, 1), (0, 1), (1, 2), (1, 2)])],
    ids=["tp2-split", "tp4-replicated"],
)
def test_a_tensor_parallel_rank_gets_the_scales_of_its_kv_heads(fp8_checkpoint, tp, heads_of_rank):
    """2 kv heads: over 2 ranks one each, over 4 each head on 2 ranks (kiln.models.sharding), the same
    slices as the ranks' k_proj rows; a per-tensor scale goes to every rank's heads."""
    stored = load_file(f"{fp8_checkpoint}/model.safetensors")
    for rank, (start, end) in enumerate(heads_of_rank):
        loaded = load_model(fp8_checkpoint, tp_group=_rank(rank, tp))
        assert loaded.model.config.num_kv_heads == end - start
        assert loaded.kv_scales.kv_heads == (start, end)
        for i, scales in enumerate(loaded.kv_scales.per_head()):
            for kind, scale in zip("kv", scales, strict=True):
                tensor = stored[f"model.layers.{i}.self_attn.{kind}_scale"].reshape(-1)
                want = tensor.expand(end - start) if tensor.numel() == 1 else tensor[start:end]
                assert scale.shape == (end - start,) and torch.equal(scale, want)


def test_a_pipeline_stage_whose_layers_lack_scales_others_have_is_told_they_are_incomplete(
    per_tensor, tmp_path
):
    """Layer 1's scales removed: the stage building layer 1 alone was told the checkpoint ships no
    scales at all; it now hears that layer 1 has none (the checkpoint's scales are incomplete)."""
    from kiln.models.config import ModelLoadError

    drop = {f"model.layers.1.self_attn.{kind}_scale" for kind in "kv"}
    path = _renamed(per_tensor, tmp_path / "partial", {name: None for name in drop})
    stage = load_model(path, pipeline_layers=(1, 2))
    assert stage.kv_scales is not None
    with pytest.raises(ModelLoadError, match="decoder layer 1 has no k scale"):
        stage.kv_scales.per_head()
