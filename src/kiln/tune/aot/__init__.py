"""Ahead-of-time compile sweep for sm_90 (H100) without a GPU: `kiln tune aot` / `python -m kiln.tune.aot`.

record.py records the Triton launches Kiln's launchers make and compiles each one (`record_launches`,
`compile_spec`); sweep.py drives every op's Triton implementations through them and is the CLI.
"""

from kiln.tune.aot.record import CompileResult, LaunchRecorder, LaunchSpec, compile_spec, record_launches

__all__ = ["CompileResult", "LaunchRecorder", "LaunchSpec", "compile_spec", "record_launches"]
