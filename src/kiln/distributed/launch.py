"""One entry for `--tp N` command lines, however the processes were started.

  engine = start_engine(EngineConfig(...), tp_size)
  if engine is None:      # a torchrun rank > 0: it served rank 0 until rank 0 stopped
      return 0

- plain process:  this process becomes rank 0 and spawns ranks 1..N-1 on this machine;
- under torchrun: every rank runs the same command; RANK 0 drives the engine, the others serve it
  (rendezvous from MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK, WORLD_SIZE == N).
"""

from __future__ import annotations

import os

from kiln.distributed.groups import DEFAULT_TIMEOUT_S, launched_by_torchrun


def start_engine(config, tp_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A TensorParallelEngine on rank 0; None on a torchrun rank > 0 once rank 0 has stopped."""
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        from kiln.distributed.worker import torchrun_main

        if int(os.environ["WORLD_SIZE"]) != tp_size:
            raise ValueError(
                f"--tp {tp_size} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes; "
                "make them equal (torchrun --nnodes * --nproc-per-node == --tp)"
            )
        torchrun_main(timeout_s)
        return None
    from kiln.distributed.engine import TensorParallelEngine

    return TensorParallelEngine(config, tp_size, timeout_s=timeout_s)
