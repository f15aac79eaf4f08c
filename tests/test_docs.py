"""The docs' checkable claims: the README's "Where to change what" and Layout list the modules on
disk, docs/usage.md's example log line is what a run prints, docs/strategies.md names the code that
applies each flag it names, the suite's time and worker count are the Makefile's, and the code fits
in 100-character lines.

Pure file reading plus a few cheap calls (the log line, the loaders' lengths, the schedule); no
training, a few seconds in all.
"""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINE = 100  # pyproject.toml's [tool.ruff] line-length (test_ruff_line_length_is_100)
NAME = re.compile(r"[a-z_][a-z0-9_]*(/[a-z_][a-z0-9_]*)*")


def common_function(name: str):
    """The function ``name`` wherever common/ defines it, so these checks follow a function that
    moves to another module of common/."""
    for path in sorted((ROOT / "common").glob("**/*.py")):
        if re.search(rf"^def {name}\(", path.read_text(), re.MULTILINE):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            return getattr(importlib.import_module(module), name)
    pytest.fail(f"no module of common/ defines {name}(): update tests/test_docs.py")


# ----------------------------------------------------------------------------- README's module lists

def listed_names(text: str) -> list[str]:
    """The module names a README entry lists. Text in parentheses is a remark; the rest is names
    separated by commas, semicolons or "and", with or without ``.py`` and backquotes, sub-package
    modules as ``data/sources``. In each part between semicolons, text up to a colon is a
    description ("the copy set: cli, ..."). Words that are no name are prose."""
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", " ", text)  # innermost first: remarks may hold calls
    text = " , ".join(part.rsplit(":", 1)[-1] for part in text.split(";"))
    names = []
    for token in re.split(r",|\band\b", text):
        token = token.strip().strip(".").strip().strip("`")
        token = token[:-3] if token.endswith(".py") else token
        if NAME.fullmatch(token):
            names.append(token)
    return names


def section(readme: str, title: str) -> str:
    parts = readme.split(f"\n## {title}\n", 1)
    assert len(parts) == 2, f"README.md has no '## {title}' section, where the module lists are"
    return parts[1].split("\n## ", 1)[0]


def layout_entry(readme: str, folder: str) -> list[str]:
    """The names the README's Layout block lists for ``folder`` (scripts, bench).

    The block is indented code; an entry is a line ``    folder/  text`` plus the lines indented
    deeper below it."""
    lines = section(readme, "Layout").splitlines()
    start = [i for i, line in enumerate(lines) if re.match(rf"    {folder}/(\s|$)", line)]
    assert len(start) == 1, (f"README.md's Layout block has {len(start)} lines starting with "
                             f"'    {folder}/'; it needs one, listing the modules of {folder}/")
    text = [lines[start[0]][len(f"    {folder}/"):]]
    for line in lines[start[0] + 1:]:
        if not line.strip() or len(line) - len(line.lstrip()) <= 4:
            break  # a blank line or the next entry
        text.append(line)
    return listed_names(" ".join(text))


def change_entry(readme: str, folder: str) -> list[str]:
    """The names README's "Where to change what" lists for ``folder`` (common, common/data, ...):
    the table row whose edit cell starts with a link to ``folder/``."""
    rows = [row.split("|") for row in section(readme, "Where to change what").splitlines()
            if row.startswith("| ")]
    cells = [row[2] for row in rows if len(row) > 3 and row[2].strip().startswith(f"[`{folder}/`]")]
    assert len(cells) == 1, (f"README.md's 'Where to change what' has {len(cells)} rows whose edit "
                             f"cell starts with [`{folder}/`](...); it needs one, naming its modules")
    return listed_names(cells[0])


