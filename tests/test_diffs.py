"""The diffs in docs/diffs/ are the lesson: they must match the scripts, and every change is tagged."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import make_diffs  # noqa: E402 - docs/ is not a package

PAIRS = {"train_dp": ("train_single", "DP"), "train_ddp": ("train_single", "DDP"), "train_amp": ("train_ddp", "AMP")}


def current_diff(base: str, script: str) -> str:
    return make_diffs.unified_diff(base, script)


@pytest.mark.parametrize("script", PAIRS)
def test_diff_file_is_up_to_date(script):
    base, _ = PAIRS[script]
    saved = (ROOT / "docs" / "diffs" / f"{script}.diff").read_text()
    assert saved == current_diff(base, script), f"docs/diffs/{script}.diff is stale: run `make diffs`"


def test_readme_shows_the_current_diffs():
    readme = (ROOT / "README.md").read_text()
    diffs = {script: current_diff(base, script) for script, (base, _) in PAIRS.items()}
    for script in PAIRS:
        assert f"<!-- diff:{script} -->" in readme, f"README.md has no place for the {script} diff"
    assert make_diffs.readme_with_diffs(readme, diffs) == readme, "README.md diffs are stale: run `make diffs`"


def added_blocks(diff: str):
    """Runs of consecutive added lines, after the module docstring."""
    blocks, block = [], []
    for line in diff.split('"""\n', 2)[-1].splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            block.append(line[1:])
        elif block:
            blocks.append(block)
            block = []
    return blocks + ([block] if block else [])


@pytest.mark.parametrize("script", PAIRS)
def test_every_change_carries_its_reason(script):
    """Each block of added code says why, with a '# DDP: ...' style tag (imports are exempt)."""
    base, tag = PAIRS[script]
    untagged = [block for block in added_blocks(current_diff(base, script))
                if not any(re.search(rf"#.*\b{tag}\b", line) for line in block)
                and not all(not line.strip() or line.startswith(("import ", "from ")) for line in block)]
    assert not untagged, f"blocks without a '# {tag}:' reason in {script}.diff:\n" + "\n\n".join(
        "\n".join(block) for block in untagged)
