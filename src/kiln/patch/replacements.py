"""The forwards kiln.patch puts in place of transformers' (see kiln/patch/__init__.py). Each takes
the transformers module as `self` and reads only the attributes the original forward reads."""

from __future__ import annotations

import inspect

import torch

from kiln.ops import autograd as kiln_autograd

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """<Arch>RMSNorm.forward: y = weight * x / rms(x), statistics in float32."""
    weight = self.weight if self.weight.dtype == hidden_states.dtype else self.weight.to(hidden_states.dtype)
    return kiln_autograd.rms_norm(hidden_states, weight, self.variance_epsilon)


def silu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """<Arch>MLP.forward with a SiLU gate: down_proj(silu(gate_proj(x)) * up_proj(x))."""
    gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    return self.down_proj(kiln_autograd.silu_and_mul(gate_up))


def make_apply_rotary_pos_emb(original):
    """apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) on Kiln's rotary kernel.

    q [B, Hq, S, D], k [B, Hk, S, D], cos / sin [B or 1, S, D] in transformers' NeoX layout (each half of
    the last dim repeats the other). Each token's (cos, sin) half rows become one row of a
    [B * S, D] cache addressed by positions 0..B*S-1. Other layouts go to the original function.
    """

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3:
            return original(q, k, cos, sin, unsqueeze_dim)
        batch, q_heads, seq, head_dim = q.shape
        half = head_dim // 2
        cache = torch.cat([cos[..., :half], sin[..., :half]], dim=-1)  # [1 or B, S, D]: shared positions
        cache = cache.expand(batch, seq, head_dim).reshape(batch * seq, head_dim)
        positions = torch.arange(batch * seq, device=q.device)
        q_rows = q.transpose(1, 2).reshape(batch * seq, q_heads, head_dim)
        k_rows = k.transpose(1, 2).reshape(batch * seq, k.shape[1], head_dim)
        q_rows, k_rows = kiln_autograd.rotary_embedding(positions, q_rows, k_rows, cache.detach(), True)
        q_out = q_rows.view(batch, seq, q_heads, head_dim).transpose(1, 2)
        k_out = k_rows.view(batch, seq, k.shape[1], head_dim).transpose(1, 2)
        return q_out, k_out

    apply_rotary_pos_emb.kiln_original = original
    return apply_rotary_pos_emb


def causal_lm_forward(self, *args, **kwargs):
    """<Arch>ForCausalLM.forward: with labels, the loss from the fused LM head + cross-entropy and no
    logits (None in their place, in the output and in the `return_dict=False` tuple); without, the
    model's own forward (stored by kiln.patch as `self._kiln_original_forward`)."""
    if args:  # positional arguments by the original forward's parameter names
        names = list(inspect.signature(self._kiln_original_forward).parameters)
        kwargs.update(zip(names, args, strict=False))
    labels = kwargs.pop("labels", None)
    if labels is None:
        return self._kiln_original_forward(**kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    kwargs.pop("logits_to_keep", None)  # no logits are computed
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(**kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = kiln_autograd.fused_linear_cross_entropy_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        self.lm_head.weight,
        shift_labels.reshape(-1).to(hidden.device),
        self.lm_head.bias,
        ignore_index=IGNORE_INDEX,
        reduction="mean" if num_items_in_batch is None else "sum",
    )
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    if return_dict is False:  # transformers' layout: (loss, logits, then the base model's outputs)
        return (loss, None, *outputs.to_tuple()[1:])
    # the base model's fields by name (the cache is `cache` in transformers 5, `past_key_values` before)
    fields = {
        name: getattr(outputs, name, None)
        for name in CausalLMOutputWithPast.__dataclass_fields__
        if name not in ("loss", "logits")
    }
    return CausalLMOutputWithPast(loss=loss, logits=None, **fields)