def modules_on_disk(folder: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")


def list_mismatch(listed: list[str], folder: str, where: str) -> str:
    """'' when ``listed`` is exactly the modules of ``folder``, else what to fix."""
    on_disk = modules_on_disk(folder)
    missing = sorted(set(on_disk) - set(listed))
    stale = sorted(set(listed) - set(on_disk))
    twice = sorted({name for name in listed if listed.count(name) > 1})
    problems = []
    if missing:
        problems.append(f"add {', '.join(missing)} (on disk, not listed)")
    if stale:
        problems.append(f"remove {', '.join(stale)} (listed, no {folder}/NAME.py)")
    if twice:
        problems.append(f"list {', '.join(twice)} once")
    return f"README.md {where}, the '{folder}/' entry: {'; '.join(problems)}" if problems else ""


COMMON_FOLDERS = ["common"] + sorted(p.parent.relative_to(ROOT).as_posix()
                                     for p in (ROOT / "common").glob("*/__init__.py"))


@pytest.mark.parametrize("folder", ["scripts", "bench"])
def test_readme_layout_lists_the_modules_on_disk(folder):
    readme = (ROOT / "README.md").read_text()
    problem = list_mismatch(layout_entry(readme, folder), folder, "Layout")
    assert not problem, problem


@pytest.mark.parametrize("folder", COMMON_FOLDERS)
def test_where_to_change_what_names_every_module_of_common(folder):
    readme = (ROOT / "README.md").read_text()
    problem = list_mismatch(change_entry(readme, folder), folder, "Where to change what")
    assert not problem, problem


def test_module_list_checks_catch_a_module_left_out_or_made_up():
    # Negative control: the parsers on blocks of the README's formats (prefix, remarks holding
    # calls, continuation lines, descriptions), then the README with one name dropped and one added.
    block = ("intro\n\n## Layout\n\n"
             "    scripts/            train_single.py, evaluate.py;\n"
             "                        the machine: benchmark.py and check_gpus.py (not a lesson)\n"
             "    tests/              the test suite (make test)\n\n"
             "## Where to change what\n\n| to change | edit |\n|---|---|\n"
             "| flags | [`common/`](common/__init__.py): cli (`parse(a, b)`; remark), errors |\n"
             "| data | [`common/data/`](x): inputs (one call), flags; a job each: data/sources |\n\n"
             "## Next\n\n    scripts/  nothing\n")
    assert layout_entry(block, "scripts") == ["train_single", "evaluate", "benchmark", "check_gpus"]
    assert change_entry(block, "common") == ["cli", "errors"]
    assert change_entry(block, "common/data") == ["inputs", "flags", "data/sources"]
    readme = (ROOT / "README.md").read_text()
    entry = re.search(r"\n    bench/[^\n]*(\n {5,}[^\n]*)*", readme).group(0)
    last = layout_entry(readme, "bench")[-1]
    at = entry.rindex(last)
    cut = readme.replace(entry, entry[:at] + entry[at + len(last):])  # the last name left out
    assert re.search(rf"add [^(]*\b{last}\b", list_mismatch(layout_entry(cut, "bench"), "bench", ""))
    row = re.search(r"\n\| [^|]*\| \[`common/run/`\][^\n]*", readme).group(0)
    made_up = readme.replace(row, row.replace("folder,", "folder, made_up,"))
    assert "remove made_up " in list_mismatch(change_entry(made_up, "common/run"), "common/run", "")
    dropped = readme.replace(row, row.replace(" lock,", ""))
    assert re.search(r"add [^(]*\block\b", list_mismatch(change_entry(dropped, "common/run"), "common/run", ""))


# ----------------------------------------------------------------------------- the example log line

def usage_example() -> tuple[str, str]:
    """docs/usage.md's example log line and the paragraph that introduces it."""
    text = (ROOT / "docs" / "usage.md").read_text()
    match = re.search(r"((?:[^\n]+\n)+)\n    (epoch=\S+ step=[^\n]+)\n", text)
    assert match, ("docs/usage.md has no paragraph followed by an indented example log line "
                   "starting 'epoch=N/M step='")
    return match.group(2), " ".join(match.group(1).split())


def parse_log_line(line: str) -> dict:
    """The fields of a log line back as a metrics dict, with log_line's names."""
    fields = dict(pair.split("=", 1) for pair in line.split())
    epoch, epochs = fields.pop("epoch").split("/")
    metrics = {"epoch": int(epoch), "epochs": int(epochs), "step": int(fields.pop("step")),
               "batch_size": int(fields.pop("batch"))}
    metrics.update({key: float(value) for key, value in fields.items()})
    return metrics


def format_problem(line: str) -> str:
    """'' when ``line`` is exactly what common/observe/tracking.py's log_line prints for its values."""
    log_line = common_function("log_line")
    try:
        printed = log_line(parse_log_line(line))
    except (KeyError, ValueError) as error:
        return (f"docs/usage.md's example log line does not parse as log_line's fields "
                f"({error!r}): {line}")
    if printed == line:
        return ""
    names = " ".join(pair.split("=")[0] for pair in printed.split())
    return (f"docs/usage.md's example log line is not in log_line's format (fields: {names}); "
            f"log_line prints its values as:\n{printed}\nthe doc has:\n{line}")


def arithmetic_problems(line: str, intro: str) -> list[str]:
    """What in the example line and its paragraph does not follow from the data size and batch."""
    metrics = parse_log_line(line)
    found = {key: re.search(pattern, intro) for key, pattern in (
        ("size", r"([\d,]+) training images"), ("steps", r"an epoch is (\d+) optimizer\s+steps"),
        ("dropped", r"last partial batch, (\d+) images"),
        ("end", r"epoch (\d+) of the default schedule ends at step (\d+)"))}
    if not all(found.values()):
        return ["docs/usage.md: the paragraph before the example log line must state 'N training "
                "images', 'an epoch is S optimizer steps', 'last partial batch, R images' and "
                f"'epoch E of the default schedule ends at step T'; it reads: {intro}"]
    train_size, batch = int(found["size"].group(1).replace(",", "")), metrics["batch_size"]
    per_epoch = train_size // batch  # the training loaders drop the last partial batch
    problems = [] if f"--batch-size {batch}" in intro else [
        f"docs/usage.md: the paragraph does not say --batch-size {batch}, the line's batch"]
    for what, doc, right in (
            ("steps per epoch", int(found["steps"].group(1)), per_epoch),
            ("images dropped", int(found["dropped"].group(1)), train_size - per_epoch * batch),
            ("epoch in the text", int(found["end"].group(1)), metrics["epoch"]),
            ("step in the text", int(found["end"].group(2)), metrics["epoch"] * per_epoch),
            ("step in the line", metrics["step"], metrics["epoch"] * per_epoch)):
        if doc != right:
            problems.append(f"docs/usage.md's {what} is {doc}; {train_size} images at batch "
                            f"{batch} make it {right}")
    # img/s = images trained / epoch time, which the line shows to 0.1 s.
    images, seconds = per_epoch * batch, metrics["epoch_time_s"]
    if not images / (seconds + 0.05) <= metrics["img_per_s"] <= images / (seconds - 0.05):
        problems.append(f"docs/usage.md: img_per_s={metrics['img_per_s']:.0f} does not follow from "
                        f"{images} images in epoch_time_s={seconds}: {images / seconds:.0f}")
    return problems


def test_usage_example_log_line_is_what_log_line_prints():
    line, _ = usage_example()
    problem = format_problem(line)
    assert not problem, problem


def test_usage_example_step_count_follows_from_the_dataset_and_batch():
    line, intro = usage_example()
    problems = arithmetic_problems(line, intro)
    assert not problems, "\n".join(problems)


def test_training_loaders_drop_the_last_partial_batch():
    # The arithmetic above, floor(images / batch) steps an epoch, is the loaders' (grad_accum 1).
    import torch

    tensor_loader = common_function("tensor_loader")
    worker_loader = common_function("worker_loader")
    _, intro = usage_example()
    train_size = int(re.search(r"([\d,]+) training images", intro).group(1).replace(",", ""))
    batch = parse_log_line(usage_example()[0])["batch_size"]
    tensor = tensor_loader(torch.zeros(train_size, 1), torch.zeros(train_size), batch, shuffle=True)
    workers = worker_loader(range(train_size), 32, batch, train=True, workers=0)
    assert len(tensor) == len(workers) == train_size // batch, (
        f"the training loaders give {len(tensor)} (tensor_loader) and {len(workers)} "
        f"(worker_loader) batches of {batch} from {train_size} images, not {train_size // batch}: "
        "update docs/usage.md's arithmetic, which assumes the last partial batch is dropped")


