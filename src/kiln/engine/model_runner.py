"""ModelRunner: turns a scheduled batch into one flat model call and samples the next tokens.

All tokens of a step go through the model as one flat batch (no padding between sequences), laid
out sequence by sequence and described by one AttentionMetadata. Logits are computed only for the
last scheduled token of each sequence whose prefill is complete with this step, and, for a sequence
verifying k proposed tokens (speculative decoding: its last token plus the k proposals are the
step's k + 1 queries, attending over its paged cache like a prefill chunk), for all k + 1 of them.
On CUDA, decode-only steps replay CUDA graphs captured for padded batch sizes 1, 2, 4, 8, 16, 32, 64, ...
On the CPU with compile_cpu_decode, they run a forward compiled per the same padded sizes
(kiln.engine.cpu_compiled_step), except one-sequence steps that the native one-call decode takes
(kiln.models.cpu_flat_decode: the same kernels, faster without the graph's per-call work). Each
step's phases are timed into `step_times` (kiln.engine.step_times).

One step: prepare (batch -> ModelInputs) -> before_forward hook (tensor parallelism: rank 0
broadcasts the inputs to the other ranks, which run `execute` on them) -> execute (forward and the
sampled rows' logits) -> sample. `run` does it all; `start` (up to launching the forward) and `finish`
(collecting the logits and sampling) let a pipeline keep several steps in flight. The model runs
inside `kiln.ops.trusted_inputs()`: its ops' arguments are built here and by the model, so the public
ops skip re-validating them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

import kiln.ops
from kiln.engine.exact_kv import (
    ExactKVLayout,
    allocate_exact_caches,
    copy_exact_fill,
    exact_block_table_row,
    exact_slots_for,
)
from kiln.engine.host_upload import upload
from kiln.engine.sampler import Sampler, prompt_token_logprobs
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.speculative.verify import verify_proposals
from kiln.engine.step_times import StepTimes
from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.cpu_flat_decode import FlatDecodeLayers
from kiln.models.layer_kv_cache import LayerKVCache
from kiln.ops.attention.paged_decode_attention import cpu_native as paged_decode_native
from kiln.ops.attention.validate import FP8_DTYPES

logger = logging.getLogger(__name__)


@dataclass
class LogitRows:
    """Whose rows of a step's logits are which (rows in ModelInputs.sample_rows order).

    seqs: the sequences that sample, in order; starts[i]: the logits row of seqs[i]'s first sampling
    row (a sequence with proposals owns 1 + len(spec_token_ids) consecutive rows). prompt: per
    sequence taking prompt logprobs this step, (seq, first position, first logits row, count): row
    first_row + j holds the logits at position first + j, which score prompt token first + j + 1.
    """

    seqs: list = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    prompt: list[tuple] = field(default_factory=list)


@dataclass
class StartedStep:
    """A step between ModelRunner.start and .finish: its batch, whose logits rows are which, the
    runner's handle on the forward in flight, and when it was launched (perf_counter)."""

    batch: ScheduledBatch
    rows: LogitRows
    handle: object
    launched: float


