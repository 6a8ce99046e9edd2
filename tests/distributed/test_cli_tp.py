"""`kiln generate --tp 2` (spawned worker, gloo) prints the same completion as `--tp 1`."""

import subprocess
import sys

from tests.distributed.checkpoints import write_checkpoint


def _generate(path: str, tp: int) -> str:
    command = [sys.executable, "-m", "kiln.cli", "generate", "t5 t77 t3 t101", "--model", path]
    command += ["--device", "cpu", "--max-tokens", "6", "--ignore-eos", "--tp", str(tp)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    text, stats = result.stdout.rsplit("\n--- ", 1)
    assert "6 tokens generated" in stats
    return text


def test_kiln_generate_tp2_prints_the_tp1_completion(tmp_path):
    path = write_checkpoint(tmp_path, "qwen2", seed=5)
    expected = _generate(path, 1)
    assert expected.strip()
    assert _generate(path, 2) == expected