def test_usage_example_lr_is_the_default_schedule_at_that_step():
    import torch

    build_parser = common_function("build_parser")
    build_optimizer = common_function("build_optimizer")
    build_scheduler = common_function("build_scheduler")
    line, intro = usage_example()
    metrics = parse_log_line(line)
    defaults = build_parser("").parse_args([])
    assert (metrics["batch_size"], metrics["epochs"]) == (defaults.batch_size, defaults.epochs), (
        "docs/usage.md's example says 'the default schedule': its batch and epochs must be the "
        f"defaults, --batch-size {defaults.batch_size} and --epochs {defaults.epochs}")
    train_size = int(re.search(r"([\d,]+) training images", intro).group(1).replace(",", ""))
    per_epoch = train_size // metrics["batch_size"]
    scale = metrics["batch_size"] / defaults.reference_batch_size if defaults.scale_lr else 1
    lr = defaults.lr if defaults.lr is not None else importlib.import_module("common.cli").DEFAULT_LR[defaults.optimizer]
    optimizer = build_optimizer(torch.nn.Linear(1, 1), lr * scale, defaults.momentum,
                                defaults.weight_decay)
    scheduler = build_scheduler(optimizer, defaults.schedule, per_epoch * defaults.epochs,
                                per_epoch, defaults.warmup_epochs, defaults.milestones)
    for _ in range(metrics["step"] - 1):  # the line's lr is the one its last step ran with
        optimizer.step()
        scheduler.step()
    lr = scheduler.get_last_lr()[0]
    assert f"lr={lr:.4g} " in line and f"lr of {lr:.4g}" in intro, (
        f"docs/usage.md: at step {metrics['step']} the default schedule's lr is {lr:.4g}; "
        f"the example line says lr={metrics['lr']:.4g}: make the line and its paragraph say it")


