"""Write docs/diffs/*.diff, each strategy script as a diff against the script it builds on: `make diffs`.

tests/test_diffs.py fails when a script changes and this has not been run, and holds each diff to its
size: the lesson, and nothing else.
"""

import difflib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# script: the script it builds on
BASES = {"train_dp": "train_single", "train_ddp": "train_single", "train_amp": "train_ddp",
         "train_fsdp": "train_ddp"}


def unified_diff(base: str, script: str) -> str:
    done = subprocess.run(["diff", "-u", "--label", f"scripts/{base}.py", "--label", f"scripts/{script}.py",
                           f"scripts/{base}.py", f"scripts/{script}.py"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode > 1:
        raise SystemExit(done.stderr)
    return done.stdout


def changed_code_lines(base: str, script: str) -> int:
    """Lines added or removed after the module docstrings: the size of the lesson in code."""
    def code(name: str) -> list[str]:
        text = (ROOT / "scripts" / f"{name}.py").read_text()
        return text[text.index('"""', 3) + 3:].splitlines()
    diff = difflib.unified_diff(code(base), code(script), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def main():
    (ROOT / "docs" / "diffs").mkdir(parents=True, exist_ok=True)
    for script, base in BASES.items():
        (ROOT / "docs" / "diffs" / f"{script}.diff").write_text(unified_diff(base, script))
        print(f"docs/diffs/{script}.diff: {changed_code_lines(base, script)} code lines changed from {base}.py")


if __name__ == "__main__":
    main()
