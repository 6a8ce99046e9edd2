"""The memory a model's linear weights take on the CPU in each weight format: for every format, one
fresh process loads the model (`load_model`, the format for the layers and the LM head) and reports
the bytes of its prepared linear weights (each tensor's storage, once), their layouts, the load time
and the process's peak RSS after loading.

    python scripts/cpu_weight_memory.py MODEL.gguf --formats q4_blocks,q4_blocks_a8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
from kiln.bench.engine import weight_layouts
from kiln.loaders import load_model

path, fmt = sys.argv[1], sys.argv[2]
start = time.perf_counter()
loaded = load_model(path, device="cpu", cpu_format=fmt, lm_head_format=fmt)
seconds = time.perf_counter() - start
kept = weight_layouts(loaded.model)  # the layers' layouts, the head's, and their bytes
layouts = dict(kept["layers"])
if kept["lm_head"] is not None:
    layouts[kept["lm_head"]] = layouts.get(kept["lm_head"], 0) + 1
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
print(json.dumps({"format": fmt, "weight_bytes": kept["bytes"], "peak_rss_bytes": peak,
                  "load_seconds": seconds, "layouts": layouts}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file or an HF directory")
    parser.add_argument("--formats", default="q4_blocks,q4_blocks_a8", help="comma-separated cpu formats")
    args = parser.parse_args()
    for fmt in args.formats.split(","):
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, fmt], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{fmt}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        row = json.loads(done.stdout.strip().splitlines()[-1])
        weights, peak = row["weight_bytes"] / 1e6, row["peak_rss_bytes"] / 1e6
        print(
            f"{fmt}: linear weights {weights:.1f} MB, peak RSS {peak:.0f} MB,"
            f" load {row['load_seconds']:.1f} s, layouts {row['layouts']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
