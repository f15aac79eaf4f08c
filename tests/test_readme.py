"""The README is a front door: short, its links resolve, and every `make` command it shows runs.

Each Makefile target the README names is run here as the README gives it, with tiny settings
through the same variables a user sets (ARGS, NPROC, OUTPUT_DIR); `make test` (this suite) and
`make diffs` (it rewrites tracked files) only as a dry run of their recipes. The defaults the
README and docs/usage.md's Flags state are the parser's, and the copy set's size is measured.
"""

import re
import sys

import pytest
import torch
from helpers import ROOT, make
from test_copy_set import copy_set

from common.cli import DEFAULT_LR, add_ddp_args, build_parser
from common.recipe.optim import build_optimizer, build_scheduler

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
    assert len(README.splitlines()) <= 200, f"README.md has {len(README.splitlines())} lines; move detail to docs/"
    first_screen = "\n".join(README.splitlines()[:60])
    for must in ("make demo", "make test", "docs/diffs/train_ddp.diff", "train_single.py", "train_ddp.py",
                 "pip install -r requirements.txt", "make gpu-check", "(docs/gpu/README.md)"):
        assert must in first_screen, f"the README's first screen lacks {must}"
    # The launch the project exists for, and its CPU stand-in, before a newcomer scrolls.
    top = "\n".join(README.splitlines()[:30])
    for must in ("accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/train_ddp.py\n",
                 "--num_processes 2 scripts/train_ddp.py", "--dataset synthetic --model resnet20"):
        assert must in top, f"the README's first 30 lines lack {must!r}"


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


# ----------------------------------------------------------------------------- stated defaults

# "`--flag` (VALUE" or "`--flag METAVAR` (VALUE": VALUE, up to the first , ; : or ), is the default.
STATED = re.compile(r"`(--[a-z][a-z0-9-]*)(?: [A-Z_]+)?` \(([^),;:]+)")
# "`--lr` (0.1 with `--optimizer sgd`, 0.001 with `--optimizer adamw`)"
LR_STATED = re.compile(r"`--lr` \(([^)]*)\)")


def usage_flags() -> str:
    """docs/usage.md's Flags section, where the flag list of `--help` is explained."""
    text = (ROOT / "docs" / "usage.md").read_text()
    assert "\n## Flags\n" in text, "docs/usage.md has no '## Flags' section"
    return text.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]


def shared_defaults() -> dict:
    """Each shared flag's default, as `--help` gives it (the DDP scripts' own flags included)."""
    parser = build_parser("")
    add_ddp_args(parser)
    return {flag: action.default for action in parser._actions for flag in action.option_strings}


def default_problems(markdown: str, where: str) -> tuple[list[str], set[str]]:
    """What ``markdown`` states as a default that the parser does not have, and the flags checked."""
    defaults, problems, checked = shared_defaults(), [], set()
    for flag, stated in STATED.findall(markdown):
        checked.add(flag)
        if flag not in defaults:
            problems.append(f"{where}: `{flag}` ({stated}...) is no shared flag")
            continue
        default, words = defaults[flag], stated.split()
        if flag == "--lr":
            per_optimizer = dict((name, float(value)) for value, name in re.findall(
                r"([\d.e+-]+) with `--optimizer (\w+)`", LR_STATED.search(markdown).group(1)))
            right = per_optimizer == DEFAULT_LR
            default = ", ".join(f"{lr:g} with `--optimizer {name}`" for name, lr in DEFAULT_LR.items())
        elif isinstance(default, list):
            right = words == [str(value) for value in default]
        elif words[0] in ("on", "off"):
            right = (words[0] == "on") == bool(default)
        elif isinstance(default, (int, float)):
            right = re.fullmatch(r"[\d.e+-]+", words[0]) is not None and float(words[0]) == default
        else:
            right = words[0] == str(default)
        if not right:
            problems.append(f"{where} states `{flag}` ({stated}); --help's default is {default}")
    return problems, checked


def test_the_defaults_the_readme_and_usage_state_are_the_parser_s():
    readme_problems, readme_flags = default_problems(README, "README.md")
    usage_problems, usage_checked = default_problems(usage_flags(), "docs/usage.md, Flags")
    assert not readme_problems + usage_problems, "\n".join(readme_problems + usage_problems)
    for flag in ("--lr", "--batch-size", "--epochs", "--schedule", "--warmup-epochs"):
        assert flag in readme_flags, f"README.md no longer states the default of {flag} as `{flag}` (VALUE)"
        assert flag in usage_checked, f"docs/usage.md's Flags no longer state the default of {flag}"


def test_the_default_check_catches_a_stale_default():
    # Negative controls: the lr stated as one number, an epoch count, a boolean and a list changed.
    for right, wrong in (("`--lr` (0.1 with `--optimizer sgd`, 0.001 with `--optimizer adamw`)", "`--lr` (0.1)"),
                         ("`--epochs` (15)", "`--epochs` (20)"), ("`--scale-lr` (on)", "`--scale-lr` (off)"),
                         ("`--schedule` (onecycle)", "`--schedule` (step)")):
        assert right in README, right
        problems, _ = default_problems(README.replace(right, wrong), "README.md")
        assert len(problems) == 1 and wrong.split()[0] in problems[0], problems
    problems, _ = default_problems("`--milestones` (4 9 14) and `--milestones` (4 9)", "x")
    assert problems == ["x states `--milestones` (4 9); --help's default is [4, 9, 14]"]


def test_the_default_schedule_warms_up_along_a_cosine_as_the_readme_says():
    assert "warms up along a cosine" in README
    defaults = build_parser("").parse_args([])
    optimizer = build_optimizer(torch.nn.Linear(1, 1), 1.0, defaults.momentum, defaults.weight_decay)
    steps_per_epoch = 20
    scheduler = build_scheduler(optimizer, defaults.schedule, steps_per_epoch * defaults.epochs,
                                steps_per_epoch, defaults.warmup_epochs, defaults.milestones)
    lrs = []
    for _ in range(steps_per_epoch * defaults.epochs):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    warmup = round(defaults.warmup_epochs * steps_per_epoch)
    rises = [b - a for a, b in zip(lrs[:warmup], lrs[1:warmup])]
    assert lrs[0] == pytest.approx(1 / 25) and max(lrs) == pytest.approx(1.0)
    # A cosine starts and ends slowly; a linear warm-up would rise by the same amount each step.
    assert rises[0] < 0.2 * max(rises) and rises[-1] < 0.2 * max(rises), rises
    assert lrs[-1] < 1e-4, "the one-cycle decay no longer ends near 0: update README.md and docs/usage.md"


# ----------------------------------------------------------------------------- the copy set's size

COPY_SET = re.compile(r"`train_ddp\.py` \((\d+) lines\) reaches (\d+) files of `common/`, about ([\d,]+) lines")


def test_the_copy_set_the_readme_gives_is_what_train_ddp_reaches():
    stated = COPY_SET.search(" ".join(README.split()))
    assert stated, "README.md no longer says '`train_ddp.py` (N lines) reaches M files of `common/`, about L lines'"
    script = ROOT / "scripts" / "train_ddp.py"
    files = copy_set(script)
    lines = sum(files.values())
    script_lines = len(script.read_text().splitlines())
    said = [int(group.replace(",", "")) for group in stated.groups()]
    measured = (f"train_ddp.py has {script_lines} lines and reaches {len(files)} files of common/, "
                f"{lines} lines: update README.md's 'Which file to copy'")
    assert said[1] == len(files), measured
    assert abs(said[0] - script_lines) <= 0.1 * script_lines and abs(said[2] - lines) <= 0.1 * lines, measured
