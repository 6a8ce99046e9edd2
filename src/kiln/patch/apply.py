"""kiln.patch.apply / revert / patched: find the modules of a supported transformers model and swap
their forwards for kiln/patch/replacements.py's, remembering what to put back."""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Iterator

import torch

from kiln.patch import attention, replacements

# config.model_type -> the class-name prefix of its transformers modeling module
SUPPORTED_MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
SILU_ACTIVATIONS = ("silu", "swish")

_STATE_ATTR = "_kiln_patch_state"
_rope_users: dict[str, int] = {}  # modeling module name -> patched models using its swapped rope


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Swap `model`'s RMSNorms, SiLU MLPs, rotary embedding, attention (attn_implementation "kiln":
    kiln/patch/attention.py) and (for a *ForCausalLM) loss for Kiln's, in place. `model`: a
    transformers Llama / Mistral / Qwen2 model (any head). Returns the model.
    Raises ValueError for another architecture, a non-SiLU MLP, or a model patched already."""
    model_type, modeling = _supported(model)
    if hasattr(model, _STATE_ATTR):
        raise ValueError("kiln.patch.apply: this model is patched already (kiln.patch.revert(model) first)")
    prefix = SUPPORTED_MODEL_TYPES[model_type]
    norm_cls = getattr(modeling, f"{prefix}RMSNorm")
    mlp_cls = getattr(modeling, f"{prefix}MLP")
    swapped: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, norm_cls):
            module.forward = types.MethodType(replacements.rms_norm_forward, module)
            swapped.append(module)
        elif isinstance(module, mlp_cls):
            module.forward = types.MethodType(replacements.silu_mlp_forward, module)
            swapped.append(module)
    if model.__class__.__name__ == f"{prefix}ForCausalLM":
        model._kiln_original_forward = model.forward
        model.forward = types.MethodType(replacements.causal_lm_forward, model)
        swapped.append(model)
    _swap_rope(modeling)
    attention.register()
    model._kiln_original_attn_implementation = model.config._attn_implementation
    model.config._attn_implementation = attention.NAME
    setattr(model, _STATE_ATTR, _PatchState(model, modeling.__name__, swapped))
    return model


def revert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply(model)`: every swapped forward goes back to its class's own. Returns the model."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("kiln.patch.revert: this model is not patched (kiln.patch.apply(model) patches it)")
    release_rope, swapped = state.release_rope, state.swapped
    for module in swapped:
        del module.forward  # the instance attribute; the class's forward shows through again
    if hasattr(model, "_kiln_original_forward"):
        del model._kiln_original_forward
    model.config._attn_implementation = model._kiln_original_attn_implementation
    del model._kiln_original_attn_implementation
    release_rope()
    delattr(model, _STATE_ATTR)
    return model


@contextlib.contextmanager
def patched(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`with kiln.patch.patched(model):` apply on entry, revert on exit (also on an exception)."""
    apply(model)
    try:
        yield model
    finally:
        revert(model)


class _PatchState:
    """What revert needs: the swapped modules, and the model's share of the swapped rope (given back
    by revert, or when the model is garbage-collected patched). A deep copy of a patched model (TRL's
    reference model, an EMA copy) is a patched model of its own: it holds a share too."""

    def __init__(self, model: torch.nn.Module, modeling_name: str, swapped: list[torch.nn.Module]):
        self.model_id = id(model)
        self.modeling_name = modeling_name
        self.swapped = swapped
        self.release_rope = weakref.finalize(model, _restore_rope, modeling_name)

    def __deepcopy__(self, memo: dict) -> _PatchState:
        import copy

        model = memo[self.model_id]  # deepcopy made the model's copy before copying its attributes
        _rope_users[self.modeling_name] += 1
        return _PatchState(model, self.modeling_name, copy.deepcopy(self.swapped, memo))


def _supported(model: torch.nn.Module) -> tuple[str, types.ModuleType]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kiln.patch: model type {model_type!r} ({type(model).__name__}) is not supported; "
            f"supported transformers architectures: {supported}"
        )
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act not in SILU_ACTIVATIONS:
        raise ValueError(
            f"kiln.patch: {type(model).__name__} uses hidden_act={hidden_act!r}; the patched MLP is "
            f"SiLU-and-mul only ({', '.join(SILU_ACTIVATIONS)})"
        )
    modeling = sys.modules[f"transformers.models.{model_type}.modeling_{model_type}"]
    return model_type, modeling


def _swap_rope(modeling: types.ModuleType) -> None:
    if _rope_users.get(modeling.__name__, 0) == 0:
        modeling.apply_rotary_pos_emb = replacements.make_apply_rotary_pos_emb(modeling.apply_rotary_pos_emb)
    _rope_users[modeling.__name__] = _rope_users.get(modeling.__name__, 0) + 1


def _restore_rope(modeling_name: str) -> None:
    _rope_users[modeling_name] -= 1
    if _rope_users[modeling_name] == 0:
        modeling = sys.modules[modeling_name]
        modeling.apply_rotary_pos_emb = modeling.apply_rotary_pos_emb.kiln_original
