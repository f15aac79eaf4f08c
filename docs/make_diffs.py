"""Write docs/diffs/*.diff and the collapsible diffs in README.md: `make diffs`.

Each strategy script is read as the diff against the script it builds on; tests/test_diffs.py fails
when a script changes and this has not been run.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# script: the script it builds on
BASES = {"train_dp": "train_single", "train_ddp": "train_single", "train_amp": "train_ddp"}


def unified_diff(base: str, script: str) -> str:
    done = subprocess.run(["diff", "-u", "--label", f"scripts/{base}.py", "--label", f"scripts/{script}.py",
                           f"scripts/{base}.py", f"scripts/{script}.py"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode > 1:
        raise SystemExit(done.stderr)
    return done.stdout


def readme_with_diffs(readme: str, diffs: dict[str, str]) -> str:
    """Replace the text between <!-- diff:NAME --> and <!-- /diff:NAME --> with that diff."""
    for script, diff in diffs.items():
        block = f"<!-- diff:{script} -->\n```diff\n{diff}```\n<!-- /diff:{script} -->"
        readme = re.sub(rf"<!-- diff:{script} -->.*?<!-- /diff:{script} -->", lambda _: block, readme,
                        flags=re.DOTALL)
    return readme


def main():
    diffs = {script: unified_diff(base, script) for script, base in BASES.items()}
    (ROOT / "docs" / "diffs").mkdir(parents=True, exist_ok=True)
    for script, diff in diffs.items():
        (ROOT / "docs" / "diffs" / f"{script}.diff").write_text(diff)
    readme = ROOT / "README.md"
    if readme.exists():
        readme.write_text(readme_with_diffs(readme.read_text(), diffs))


if __name__ == "__main__":
    main()
