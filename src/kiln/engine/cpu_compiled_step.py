"""Compiled CPU decode steps: the CPU counterpart of kiln.engine.cuda_graphs.

An eager decode step of a small model spends a large share of its time in Python: module calls,
views, and the dispatch of every `kiln.ops` call (about ten per layer). Here the model's decode
forward, and its LM head with it (compute_logits, unless tensor parallelism gathers the logits
across ranks), is compiled once per padded batch size (the same sizes as the CUDA graphs: 1, 2, 4, 8, then
multiples of 16) with torch.compile and inductor, static shapes, and replayed per step. Dynamo traces
through the public ops into their CPU implementations, so norms, projections, RoPE and the gated
activation become generated code calling ATen / oneDNN directly, and inductor's C++ wrapper calls it
with no Python in between (cpp_wrapper). The KV-cache write and paged decode attention are traced
too for a float cache (their CPU implementations' in-graph forms): the block table goes in cut to
the step's longest context, a width marked dynamic, so one graph per batch size serves every
context up to the in-graph attention's limit (8192 positions; a longer one compiles a second graph
with the attention opaque). Implementations that are not `traceable` for a call (kiln.ops.registry:
an fp8 cache, soft-capping) stay one opaque node each, `torch.ops.kiln.<op>`, run eagerly.

Inputs live in static buffers, padded exactly as the CUDA graphs pad them: slot -1 writes nothing
(in-graph: the first real row's write again), seq_len 1 over block 0 reads one harmless slot. A
bucket is compiled on its first step (about 2 minutes for SmolLM2 on a 2-core CPU from a cold
inductor cache, far too long to do every bucket up front). A compile or run that fails is recorded
in kiln.fallbacks (CPU_COMPILE_TO_EAGER), logged, and that step and every later one run eagerly.

The compiled forward runs under no_grad rather than inference mode: a graph that writes into its
inputs (the KV caches) fails to compile under inference mode, so the model's forward is called
unwrapped and the buffers and caches it reads are ordinary tensors.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from kiln import fallbacks
from kiln.engine.decode_buffers import DecodeBuffers, graph_batch_sizes
from kiln.models.attention_metadata import AttentionMetadata
from kiln.ops.attention.paged_decode_attention import cpu_native as paged_decode_native
from kiln.ops.cpu_inductor import isa_options

logger = logging.getLogger(__name__)

CPU_COMPILE_TO_EAGER = "cpu_compile->eager"  # kiln.fallbacks kind: the compiled decode step failed

# Inductor options of every compile. pattern_matcher off: its oneDNN fusions rewrite
# mkldnn._linear_pointwise (Kiln's packed weights) into forms that only lower for weights inductor
# froze itself; Kiln's layers are fused by hand already. cpp_wrapper: the graph's calls are made from
# C++, not from a generated Python function (SmolLM2, int4_bf16, batch 1, two pairs of runs: 85 -> 97
# and 86 -> 88 tok/s; its compile is slower, 121 against 85 s from a cold inductor cache).
INDUCTOR_OPTIONS = {"pattern_matcher": False, "cpp_wrapper": True}


@functools.cache
def _lower_runtime_packed_linear() -> None:
    """Let inductor compile mkldnn._linear_pointwise on weights that are graph inputs.

    Inductor's lowering of that op accepts only weights it packed itself (constants of a frozen
    graph); Kiln packs at load (kiln.ops.gemm.weight_formats), so its weights are inputs. For those,
    this lowers the op as an external call of the same ATen kernel (what eager runs); constant
    weights keep inductor's own lowering."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    op = torch.ops.mkldnn._linear_pointwise.default
    own = lowering.lowerings.pop(op, None)
    lowering.make_fallback(op, warn=False)
    extern = lowering.lowerings[op]
    if own is None:
        return

    def lower(x, weight, *args, **kwargs):
        if weight.get_name() in V.graph.constants:
            return own(x, weight, *args, **kwargs)
        return extern(x, weight, *args, **kwargs)

    lowering.lowerings[op] = lower


# the compiled function's tensor arguments (CompiledDecodeSteps._decode_forward)
STEP_ARGUMENTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q")


def _argument_guards_only(entries) -> list[bool]:
    """Dynamo guard filter: keep the guards on the step's input tensors (their shapes pick the batch
    size's graph) and on global state (grad mode and the like); drop those on the model, its weights
    and the KV cache, which are fixed for the runner's life (checking them cost ~60 us a step on the
    2-layer test model). Each CompiledDecodeSteps compiles in isolation (isolate_recompiles), so no
    other runner's graph can match."""
    return [entry.name in STEP_ARGUMENTS or entry.name == "" for entry in entries]