@dataclass
class ModelInputs:
    """One step's flat batch, all a rank needs to run its model.

    input_ids, positions: int64 [T]; attn_metadata: the batch layout; sample_rows: the rows of the T
    tokens whose logits are wanted, ascending (the last token of each sequence that samples this
    step; every token of a sequence that verifies proposals; the prompt positions of a sequence
    taking prompt logprobs). exact_fill: int64 [2, n], fp8 slots (row 0) to copy
    into exact slots (row 1) in every layer before the step runs (kiln.engine.exact_kv), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: list[int]
    exact_fill: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ModelInputs:
        """The same inputs with every tensor on `device` (self when they are there already)."""
        if self.input_ids.device == torch.device(device):
            return self
        metadata = self.attn_metadata
        moved = {
            f.name: getattr(metadata, f.name).to(device)
            for f in dataclasses.fields(metadata)
            if isinstance(getattr(metadata, f.name), torch.Tensor)
        }
        return ModelInputs(
            self.input_ids.to(device),
            self.positions.to(device),
            dataclasses.replace(metadata, **moved),
            self.sample_rows,
            None if self.exact_fill is None else self.exact_fill.to(device),
        )


def allocate_layer_kv_cache(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    calibration: tuple | None = None,
    exact_kv: ExactKVLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | LayerKVCache:
    """One layer's cache: (key_cache, value_cache) of `shape` [num_blocks, block_size, num_kv_heads,
    head_dim]; for an fp8 dtype a LayerKVCache of those plus k_scale and v_scale float32
    [num_kv_heads] (ones, or with `calibration`, one layer of kiln.engine.kv_scales.engine_kv_calibration:
    its scales and the key shift float32 [num_kv_heads, head_dim] or None) and, with `exact_kv`, its
    exact caches."""
    # zeros, not empty: masked-out lanes of a partly filled block must not hold NaN bit patterns
    caches = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
    if dtype not in FP8_DTYPES:
        return caches
    if calibration is not None:  # copies: calibration may have made them in inference mode
        scales = tuple(
            None if t is None else t.to(device=device, dtype=torch.float32).clone() for t in calibration
        )
    else:
        num_kv_heads = shape[2]
        ones = (torch.ones(num_kv_heads, dtype=torch.float32, device=device) for _ in range(2))
        scales = (*ones, None)
    exact = (None, None)
    if exact_kv is not None:
        exact = allocate_exact_caches(exact_kv, *shape[1:], device)
    return LayerKVCache(*caches, *scales, *exact)


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler.

    kv_caches: per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    of kv_cache_dtype (None = model.kv_cache_dtype) on the model's device; an fp8 cache's layers are
    (key_cache, value_cache, k_scale, v_scale[, k_shift]), the scales float32 [num_kv_heads]: 1.0, or
    with `kv_calibration` (per layer (k_scale, v_scale, k_shift or None), see kiln.engine.kv_scales) the
    measured or the checkpoint's ones and the keys' shift (EngineConfig.kv_cache_scales).
    before_forward: called with each step's ModelInputs before the model runs (rank 0 of a
    tensor-parallel group broadcasts them there).
    """

    def __init__(
        self,
        model,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool = False,
        seed: int = 0,
        before_forward: Callable[[ModelInputs], None] | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        compile_cpu_decode: bool = False,
        kv_calibration: list[tuple[torch.Tensor, ...]] | None = None,
        exact_kv: ExactKVLayout | None = None,
    ):
        self.model = model
        self.before_forward = before_forward
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache_dtype = dtype = kv_cache_dtype or model.kv_cache_dtype
        self.num_blocks = num_blocks
        if kv_calibration is not None and len(kv_calibration) != cfg.num_layers:
            raise ValueError(
                f"ModelRunner: kv_calibration has {len(kv_calibration)} layers, the model {cfg.num_layers}"
            )
        self.kv_scales_description = "scales 1.0"  # (a 16-bit cache has none)
        if kv_calibration is not None:  # engine_kv_calibration shifts keys with its own scales only
            shifted = kv_calibration[0][2] is not None
            self.kv_scales_description = "calibrated scales, centred keys" if shifted else "checkpoint scales"
        if exact_kv is not None and dtype not in FP8_DTYPES:
            raise ValueError(f"ModelRunner: exact positions are for an fp8 cache, not {dtype}")
        self.exact_kv = exact_kv
        # ordinary tensors even when the engine is built inside inference mode: the compiled CPU
        # decode step writes them in place from a graph run outside it (kiln.engine.cpu_compiled_step)
        with torch.inference_mode(False):
            self.kv_caches = [
                allocate_layer_kv_cache(
                    shape, dtype, device, kv_calibration[i] if kv_calibration else None, exact_kv
                )
                for i in range(cfg.num_layers)
            ]
        logger.info("KV cache: %s", self.kv_cache_description())
        self.sampler = Sampler(device, seed)
        self.pack_uploads = device.type == "cuda"  # a step's inputs in one pinned copy (host_upload)
        self.step_times = StepTimes()  # prepare / forward / sample; the engine adds its phases
        # on CUDA the forward only launches: with this set (a profile's timed steps), finish waits for
        # the GPU before it reads the clock, so "forward" holds the GPU's time and "sample" does not
        self.synchronize_phases = False
        self.graphs = None
        self.flat_decode = None  # CPU: kiln.models.cpu_flat_decode over this runner's caches
        if device.type == "cuda" and not enforce_eager:
            from kiln.engine.cuda_graphs import DecodeGraphs

            try:
                with kiln.ops.trusted_inputs():  # capture the same calls the eager steps make
                    self.graphs = DecodeGraphs(self, max_num_seqs)
            except Exception as exc:  # capture needs every op to be graph-safe; eager still works
                logger.warning("CUDA graph capture failed (%s); running eagerly", exc)
                self.graphs = None
        if device.type == "cpu":
            # built (a host's first run, ~30-60 s) or loaded here, so that no step's time includes it
            paged_decode_native.load()
            if hasattr(model, "flat_decode"):  # one-token eager steps as one loop over the kernels
                self.flat_decode = model.flat_decode = FlatDecodeLayers.build(model, self.kv_caches)
        self.compiled_decode = None  # CPU: decode steps through a compiled forward per batch size
        if device.type == "cpu" and compile_cpu_decode and not enforce_eager:
            from kiln.engine.cpu_compiled_step import CompiledDecodeSteps

            self.compiled_decode = CompiledDecodeSteps(self, max_num_seqs)

    def kv_cache_description(self) -> str:
        """One line for the start-up log: blocks, tokens, dtype and bytes of the KV cache."""
        nbytes = sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer if t is not None)
        dtype = str(self.kv_cache_dtype).removeprefix("torch.")
        if self.kv_cache_dtype in FP8_DTYPES:
            dtype += f" ({self.kv_scales_description})"
        if self.exact_kv is not None:
            layout = self.exact_kv
            dtype += (
                f", first block and last {layout.window} positions exact (float16, {layout.num_blocks} "
                f"exact blocks, rings of {layout.ring_blocks})"
            )
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens, {dtype}, "
            f"{nbytes / (1 << 20):.1f} MiB over {len(self.kv_caches)} layers"
        )

    def prepare(self, batch: ScheduledBatch) -> tuple[ModelInputs, LogitRows]:
        """Flatten the batch: its ModelInputs, and whose rows of the logits are which (LogitRows)."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        cu_seqlens_q = [0]
        sample_rows: list[int] = []
        rows = LogitRows()
        exact = self.exact_kv
        exact_slot_mapping: list[int] = []
        exact_fill: list[tuple[int, int]] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            if exact is not None:
                exact_slot_mapping += exact_slots_for(seq, start, end, size, exact.ring_blocks)
                exact_fill += seq.exact_fill
                seq.exact_fill = []
            table = seq.block_table
            spec = seq.spec_token_ids
            if spec:  # verify: the last token, then the proposals (n == 1 + len(spec))
                input_ids.append(seq.token_ids[start])
                input_ids.extend(spec)
                positions.extend(range(start, end))
                slot_mapping.extend(table[p // size] * size + p % size for p in range(start, end))
            elif n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // size] * size + start % size)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                for b in range(start // size, (end - 1) // size + 1):
                    base = table[b] * size - b * size  # slot of position p in block b is base + p
                    slot_mapping.extend(range(base + max(start, b * size), base + min(end, (b + 1) * size)))
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            if seq.prompt_logprobs_pending:  # positions first.. score prompt tokens first + 1..
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    rows.prompt.append((seq, first, len(sample_rows), last - first))
                    offset = cu_seqlens_q[-2] - start
                    sample_rows.extend(range(offset + first, offset + last))
            if spec:
                rows.seqs.append(seq)
                rows.starts.append(len(sample_rows))
                sample_rows.extend(range(cu_seqlens_q[-2], cu_seqlens_q[-1]))
            elif end == seq.num_tokens:
                rows.seqs.append(seq)
                rows.starts.append(len(sample_rows))
                sample_rows.append(cu_seqlens_q[-1] - 1)
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = np.zeros((len(batch.seqs), width), dtype=np.int32)
        for row, seq in zip(block_tables, batch.seqs, strict=True):  # numpy reads each list in C
            row[: len(seq.block_table)] = seq.block_table
        arrays = [
            np.array(slot_mapping, dtype=np.int64),
            block_tables,
            np.array(seq_lens, dtype=np.int32),
            np.array(cu_seqlens_q, dtype=np.int32),
            np.array(input_ids, dtype=np.int64),
            np.array(positions, dtype=np.int64),
        ]
        if exact is not None:
            arrays.append(np.array([exact_block_table_row(seq) for seq in batch.seqs], dtype=np.int32))
            arrays.append(np.array(exact_slot_mapping, dtype=np.int64))
            if exact_fill:
                arrays.append(np.array(exact_fill, dtype=np.int64).T)
        sent = upload(self.device, arrays, self.pack_uploads)
        metadata = AttentionMetadata(
            slot_mapping=sent[0],
            block_tables=sent[1],
            seq_lens=sent[2],
            cu_seqlens_q=sent[3],
            max_seqlen_q=max(batch.num_tokens),
            max_seqlen_k=max(seq_lens),
            decode_only=all(n == 1 for n in batch.num_tokens),
        )
        ids, pos = sent[4], sent[5]
        fill = None
        if exact is not None:
            metadata.exact_block_tables, metadata.exact_slot_mapping = sent[6], sent[7]
            metadata.exact_window = exact.window
            if exact_fill:
                fill = sent[8]
        return ModelInputs(ids, pos, metadata, sample_rows, fill), rows

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Run the model on one step's inputs: float32 logits [len(sample_rows), vocab] (under tensor
        parallelism, on rank 0), or None when no row samples. Every rank of a group calls it."""
        metadata = inputs.attn_metadata
        if inputs.exact_fill is not None:
            copy_exact_fill(self.kv_caches, inputs.exact_fill[0], inputs.exact_fill[1])
        flat = getattr(self.model, "flat_decode", None)
        if flat is not None and flat.kv_caches is not self.kv_caches and self.flat_decode is not None:
            # another engine on the same model (a second LLM, a draft that is the target) set its own
            self.model.flat_decode = self.flat_decode
        with kiln.ops.trusted_inputs():
            hidden = logits = None
            if self.graphs is not None and metadata.decode_only and self.graphs.fits(metadata.num_seqs):
                hidden = self.graphs.run(inputs.input_ids, inputs.positions, metadata)
            compiled = self.compiled_decode
            if (
                compiled is not None
                and metadata.decode_only
                and compiled.fits(metadata.num_seqs)
                and not self._one_row_native(metadata)
            ):
                out = compiled.run(inputs.input_ids, inputs.positions, metadata)  # None: it failed
                if compiled.logits_in_graph:
                    logits = out
                else:
                    hidden = out
            if hidden is None and logits is None:
                hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, metadata)
            if not inputs.sample_rows:
                return None
            rows = logits if logits is not None else hidden
            if len(inputs.sample_rows) != rows.shape[0]:
                rows = rows[torch.tensor(inputs.sample_rows, device=rows.device)]
            return rows if logits is not None else self.model.compute_logits(rows)

    def _one_row_native(self, metadata) -> bool:
        """Whether a one-sequence decode step goes to the native one-call decode
        (kiln.models.cpu_flat_decode) rather than the compiled step: the same kernels without the
        graph's per-call work (SmolLM2 Q4_1 on a 2-core Zen 5: 3.46 against 4.21 ms a step, and
        3.52 against 4.26 with cpu_format q4_blocks_w8a8)."""
        flat = getattr(self.model, "flat_decode", None)
        return (
            metadata.num_seqs == 1
            and flat is not None
            and flat.native is not None
            and flat.takes(1, self.kv_caches, metadata)
        )

    @torch.inference_mode()
    def launch(self, inputs: ModelInputs):
        """Start the forward of one step; `collect` returns its logits. Here it runs to the end (the
        handle is the logits); a pipeline stage returns while later stages still compute."""
        return self.execute(inputs)

    def collect(self, handle) -> torch.Tensor | None:
        """The logits of a launched step (see execute)."""
        return handle

    def run(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """One model step. Returns, per scheduled seq, its new tokens ([] while its prefill is still
        incomplete; a verifying seq's accepted proposals and then one more token) and their logprobs
        entries (None unless requested)."""
        return self.finish(self.start(batch))

    def start(self, batch: ScheduledBatch) -> StartedStep:
        """The first half of `run`: prepare the batch, hand it to before_forward, launch the forward."""
        start = time.perf_counter()
        inputs, rows = self.prepare(batch)
        if self.before_forward is not None:
            self.before_forward(inputs)
        prepared = time.perf_counter()
        self.step_times.add("prepare", prepared - start)
        return StartedStep(batch, rows, self.launch(inputs), prepared)

    def finish(self, started: StartedStep) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """The second half of `run`: collect the step's logits and sample (see run)."""
        batch, sample_seqs, starts = started.batch, started.rows.seqs, started.rows.starts
        logits = self.collect(started.handle)
        if self.synchronize_phases and logits is not None and logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        executed = time.perf_counter()
        self.step_times.add("forward", executed - started.launched)
        tokens: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[dict[int, float]] | None] = [None] * len(batch)
        if logits is None:
            return tokens, logprobs
        # check every request's seed before anything is drawn (SamplingError leaves all untouched)
        self.sampler.check_seeds(sample_seqs)
        for seq, first, row, count in started.rows.prompt:
            seq.prompt_logprobs.extend(
                prompt_token_logprobs(
                    logits[row : row + count],
                    seq.token_ids[first + 1 : first + 1 + count],
                    seq.params.prompt_logprobs,
                )
            )
        where = {id(seq): i for i, seq in enumerate(batch.seqs)}
        plain = [i for i, seq in enumerate(sample_seqs) if not seq.spec_token_ids]
        if plain:
            plain_seqs = [sample_seqs[i] for i in plain]
            plain_logits = logits if len(plain) == len(logits) else logits[[starts[i] for i in plain]]
            sampled, sampled_logprobs = self.sampler(plain_logits, plain_seqs)
            for seq, token, lp in zip(plain_seqs, sampled, sampled_logprobs, strict=True):
                tokens[where[id(seq)]] = [token]
                logprobs[where[id(seq)]] = None if lp is None else [lp]
        if len(plain) < len(sample_seqs):
            spec = [i for i in range(len(sample_seqs)) if sample_seqs[i].spec_token_ids]
            spec_seqs = [sample_seqs[i] for i in spec]
            spec_logits = [
                logits[starts[i] : starts[i] + 1 + len(sample_seqs[i].spec_token_ids)] for i in spec
            ]
            emitted, emitted_logprobs = verify_proposals(self.sampler, spec_logits, spec_seqs)
            for seq, new, lp in zip(spec_seqs, emitted, emitted_logprobs, strict=True):
                tokens[where[id(seq)]] = new
                logprobs[where[id(seq)]] = lp
        # on CUDA: includes waiting for the forward
        self.step_times.add("sample", time.perf_counter() - executed)
        return tokens, logprobs
