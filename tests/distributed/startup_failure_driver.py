"""Run by test_tp_failures.py as a script: `python startup_failure_driver.py CHECKPOINT HOW PP_SIZE`
starts a 2-rank engine (TP 2, or PP 2 when PP_SIZE is 2) whose spawned worker dies during start-up,
and prints how the engine failed and after how long.

A spawned worker runs this file as __mp_main__ before its entry point, which is where it dies:
HOW "import": at once, before joining the group (exit code 7), as when its imports fail or its GPU
is missing; "load": while loading its shard, after joining (exit code 9), as when it is OOM-killed.
"""

import os
import sys
import time

if __name__ == "__mp_main__":  # in the spawned worker only
    if sys.argv[2] == "import":
        os._exit(7)
    import kiln.distributed.worker

    def dying_load(*args, **kwargs):
        os._exit(9)

    kiln.distributed.worker.load_shard = dying_load

if __name__ == "__main__":
    from kiln.distributed import TensorParallelEngine
    from kiln.engine.config import EngineConfig

    pp_size = int(sys.argv[3])
    config = EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=16)
    start = time.monotonic()
    try:
        TensorParallelEngine(
            config, tp_size=2 // pp_size, pp_size=pp_size, timeout_s=10, startup_timeout_s=30
        )
    except Exception as exc:
        print(f"FAILED after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