def test_usage_example_checks_catch_a_stale_line():
    # Negative controls: the stale example (1173 steps: a partial batch counted), a field moved,
    # a field missing.
    line, intro = usage_example()
    step = parse_log_line(line)["step"]
    stale = arithmetic_problems(line.replace(f"step={step} ", "step=1173 "), intro)
    assert any(problem.startswith("docs/usage.md's step in the line is 1173;") for problem in stale)
    fields = line.split()
    moved = " ".join([fields[1], fields[0], *fields[2:]])
    assert "not in log_line's format" in format_problem(moved)
    missing = " ".join(field for field in fields if not field.startswith("data_wait_frac="))
    assert "does not parse" in format_problem(missing)


# ----------------------------------------------------------------------------- who applies a flag

STRATEGIES = ROOT / "docs" / "strategies.md"


def reads(path: Path, flag: str) -> bool:
    """Whether ``path`` reads ``flag`` from the parsed flags (``args.dest``)."""
    return re.search(rf"\bargs\.{flag[2:].replace('-', '_')}\b", path.read_text()) is not None


def applier_problems(page: str) -> list[str]:
    """What in the opening of docs/strategies.md (``page``) says the wrong code applies a flag:
    "the scripts themselves apply `--flag` ..." (train_single.py reads it and common/ applies it
    nowhere but its flag checks, cli.py) and "`common/PATH.py` applies `--flag`" (that module reads
    it, the scripts do not)."""
    opening = " ".join(page.split("\n## ", 1)[0].split())
    scripts = re.search(r"the scripts themselves apply (.*?), in the same lines", opening)
    modules = re.findall(r"`(common/[\w/]+\.py)` applies `(--[\w-]+)`", opening)
    if not scripts or not modules:
        return ["docs/strategies.md's opening must say 'the scripts themselves apply `--flag` ..., "
                "in the same lines in each' and '`common/PATH.py` applies `--flag`'"]
    single = ROOT / "scripts" / "train_single.py"
    checks = {ROOT / "common" / "cli.py", ROOT / "common" / "data" / "flags.py"}
    problems = []
    for flag in re.findall(r"`(--[\w-]+)`", re.sub(r"\([^()]*\)", "", scripts.group(1))):
        elsewhere = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "common").glob("**/*.py"))
                     if p not in checks and reads(p, flag)]
        if not reads(single, flag) or elsewhere:
            problems.append(f"docs/strategies.md says the scripts apply {flag}; scripts/train_single.py "
                            f"{'reads' if reads(single, flag) else 'never reads'} it, "
                            f"{', '.join(elsewhere) or 'no module of common/'} does: say who applies it")
    for module, flag in modules:
        if not (ROOT / module).is_file() or not reads(ROOT / module, flag) or reads(single, flag):
            problems.append(f"docs/strategies.md says {module} applies {flag}; it does not, or not "
                            f"alone (scripts/train_single.py reads it too): say who applies it")
    return problems


def test_the_strategies_page_says_who_applies_each_flag():
    problems = applier_problems(STRATEGIES.read_text())
    assert not problems, "\n".join(problems)


