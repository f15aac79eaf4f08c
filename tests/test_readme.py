"""The README is a front door: short, its links resolve, and every `make` command it shows runs.

Each Makefile target the README names is run here as the README gives it, with tiny settings
through the same variables a user sets (ARGS, NPROC, OUTPUT_DIR); `make test` (this suite) and
`make diffs` (it rewrites tracked files) only as a dry run of their recipes.
"""

import re
import sys

import pytest
from helpers import ROOT, make

README = (ROOT / "README.md").read_text()
TINY_DATA = "--dataset synthetic --synthetic-train-size 256 --synthetic-test-size 64 --model resnet20"
# target: (make variables, None for a dry run, or "elsewhere"; a path the run must leave, under the test's folder)
RUNS = {
    "demo": ({"ARGS": f"{TINY_DATA} --epochs 1 --max-steps 2 --report-to none --output-dir {{tmp}}/demo"},
             "demo/model.safetensors"),
    "ddp": ("elsewhere", None),  # tests/test_make_restart.py: a worker killed under `make ddp`, the job restarted
    "bench": ("elsewhere", None),  # tests/test_benchmark.py runs its benchmark through `make bench`
    "gpu-check": ("elsewhere", None),  # tests/test_gpu.py: its one line without a GPU, all of it on GPUs
    "test": (None, None),
    "diffs": (None, None),
}


def code_in(markdown: str) -> str:
    """The text of fenced blocks, indented blocks and `inline code`: where commands are shown."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)
    indented = re.findall(r"^(?: {4}|\t)(.*)$", markdown, flags=re.MULTILINE)
    inline = re.findall(r"`([^`\n]+)`", markdown)
    return "\n".join(fenced + indented + inline)


def make_targets_named(markdown: str) -> set[str]:
    return set(re.findall(r"(?:^|[\s;&|(])make ([a-z][\w-]*)", code_in(markdown), flags=re.MULTILINE))


def test_readme_is_read_in_five_minutes():
    assert len(README.splitlines()) <= 300, f"README.md has {len(README.splitlines())} lines; move detail to docs/"
    first_screen = "\n".join(README.splitlines()[:60])
    for must in ("make demo", "make test", "docs/diffs/train_ddp.diff", "train_single.py", "train_ddp.py"):
        assert must in first_screen, f"the README's first screen lacks {must}"


def test_links_resolve():
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if not re.match(r"[a-z]+://|mailto:", target):
                assert (document.parent / target).exists(), f"{document.name} links to {target}, which does not exist"


def test_every_make_command_of_the_readme_is_run_here():
    named = make_targets_named(README)
    assert {"demo", "test"} <= named
    assert named <= set(RUNS), f"README.md shows make {sorted(named - set(RUNS))}: add a tiny run to RUNS"
    assert make_targets_named("    make bench ARGS=...\n`make demo` and make sure") == {"bench", "demo"}


@pytest.mark.parametrize("target", [target for target, (variables, _) in RUNS.items() if variables != "elsewhere"])
def test_make_target_runs(target, tmp_path):
    variables, leaves = RUNS[target]
    done = make(target, *[f"{name}={value.format(tmp=tmp_path)}" for name, value in (variables or {}).items()],
                cwd=tmp_path, dry_run=variables is None)
    if leaves:
        assert (tmp_path / leaves).is_file(), done.stdout[-3000:]
    else:
        assert f"{sys.prefix}/bin/python" in done.stdout  # the recipe, printed, runs this suite's Python
