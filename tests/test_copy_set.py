"""common/ is the copy set: what a person takes along with one training script, and nothing else.

At most 12 modules (the input path takes four: sources, per-sample decoding in workers, batches
on the device, and the choice between the two), every one of them used by the training scripts,
none reaching into bench/ (the benchmark's and the machine check's tools), and each script runs
with common/ alone beside it.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

TRAINING = ["train_single", "train_dp", "train_ddp", "train_amp"]


def imported_modules(path: Path) -> set[str]:
    """The project modules (common.*, bench.*) that a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in ("common", "bench")
                  and (ROOT / (name.replace(".", "/") + ".py")).is_file()}
    return found


def test_common_is_at_most_twelve_modules_all_used_by_the_training_scripts():
    modules = {f"common.{p.stem}" for p in (ROOT / "common").glob("*.py") if p.stem != "__init__"}
    assert len(modules) <= 12, sorted(modules)
    used, todo = set(), {m for s in TRAINING for m in imported_modules(ROOT / "scripts" / f"{s}.py")}
    while todo:  # what the scripts import, and what that imports in turn
        module = todo.pop()
        used.add(module)
        todo |= imported_modules(ROOT / (module.replace(".", "/") + ".py")) - used
    assert used == modules, f"not used by any training script: {sorted(modules - used)}"


def test_only_the_benchmark_and_the_machine_check_use_bench():
    users = {p.relative_to(ROOT).as_posix() for folder in ("common", "scripts") for p in (ROOT / folder).glob("*.py")
             if any(m.startswith("bench") for m in imported_modules(p))}
    assert users == {"scripts/benchmark.py", "scripts/check_gpus.py", "scripts/gpu_check.py"}


def test_a_copied_script_runs_with_common_alone(tmp_path):
    """What the README tells a user to copy: one script and common/, in a folder of their own."""
    shutil.copytree(ROOT / "common", tmp_path / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "scripts" / "train_ddp.py", tmp_path / "train.py")
    # The copy's own common/ (first on the path, as for a script run from its folder), then --help.
    code = ("import sys; sys.path.insert(0, '.'); import runpy, common.parallel; print(common.parallel.__file__); "
            "sys.argv = ['train.py', '--help']; runpy.run_path('train.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--dist-timeout" in done.stdout, done.stderr
    assert done.stdout.startswith(str(tmp_path / "common" / "parallel.py")), done.stdout