def test_applier_check_catches_the_scripts_said_to_apply_what_common_does():
    # Negative control: the page's old sentence, the scripts applying --scale-lr
    old = STRATEGIES.read_text().replace(
        "(`common/recipe/optim.py` applies `--scale-lr`, the peak lr); the scripts themselves apply",
        "(`common/recipe/optim.py` applies `--clip-grad`); the scripts themselves apply `--scale-lr`,")
    assert old != STRATEGIES.read_text()
    problems = applier_problems(old)
    assert any("the scripts apply --scale-lr; scripts/train_single.py never reads it, "
               "common/recipe/optim.py does" in p for p in problems), problems
    assert any("common/recipe/optim.py applies --clip-grad" in p for p in problems), problems


# ----------------------------------------------------------------------------- the suite's time, its workers

WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def makefile_comments() -> str:
    """The Makefile's comments as prose: the comment marks dropped, lines joined."""
    return " ".join(line.strip().lstrip("#").strip() for line in
                    (ROOT / "Makefile").read_text().splitlines() if line.strip().startswith("#"))


def test_the_readme_gives_the_suites_time_the_makefile_records():
    measured = re.search(r"whole suite on 2 cores since: ([\d,]+) s when nothing else runs, ([\d,]+) s "
                         r"beside other work", makefile_comments())
    assert measured, ("the Makefile's comment on `test` must record 'the whole suite on 2 cores since: "
                      "N s when nothing else runs, M s beside other work'")
    quiet, busy = (int(group.replace(",", "")) for group in measured.groups())
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"\nmake test .*\(~(\d+) min on 2 idle cores, ~(\d+) busy\)", readme)
    assert said, "README.md's `make test` line must give '(~N min on 2 idle cores, ~M busy)'"
    assert (int(said.group(1)), int(said.group(2))) == (round(quiet / 60), round(busy / 60)), (
        f"README.md's `make test` line gives ~{said.group(1)} and ~{said.group(2)} min; the Makefile "
        f"records {quiet} s and {busy} s: say ~{round(quiet / 60)} and ~{round(busy / 60)}")


def worker_counts(text: str) -> list[int]:
    """Every 'N pytest-xdist workers' that ``text`` states, N in digits or a word."""
    prose = " ".join(re.sub(r"\n\s*#+", " ", text).split())  # comments wrapped over lines joined
    found = re.findall(rf"\b(\d+|{'|'.join(WORDS)}) pytest-xdist workers", prose, re.IGNORECASE)
    return [int(n) if n.isdigit() else WORDS[n.lower()] for n in found]


@pytest.mark.parametrize("where", ["Makefile", "requirements-dev.txt", "tests/conftest.py",
                                   "docs/tests.md"])
def test_every_stated_worker_count_is_the_makefiles(where):
    recipe = re.search(r"\ntest:[^\n]*((?:\n\t[^\n]*)+)", (ROOT / "Makefile").read_text()).group(1)
    workers = int(re.search(r"-m pytest .*-n (\d+)", recipe).group(1))
    text = makefile_comments() if where == "Makefile" else (ROOT / where).read_text()
    stated = worker_counts(text)
    assert stated and set(stated) == {workers}, (
        f"{where} states {stated or 'no'} 'N pytest-xdist workers'; `make test` runs pytest -n "
        f"{workers}: say {workers}")
    assert worker_counts("make test: 2 pytest-xdist workers; Three\n# pytest-xdist workers") == [2, 3]


# ----------------------------------------------------------------------------- line length

def long_lines(root: Path, folders: list[str]) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).glob("**/*.py")):
            if "__pycache__" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if len(line) > MAX_LINE:
                    found.append(f"{path.relative_to(root)}:{number} ({len(line)})")
    return found


def test_code_lines_fit_in_100_characters():
    found = long_lines(ROOT, ["scripts", "common"])
    assert not found, (f"{len(found)} lines over {MAX_LINE} characters (pyproject.toml's "
                       f"[tool.ruff] line-length; `ruff check --select E501` lists them): "
                       + ", ".join(found[:20])
                       + (" ..." if len(found) > 20 else ""))


def test_line_length_check_catches_a_long_line(tmp_path):
    # Negative control: one line of 101 characters is found, one of 100 is not.
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.py").write_text("x = 1\n" + "#" * 101 + "\n" + "#" * 100 + "\n")
    assert long_lines(tmp_path, ["pkg"]) == ["pkg/sub/m.py:2 (101)"]


def test_ruff_line_length_is_100():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["ruff"]["line-length"] == MAX_LINE, (
        f"pyproject.toml: set [tool.ruff] line-length = {MAX_LINE}")
