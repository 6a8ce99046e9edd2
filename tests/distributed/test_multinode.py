"""Multi-node for real: two `torchrun` launches on this machine act as two nodes (--nnodes 2, distinct
--node-rank, one rendezvous endpoint on 127.0.0.1), each with one process, running the README's
multi-node command (read from README.md, so the documented command is the tested one) with --pp 2;
node 0's rank 0 prints the same completion as one process."""

import os
import re
import shlex
import shutil
import subprocess

from kiln.distributed.groups import free_port
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from tests.distributed.checkpoints import write_checkpoint

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def readme_multinode_command() -> str:
    """The README's two-node command (one line of a bash block, continuation lines joined)."""
    text = open(README).read().replace("\\\n", " ")
    lines = [
        line
        for line in text.splitlines()
        if line.lstrip().startswith("torchrun --nnodes 2 --nproc-per-node 1")
    ]
    assert len(lines) == 1, "README.md must show exactly one `torchrun --nnodes 2 --nproc-per-node 1` command"
    return re.sub(r"\s+#.*$", "", lines[0].strip())


def test_two_torchrun_nodes_on_loopback_print_the_one_process_completion(tmp_path):
    path = write_checkpoint(tmp_path, "llama", seed=3)
    command = readme_multinode_command()
    prompt = shlex.split(command)[-1]
    single = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=16))
    max_tokens = int(re.search(r"--max-tokens (\d+)", command).group(1))
    single.add_request(
        "r", single.tokenizer.encode(prompt, add_special_tokens=True),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    while single.has_unfinished_requests():
        for out in single.step():
            expected = out.text
    assert len(expected.split()) == max_tokens  # word-level tokenizer: one word a token
    assert shutil.which("torchrun") and shutil.which("kiln"), "torchrun and kiln must be on PATH"
    command = command.replace("$HEAD_NODE", "127.0.0.1").replace("29500", str(free_port()))
    command = command.replace("$MODEL", shlex.quote(path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            shlex.split(command.replace("$NODE_RANK", str(rank))),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "2 pipeline stages" in results[0][1]  # rank 0 printed the layout
    text = results[0][0].split("\n--- TTFT")[0]
    assert text == expected
    assert results[1][0] == ""  # node 1's rank serves; it prints nothing
