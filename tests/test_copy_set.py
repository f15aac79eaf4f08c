"""common/ is the copy set: what a person takes along with one training script, and nothing else.

Each module does one job, says which in its docstring's first line, and stays under 400 lines;
imports among them flow one way (no cycles), down the floors common/__init__.py lists; each script
reaches only what it needs (a DDP copier takes no DataParallel code); none of it reaches into
bench/; and a copied script trains a step in every layout the README names, importing the copy and
nothing of this repository.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, user_env

TRAINING = ["train_single", "train_dp", "train_ddp", "train_amp", "train_fsdp"]
MAX_MODULE_LINES = 400
README = " ".join((ROOT / "README.md").read_text().split())  # its prose, however wrapped


def module_file(name: str) -> Path | None:
    """The file of project module ``name`` (common.data.cache, common.data), None if it is none."""
    path = ROOT / name.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """The project modules (common.*, bench.*) that a file imports, packages included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in ("common", "bench"):  # a module imports the packages above it too
                found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)
                          if module_file(".".join(parts[:i]))}
    return found


def reached(path: Path) -> set[str]:
    """The project modules a file imports, and what those import in turn."""
    seen, todo = set(), imported_modules(path)
    while todo:
        module = todo.pop()
        seen.add(module)
        todo |= imported_modules(module_file(module)) - seen
    return seen


def common_modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / "common").rglob("*.py") if "__pycache__" not in p.parts}


def test_each_module_does_one_job_in_at_most_400_lines():
    for name, path in common_modules().items():
        lines = path.read_text().splitlines()
        assert len(lines) <= MAX_MODULE_LINES, f"{name} has {len(lines)} lines: split it by job"
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{name} has no docstring saying what it does"


def test_imports_among_the_modules_flow_one_way():
    graph = {name: {m for m in imported_modules(path) if m in common_modules()}
             for name, path in common_modules().items()}

    def cycle_from(module, path):
        """A cycle through ``module`` reached along ``path`` (depth first), or None."""
        if module in path:
            return path[path.index(module):] + [module]
        return next(filter(None, (cycle_from(m, path + [module]) for m in sorted(graph[module]))), None)

    for module in graph:
        cycle = cycle_from(module, [])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def floors() -> list[str]:
    """The floors common/__init__.py's docstring lists, top first: its entries ``    name  text``
    (a folder as ``name/``, a module beside it as ``name``), each a floor of its own."""
    doc = ast.get_docstring(ast.parse((ROOT / "common" / "__init__.py").read_text()))
    return re.findall(r"^    ([a-z_]+)/? ", doc, re.MULTILINE)


def floor(module: str) -> str:
    """The folder of ``module`` (common.data.cache: data), or its own name beside them (errors)."""
    return module.split(".")[1]