class CompiledDecodeSteps:
    """Decode-only steps of `runner.model` through a compiled forward per padded batch size.

    runner: the ModelRunner (its model, kv_caches, block_size, max_model_len); max_num_seqs: the largest
    batch to serve (the last size covers it). compile_fn: torch.compile's stand-in (tests pass one
    that fails). `failed` turns True after a failure; the runner then decodes eagerly.
    """

    def __init__(self, runner, max_num_seqs: int, compile_fn=torch.compile):
        self.runner = runner
        self.sizes = graph_batch_sizes(max_num_seqs)
        cpu = torch.device("cpu")
        with torch.inference_mode(False):  # ordinary tensors: the graph reads them outside inference mode
            self.buffers = DecodeBuffers(
                self.sizes[-1], runner.max_model_len, runner.block_size, cpu, runner.exact_kv
            )
        if any(t.is_inference() for layer in runner.kv_caches for t in layer[:2]):
            raise ValueError(
                "CompiledDecodeSteps: the KV caches were allocated in inference mode; the compiled step "
                "writes them in place outside it (allocate them outside torch.inference_mode)"
            )
        self.compiled_sizes: set[int] = set()
        self.failed = False
        _lower_runtime_packed_linear()
        paged_decode_native.load()  # built or loaded here, eagerly: tracing only asks whether it is ready
        # the model's forward without its torch.inference_mode decorator (see the module docstring;
        # the models decorate forward with nothing else), looked up here: dynamo does not trace
        # inspect.unwrap reliably (class dict mappingproxies)
        self._model_forward = inspect.unwrap(type(runner.model).forward)
        # The LM head in the same graph, unless it gathers vocabulary slices across ranks: no Python
        # call and no graph call of its own (SmolLM2, int4_bf16 body with an int8_blocks head, batch 1,
        # 2 threads: ~0.2 ms a step of the eager call between the two graphs).
        head = getattr(runner.model, "lm_head", None)
        self.logits_in_graph = head is not None and getattr(head, "tp_group", None) is None
        self._compute_logits = inspect.unwrap(type(runner.model).compute_logits)
        # one compiled callable: dynamo compiles it again for each batch size (static shapes)
        self._forward = compile_fn(
            self._decode_forward,
            dynamic=False,
            fullgraph=True,
            # per size: one graph, and a second once a context passes the in-graph attention's limit
            recompile_limit=max(8, 2 * len(self.sizes)),
            isolate_recompiles=True,
            options={**INDUCTOR_OPTIONS, **isa_options(), "guard_filter_fn": _argument_guards_only},
        )

    def _decode_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        exact_slot_mapping: torch.Tensor | None = None,
        exact_block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=1,
            max_seqlen_k=self.runner.max_model_len,  # a constant, as in the CUDA graphs
            decode_only=True,
            exact_block_tables=exact_block_tables,
            exact_slot_mapping=exact_slot_mapping,
            exact_window=self.buffers.exact_window,
        )
        hidden = self._model_forward(self.runner.model, input_ids, positions, self.runner.kv_caches, metadata)
        return self._compute_logits(self.runner.model, hidden) if self.logits_in_graph else hidden

    def fits(self, num_seqs: int) -> bool:
        return not self.failed and num_seqs <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """For a decode-only step of n <= sizes[-1] sequences: float32 logits [n, vocab_size] when
        `logits_in_graph`, else hidden [n, hidden_size]; None when the compiled step failed
        (recorded; the caller runs this step eagerly). Call inside kiln.ops.trusted_inputs() and
        inference mode, as the eager forward."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        buffers = self.buffers
        buffers.fill(input_ids, positions, metadata, bs)
        # the block table cut to the longest context (at least 2 blocks: dynamo specializes a dynamic
        # dimension of size 1), its width dynamic, so context growth never recompiles
        capacity = buffers.block_tables.shape[1]
        width = min(capacity, max(2, -(-metadata.max_seqlen_k // self.runner.block_size)))
        exact_args = ()
        if buffers.exact_block_tables is not None:
            exact_args = (buffers.exact_slot_mapping[:bs], buffers.exact_block_tables[:bs])
        try:
            # outside inference mode: the graph's inputs (the table's copy included) are ordinary tensors
            with torch.inference_mode(False), torch.no_grad():
                # contiguous: a view's row stride changes when the width reaches capacity (a recompile)
                block_tables = buffers.block_tables[:bs, :width].contiguous()
                if width > 1:
                    # maybe_: a guard may pin the width (IN_GRAPH_MAX_CONTEXT of 2 blocks), no error
                    torch._dynamo.maybe_mark_dynamic(block_tables, 1)
                out = self._forward(
                    buffers.input_ids[:bs],
                    buffers.positions[:bs],
                    buffers.slot_mapping[:bs],
                    block_tables,
                    buffers.seq_lens[:bs],
                    buffers.cu_seqlens_q[: bs + 1],
                    *exact_args,
                )
        except Exception as exc:  # compile errors surface on a size's first call
            self.failed = True
            detail = f"CompiledDecodeSteps(batch size {bs}): {exc!r}"
            fallbacks.record(CPU_COMPILE_TO_EAGER, detail[:2000])
            logger.warning("compiled CPU decode step failed (%s); decoding eagerly", detail[:500])
            return None
        self.compiled_sizes.add(bs)
        return out[:n]
