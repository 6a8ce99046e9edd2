"""One entry for `--tp N` / `--ep N` / `--pp N` command lines, however the processes were started.

  engine = start_engine(EngineConfig(...), tp_size, ep_size=ep_size, pp_size=pp_size)
  if engine is None:      # a torchrun rank > 0: it served rank 0 until rank 0 stopped
      return 0

- plain process:  this process becomes rank 0 and spawns ranks 1..N-1 on this machine;
- under torchrun: every rank runs the same command; RANK 0 drives the engine, the others serve it
  (rendezvous from MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK, WORLD_SIZE == N).
N = parallel_ranks(tp, ep): `--ep N` alone runs N ranks, tensor-parallel everywhere but in the MoE
layers, whose experts are whole on each rank (docs/expert_parallel.md). `--tp T --pp P` runs T * P
ranks: P pipeline stages of T tensor-parallel ranks each (docs/pipeline_parallel.md).
"""

from __future__ import annotations

import os

from kiln.distributed.groups import DEFAULT_TIMEOUT_S, launched_by_torchrun


def parallel_ranks(tp_size: int, ep_size: int = 1, pp_size: int = 1) -> int:
    """How many ranks `--tp tp_size --ep ep_size` runs: tp_size, or ep_size when expert parallel (then
    tp_size must be 1 or equal: the MoE layers' experts and the other layers' tensor-parallel slices
    live on the same ranks). ValueError otherwise."""
    if tp_size < 1 or ep_size < 1 or pp_size < 1:
        raise ValueError(f"--tp {tp_size} --ep {ep_size} --pp {pp_size}: all must be >= 1")
    if pp_size > 1 and ep_size > 1:
        raise ValueError(
            f"--ep {ep_size} --pp {pp_size}: expert parallelism under pipeline parallelism is not supported"
        )
    if pp_size > 1:
        return tp_size * pp_size
    if ep_size > 1 and tp_size not in (1, ep_size):
        raise ValueError(
            f"--tp {tp_size} --ep {ep_size}: expert parallelism runs over the tensor-parallel ranks "
            f"(attention and dense layers split, experts whole), so give --ep {ep_size} alone or equal values"
        )
    return max(tp_size, ep_size)


def start_engine(
    config, tp_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, ep_size: int = 1, pp_size: int = 1,
    micro_batches: int | None = None, lanes: int | None = None,
):  # fmt: skip
    """A TensorParallelEngine on rank 0 over parallel_ranks(tp_size, ep_size, pp_size) ranks; None on a
    torchrun rank > 0 once rank 0 has stopped. micro_batches, lanes: see TensorParallelEngine."""
    ranks = parallel_ranks(tp_size, ep_size, pp_size)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        from kiln.distributed.worker import torchrun_main

        if int(os.environ["WORLD_SIZE"]) != ranks:
            raise ValueError(
                f"--tp {tp_size} --ep {ep_size} --pp {pp_size} needs {ranks} processes but torchrun started "
                f"WORLD_SIZE={os.environ['WORLD_SIZE']}; make them equal (torchrun --nnodes * "
                "--nproc-per-node == the rank count)"
            )
        torchrun_main(timeout_s, ep_size, pp_size)
        return None
    from kiln.distributed.engine import TensorParallelEngine

    return TensorParallelEngine(
        config, ranks // pp_size, timeout_s=timeout_s, ep_size=ep_size, pp_size=pp_size,
        micro_batches=micro_batches, lanes=lanes,
    )  # fmt: skip