def upward_imports(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """The imports in ``graph`` (module: the modules it imports) from a floor of ``order`` (top
    first) to one above it."""
    height = {name: len(order) - i for i, name in enumerate(order)}
    return [f"{module} imports {other}" for module in sorted(graph) for other in sorted(graph[module])
            if other != "common" and height[floor(other)] > height[floor(module)]]


def test_the_folders_stack_in_the_order_of_common_init():
    order = floors()
    modules = set(common_modules()) - {"common"}
    unplaced = sorted({floor(m) for m in modules} - set(order))
    assert not unplaced, f"common/__init__.py's docstring has no floor for {unplaced}: add a line each"
    assert len(order) == len(set(order)), f"common/__init__.py lists a floor twice: {order}"
    graph = {name: imported_modules(common_modules()[name]) for name in modules}
    upward = upward_imports(graph, order)
    assert not upward, (f"imports from a floor to one above it (common/__init__.py, top first: "
                        f"{', '.join(order)}): {'; '.join(upward)}; move what both use down a floor")
    # Negative control: the ground floor importing a folder, and one folder the one above it
    assert upward_imports({"common.files": {"common", "common.run.record"},
                           "common.run.record": {"common.recipe.models", "common.data.images"}}, order) \
        == ["common.files imports common.run.record", "common.run.record imports common.data.images"]


def test_each_script_reaches_what_it_needs_and_a_ddp_copier_takes_no_data_parallel_code():
    """common/parallel/data_parallel.py is train_dp.py's alone, common/parallel/amp.py train_amp.py's,
    common/parallel/fsdp.py train_fsdp.py's."""
    modules = set(common_modules()) - {"common"}
    reach = {script: reached(ROOT / "scripts" / f"{script}.py") - {"common"} for script in TRAINING}
    evaluation = reached(ROOT / "scripts" / "evaluate.py")
    assert set().union(*reach.values(), evaluation) >= modules, \
        f"used by no training script: {sorted(modules - set().union(*reach.values()))}"
    own = {"train_dp": {"common.parallel.data_parallel"}, "train_amp": {"common.parallel.amp"},
           "train_fsdp": {"common.parallel.fsdp"}}
    for script in TRAINING:
        unused = set().union(*(mine for other, mine in own.items() if other != script))
        assert modules - reach[script] == unused, (script, sorted(modules - reach[script]))
    # The README says so, and that the other modules are all needed: the whole folder is copied.
    assert "`common/parallel/data_parallel.py` is `train_dp.py`'s alone" in README
    assert "`common/parallel/amp.py` `train_amp.py`'s" in README
    assert "`common/parallel/fsdp.py` `train_fsdp.py`'s" in README


# What a DDP copier takes along, at most: train_ddp.py's copy set. A feature pays for its lines by
# simplifying what it touches (code a library does, checks made twice, modules that only pass
# values on, a strategy's own code in that strategy's module), never by dropping docstrings or
# packing lines. README.md and docs/tests.md give the figure.
MAX_COPY_SET_LINES = 6_500


def copy_set(script: Path) -> dict[Path, int]:
    """The files of common/ that ``script`` reaches, each with its lines."""
    return {module_file(module): len(module_file(module).read_text().splitlines())
            for module in reached(script) if module.split(".")[0] == "common"}


def copy_set_figure() -> tuple[int, str]:
    """train_ddp.py's copy set: its lines, and a line that says them, printed by the tests."""
    files = copy_set(ROOT / "scripts" / "train_ddp.py")
    lines = sum(files.values())
    largest = ", ".join(f"{path.relative_to(ROOT / 'common')} {n}"
                        for path, n in sorted(files.items(), key=lambda item: -item[1])[:5])
    said = (f"train_ddp.py's copy set: {len(files)} files of common/, {lines:,} lines (cap "
            f"{MAX_COPY_SET_LINES:,}); the largest: {largest}")
    print(f"\n{said}")
    return lines, said


def test_train_ddps_copy_set_stays_within_its_cap():
    lines, said = copy_set_figure()
    assert lines <= MAX_COPY_SET_LINES, \
        f"{said}: over its cap; simplify what the change touches instead"


def test_only_the_benchmark_and_the_machine_check_use_bench():
    users = {p.relative_to(ROOT).as_posix() for folder in ("common", "scripts")
             for p in (ROOT / folder).rglob("*.py") if any(m.startswith("bench") for m in imported_modules(p))}
    assert users == {"scripts/benchmark.py", "scripts/check_gpus.py", "scripts/gpu_check.py"}


# Loaded into every Python process of a copied run (a folder on PYTHONPATH): at exit it writes
# where each module of the project's packages (pyproject.toml: common, bench) came from, as the
# editable install supplies one the copy lacks (bench, or a module imported by name only): the test
# sees that the copy ran, and nothing of this repository.
PROBE = """import atexit, os, sys
def _where():
    files = [str(getattr(m, "__file__", None)) for n, m in list(sys.modules.items())
             if n.split(".")[0] in ("common", "bench")]
    if files:
        with open(os.path.join(os.environ["COPY_PROBE_OUT"], str(os.getpid())), "w") as f:
            f.write("\\n".join(files))
atexit.register(_where)
"""
# layout: (the script, where it goes in the new folder, the command, PYTHONPATH beside the probe's)
LAYOUTS = {
    "beside, python": ("train_single", "train.py", [sys.executable, "train.py"], []),
    "beside, accelerate launch 2 processes": (
        "train_ddp", "train.py", [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                                  str(ROOT / "accelerate_configs" / "4gpu.yaml"), "--num_processes", "2",
                                  "train.py"], []),
    "subfolder, PYTHONPATH=.": ("train_dp", "scripts/train.py", [sys.executable, "scripts/train.py"], ["."]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_copied_script_trains_a_step_in_each_layout_the_readme_names(tmp_path, layout):
    script, place, command, path = LAYOUTS[layout]
    assert "`train.py` beside `common/`" in README and "`PYTHONPATH=. python scripts/train.py`" in README
    folder, probe, out = tmp_path / "project", tmp_path / "probe", tmp_path / "loaded"
    (folder / place).parent.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / f"{script}.py", folder / place)
    for module in reached(ROOT / "scripts" / f"{script}.py"):  # exactly what the script reaches
        source = module_file(module)
        (folder / source.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, folder / source.relative_to(ROOT))
    probe.mkdir()
    out.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    env = user_env(PYTHONPATH=os.pathsep.join([*path, str(probe)]), COPY_PROBE_OUT=str(out))
    done = subprocess.run([*command, "--dataset", "synthetic", "--synthetic-train-size", "64",
                           "--synthetic-test-size", "16", "--model", "resnet20", "--batch-size", "32",
                           "--epochs", "1", "--max-steps", "1", "--report-to", "none", "--output-dir", "run",
                           "--cache-dir", str(tmp_path / "cache")],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "done: step 1" in done.stdout and (folder / "run" / "model.safetensors").is_file()
    loaded = [line for report in out.iterdir() for line in report.read_text().splitlines()]
    trainers = len(list(out.iterdir()))
    assert trainers == (2 if "2 processes" in layout else 1), f"{trainers} processes imported common"
    assert loaded and all(Path(file).is_relative_to(folder) for file in loaded), loaded
