"""The diffs in docs/diffs/ are the lesson: they match the scripts, teach their strategy and nothing
else (held to a size), and every change says why with a tag."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import make_diffs  # noqa: E402 - docs/ is not a package

# script: (the script it builds on, its tag, the most code lines its diff may change)
PAIRS = {"train_dp": ("train_single", "DP", 45), "train_ddp": ("train_single", "DDP", 35),
         "train_amp": ("train_ddp", "AMP", 25), "train_fsdp": ("train_ddp", "FSDP", 45)}
TAGS = ("DP", "DDP", "AMP", "FSDP")


@pytest.mark.parametrize("script", PAIRS)
def test_diff_file_is_up_to_date(script):
    base, _, _ = PAIRS[script]
    saved = (ROOT / "docs" / "diffs" / f"{script}.diff").read_text()
    assert saved == make_diffs.unified_diff(base, script), f"docs/diffs/{script}.diff is stale: run `make diffs`"


@pytest.mark.parametrize("script", PAIRS)
def test_each_diff_is_one_lesson_in_size(script):
    base, _, most = PAIRS[script]
    changed = make_diffs.changed_code_lines(base, script)
    assert changed <= most, f"{script}.py changes {changed} code lines of {base}.py; the lesson fits in {most}"


def test_changed_lines_are_counted_after_the_docstring(tmp_path, monkeypatch):
    for name, body in {"a": '"""A."""\n\nx = 1\ny = 2\n', "b": '"""B,\nlonger."""\n\nx = 1\ny = 3\nz = 4\n'}.items():
        (tmp_path / "scripts").mkdir(exist_ok=True)
        (tmp_path / "scripts" / f"{name}.py").write_text(body)
    monkeypatch.setattr(make_diffs, "ROOT", tmp_path)
    assert make_diffs.changed_code_lines("a", "b") == 3  # -y = 2, +y = 3, +z = 4


def is_import(line: str) -> bool:
    """An import statement, or a line of a parenthesised one: `    name,` or `)`."""
    return line.startswith(("import ", "from ")) or bool(re.fullmatch(r"\s+\w+,|\)", line))


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
    base, tag, _ = PAIRS[script]
    untagged = [block for block in added_blocks(make_diffs.unified_diff(base, script))
                if not any(re.search(rf"# {tag}: \S", line) for line in block)
                and not all(not line.strip() or is_import(line) for line in block)]
    assert not untagged, f"blocks without a '# {tag}: reason' in {script}.diff:\n" + "\n\n".join(
        "\n".join(block) for block in untagged)


@pytest.mark.parametrize("script", ["train_single", *PAIRS])
def test_no_tag_is_bare(script):
    """A tag always gives its reason after a colon: `# DDP: one process per GPU`, never `# DDP`."""
    for number, line in enumerate((ROOT / "scripts" / f"{script}.py").read_text().splitlines(), start=1):
        for tag in re.findall(rf"#\s*({'|'.join(TAGS)})\b(?!: \S)", line):
            if '"' not in line.split("#")[0] or "tagged" not in line:  # the docstring names the tags
                pytest.fail(f"scripts/{script}.py:{number}: bare '# {tag}' tag: {line.strip()}")


MAIN_LINES = 130  # main() of each training script: the loop and the steps around it, on a few screens


@pytest.mark.parametrize("script", ["train_single", *PAIRS])
def test_main_fits_its_cap(script):
    """main() stays readable: self-contained steps go into functions of their own (set_up,
    load_data, make_model, ...), the training loop stays in main()."""
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    (main,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    lines = main.end_lineno - main.lineno + 1
    assert lines <= MAIN_LINES, f"{script}.py's main() has {lines} lines; the cap is {MAIN_LINES}"


# The lines where each strategy happens, said at that line: (script, the call, its tag, a word the
# note must name). Accelerator() makes the process group (its '# ALL' comment says so).
WHERE = [("train_ddp", "accelerator.prepare", "DDP", "DistributedDataParallel"),
         ("train_ddp", "accelerator.accumulate", "DDP", "no_sync"),
         ("train_amp", "accelerator.prepare", "DDP", "DistributedDataParallel"),
         ("train_amp", "accelerator.accumulate", "DDP", "no_sync"),
         ("train_fsdp", "accelerator.prepare", "FSDP", "fully_shard"),
         ("train_fsdp", "accelerator.accumulate", "FSDP", "reduce-scatter"),
         *((script, "Accelerator", "ALL", "process group") for script in ["train_single", *PAIRS])]


@pytest.mark.parametrize("script, call, tag, word", WHERE)
def test_the_strategy_is_said_where_it_happens(script, call, tag, word):
    """The comment on the line of ``call`` and those right above it carry '# TAG:' and name
    ``word``: a reader of the script sees the strategy at the line where it acts."""
    text = (ROOT / "scripts" / f"{script}.py").read_text()
    lines = text.splitlines()
    (at,) = [node.lineno - 1 for node in ast.walk(ast.parse(text))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == call]
    note = ["#" + lines[at].split("#", 1)[1] if "#" in lines[at] else ""]
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        note.insert(0, line.strip())
    note = " ".join(note)
    assert f"# {tag}:" in note and word in note, (
        f"{script}.py: the comment at {call}() should say '# {tag}: ...' naming {word}: {note!r}")
