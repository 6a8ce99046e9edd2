"""Tensor parallelism over torch.distributed: process groups (groups.py), collectives with timeouts
(collectives.py), how a checkpoint is split (sharding.py), per-rank model build (model.py), workers
(worker.py) and rank 0's engine (engine.py).

    from kiln.distributed import TensorParallelEngine
    with TensorParallelEngine(EngineConfig(model=None), tp_size=2) as engine: ...
"""

from kiln.distributed.groups import TensorParallelError, TPGroup, launched_by_torchrun

__all__ = ["TPGroup", "TensorParallelEngine", "TensorParallelError", "launched_by_torchrun"]


def __getattr__(name):
    # the engine pulls in the model and engine packages; import it only when asked for
    if name == "TensorParallelEngine":
        from kiln.distributed.engine import TensorParallelEngine

        return TensorParallelEngine
    raise AttributeError(name)
