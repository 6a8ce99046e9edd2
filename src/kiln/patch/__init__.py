"""kiln.patch: run a Hugging Face transformers Llama / Mistral / Qwen2 model on Kiln's kernels for
training, in place and reversibly.

    import kiln.patch
    kiln.patch.apply(model)          # RMSNorm, SiLU-and-mul MLP, rotary embedding, fused LM-head loss
    ...train...
    kiln.patch.revert(model)         # the model's own code again
    with kiln.patch.patched(model):  # the same, for one block
        ...

What is swapped (every replacement is differentiable: kiln.ops.autograd):
  - each <Arch>RMSNorm module's forward -> kiln.ops.autograd.rms_norm
  - each <Arch>MLP module's forward -> down_proj(silu_and_mul([gate_proj(x) | up_proj(x)]))
  - the architecture's module-level apply_rotary_pos_emb -> kiln.ops.autograd.rotary_embedding over
    the cos/sin the model computed (NeoX pairs; rope scaling is already in them). This is a function
    of the transformers module, shared by every model of the architecture in the process: it stays
    swapped while at least one patched model of that architecture exists.
  - the <Arch>ForCausalLM's forward, when called with `labels`: the loss is
    kiln.ops.autograd.fused_linear_cross_entropy_loss over the last hidden states and lm_head's
    weight (the [tokens, vocab] logits are never built; the output's `logits` is None). Without
    labels the model's own forward runs.
kiln.patch imports kiln.ops and transformers only (never kiln.models).
"""

from kiln.patch.apply import SUPPORTED_MODEL_TYPES, apply, patched, revert

__all__ = ["SUPPORTED_MODEL_TYPES", "apply", "patched", "revert"]
