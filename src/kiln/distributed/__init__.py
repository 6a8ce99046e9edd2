"""Tensor parallelism over torch.distributed: process groups (groups.py), rank 0's control messages
(collectives.py), workers (worker.py), rank 0's engine (engine.py) and the one launch entry for
command lines (launch.py). How a model is split and the layers that communicate are kiln.models'
(kiln.models.sharding, kiln.models.layers.tp); every rank loads its shard with kiln.loaders.load_model.

    from kiln.distributed import TensorParallelEngine
    with TensorParallelEngine(EngineConfig(model=None), tp_size=2) as engine: ...
"""

from kiln.distributed.groups import TensorParallelError, launched_by_torchrun
from kiln.models.layers.tp import TPGroup

__all__ = ["TPGroup", "TensorParallelEngine", "TensorParallelError", "launched_by_torchrun"]


def __getattr__(name):
    # the engine pulls in the model and engine packages; import it only when asked for
    if name == "TensorParallelEngine":
        from kiln.distributed.engine import TensorParallelEngine

        return TensorParallelEngine
    raise AttributeError(name)
