"""The plain-PyTorch DDP lesson of docs/strategies.md runs as printed: torchrun, 2 gloo processes.

The block is taken from the page as it stands and launched the way the page says, on the CPU; a
user relies on it ending cleanly on every process, with the same weights on every replica (what
DDP promises) and rank 0's file holding exactly those weights, loadable without DDP's prefix.
"""

import re
import subprocess
import sys
from pathlib import Path

import torch
from helpers import ROOT, user_env

PAGE = ROOT / "docs" / "strategies.md"
HEADING = "### The same lesson in plain PyTorch"


def lesson_code(markdown: str) -> str:
    """The first fenced python block after the lesson's heading."""
    assert HEADING in markdown, f"docs/strategies.md has no '{HEADING}' section"
    block = re.search(r"^```python\n(.*?)^```", markdown.split(HEADING, 1)[1], re.DOTALL | re.MULTILINE)
    assert block, f"docs/strategies.md: no ```python block under '{HEADING}'"
    return block.group(1)


def test_the_lesson_has_the_parts_it_teaches():
    code = lesson_code(PAGE.read_text())
    for part in ("init_process_group", "DistributedSampler", "DistributedDataParallel", "set_epoch",
                 "LOCAL_RANK", '"gloo"', '"nccl"', "rank == 0"):
        assert part in code, f"the plain-PyTorch DDP lesson no longer shows {part}"
    assert len(code.splitlines()) <= 70, "the lesson is meant to be read at a glance: about 60 lines"


def test_the_lesson_trains_two_gloo_processes_to_the_same_weights_and_rank_0_saves_them(tmp_path):
    (tmp_path / "ddp_plain.py").write_text(lesson_code(PAGE.read_text()))
    torchrun = Path(sys.executable).parent / "torchrun"
    # No GPU for the lesson even on a GPU machine: this test is about the CPU (gloo) path.
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "ddp_plain.py"],
                          cwd=tmp_path, env=user_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # Both processes write to torchrun's stdout: unbuffered (PYTHONUNBUFFERED), print's text and its
    # newline are two writes, and one process's line may land inside the other's.
    sums = dict(re.findall(r"rank (\d+): weights sum (-?\d+\.\d+(?:e[-+]\d+)?)", done.stdout))
    assert sorted(sums) == ["0", "1"], output[-3000:]
    assert sums["0"] == sums["1"], f"DDP's replicas differ at the end: {sums}"
    assert len(re.findall(r"epoch \d+: loss \d", done.stdout)) == 2, output[-3000:]
    state = torch.load(tmp_path / "ddp_plain.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state), sorted(state)
    # The parameters (weights and biases, in the model's order) are what every rank printed.
    saved = torch.cat([value.flatten() for key, value in state.items()
                       if key.endswith((".weight", ".bias"))])
    assert repr(saved.double().sum().item()) == sums["0"]
