"""`kiln verify --quant-model --format sparse24 | sparse24-wanda`: 2:4 pruning through a whole model, the
perplexity on the shipped text checked against transformers' loss, and Wanda's calibration norms
checked against the inputs transformers' projections see."""

import math

import pytest
import torch

import kiln.verify.quant_model as qm
from kiln.models.calibration import checkpoint_input_norms
from kiln.quant.sparse24 import is_24_sparse, prune_24

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    generator = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            fan_in = param.shape[-1] if param.dim() == 2 and "embed" not in name else 1
            param.copy_(1.0 + 0.1 * noise if "norm" in name else noise / math.sqrt(fan_in))
    directory = tmp_path_factory.mktemp("tiny_llama_sparse")
    hf.save_pretrained(directory)
    return str(directory), hf


def test_float_perplexity_is_transformers_loss(tiny_llama):
    directory, hf = tiny_llama
    ckpt, (report,) = qm.quant_model_report(directory, ["sparse24"])
    ids = torch.tensor([ckpt.perplexity_ids])
    assert ids.shape[1] >= 64
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.double()
    assert ckpt.float_perplexity == pytest.approx(loss.exp().item(), rel=1e-4)
    # the magnitude-pruned copy: half of every weight zeroed, a different (random model: not
    # necessarily worse) perplexity
    assert all(m["cosine"] < 0.999 for m in report.weights.values())
    assert math.isfinite(report.perplexity) and report.perplexity != ckpt.float_perplexity


def test_wanda_norms_are_the_inputs_transformers_projections_see(tiny_llama):
    directory, hf = tiny_llama
    ckpt = qm.load_checkpoint(directory)
    model = qm.build_model(ckpt, ckpt.weights)
    ids = ckpt.calibration_ids[:40]
    norms = checkpoint_input_norms(model, [ids])
    seen = {}

    def hook(name):
        def record(module, inputs):
            seen[name] = inputs[0][0].double().norm(dim=0)

        return record

    handles = [
        module.register_forward_pre_hook(hook(f"{name}.weight"))
        for name, module in hf.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
    ]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    assert set(norms) == set(seen)  # every q/k/v/o/gate/up/down of every layer
    for name, norm in norms.items():
        torch.testing.assert_close(norm.double(), seen[name], rtol=1e-4, atol=1e-5)


def test_wanda_keeps_weights_on_loud_input_columns(tiny_llama):
    directory, _ = tiny_llama
    ckpt, (magnitude, wanda) = qm.quant_model_report(directory, ["sparse24", "sparse24-wanda"])
    pruned = qm.wanda_weights(ckpt, list(wanda.weights), None)
    for name, weight in pruned.items():
        assert is_24_sparse(weight)
        assert not torch.equal(weight, prune_24(ckpt.weights.cache[name]))  # not magnitude's choice
    assert set(magnitude.weights) == set(wanda.weights)
    assert math.isfinite(wanda.perplexity)
