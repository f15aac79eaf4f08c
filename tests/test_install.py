"""The install lines: a copied script and common/ run on `pip install -r requirements.txt` alone.

requirements.txt names every package that the training scripts and evaluate.py import, through
common/, at import time or in a function (the copier's one line: no `-e .`, no tool of the tests);
requirements-optional.txt the parts a run uses only when asked, imported in a function and
answered with one line when absent; requirements-dev.txt adds the tools of the tests and the
benchmark, and the project itself (docs/install.md).
"""

import ast
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions, requires
from pathlib import Path

from helpers import ROOT, run, user_env
from packaging.markers import default_environment
from packaging.requirements import Requirement
from test_copy_set import TRAINING, module_file, reached

COPIED_SCRIPTS = [ROOT / "scripts" / f"{name}.py" for name in [*TRAINING, "evaluate"]]
DEV_TOOLS = {"pytest", "pytest-xdist", "kubeflow-trainer-api", "matplotlib"}
OWN = ("common", "bench")


def normal(name: str) -> str:
    """A distribution's name as PEP 503 compares them (Huggingface_Hub, huggingface-hub ...)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(name: str) -> list[str]:
    """The lines of a requirement file, comments and blank lines left out."""
    lines = (line.split(" #")[0].strip() for line in (ROOT / name).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def named(name: str) -> set[str]:
    """The distributions a requirement file names itself (not through -r)."""
    return {normal(Requirement(line).name) for line in requirement_lines(name)
            if not line.startswith("-")}


def third_party_imports(path: Path) -> dict[str, bool]:
    """The top-level modules outside the standard library and the project that ``path`` imports:
    name -> whether every import of it is inside a function (lazy)."""
    found: dict[str, bool] = {}

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [child.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN:
                    found[top] = found.get(top, True) and inner
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def copy_set_imports() -> dict[str, bool]:
    """third_party_imports over the scripts a person copies and the common/ modules they reach."""
    files = set(COPIED_SCRIPTS) | {module_file(m) for s in COPIED_SCRIPTS for m in reached(s)}
    merged: dict[str, bool] = {}
    for path in files:
        for top, lazy in third_party_imports(path).items():
            merged[top] = merged.get(top, True) and lazy
    return merged


@cache
def providers() -> dict[str, set[str]]:
    """Each importable top-level module -> the installed distributions that provide it."""
    return {top: {normal(owner) for owner in owners}
            for top, owners in packages_distributions().items()}


def distributions_of(top: str) -> set[str]:
    assert top in providers(), f"no installed distribution provides the module {top!r}"
    return providers()[top]


def test_every_package_a_copied_script_imports_is_named_by_the_copiers_install_line():
    needed, optional = named("requirements.txt"), named("requirements-optional.txt")
    for top, lazy in sorted(copy_set_imports().items()):
        owners = distributions_of(top)
        assert owners & (needed | optional), \
            f"{top} ({', '.join(sorted(owners))}) is in no requirements.txt, no optional file"
        if not owners & needed:  # an optional part: imported only by the runs that ask for it
            assert lazy, f"{top} is optional (requirements-optional.txt), imported at import time"


def test_the_copiers_line_has_no_editable_install_and_no_tool_of_the_tests():
    lines = requirement_lines("requirements.txt")
    assert not [line for line in lines if line.startswith("-")], "requirements.txt: no -e/-r lines"
    for line in lines:  # a lower bound each, so that an old install is told to upgrade
        assert ">=" in str(Requirement(line).specifier), f"requirements.txt: {line}: no lower bound"
    assert not named("requirements.txt") & DEV_TOOLS
    assert not named("requirements.txt") & named("requirements-optional.txt")
    # The tests' tools (and the tests' own imports) are the development file's
    tests = {top for path in (ROOT / "tests").glob("*.py") for top in third_party_imports(path)}
    assert {"pytest", "psutil", "kubeflow_trainer_api"} <= tests
    assert DEV_TOOLS <= named("requirements-dev.txt")


def installable(names: set[str]) -> set[str]:
    """``names`` and every distribution they require in this environment, transitively."""
    environment, seen, todo = default_environment(), set(), set(names)
    while todo:
        name = todo.pop()
        seen.add(name)
        for line in requires(name) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or marker.evaluate({**environment, "extra": ""}):
                todo |= {normal(requirement.name)} - seen
    return seen


def test_the_development_install_covers_every_import_of_the_repository():
    """make demo / make test install requirements-dev.txt: the tests, bench/ and scripts/ find
    every package they import there (named, or required by a named one)."""
    lines = requirement_lines("requirements-dev.txt")
    assert {"-r requirements.txt", "-r requirements-optional.txt", "-e ."} <= set(lines)
    everything = installable(named("requirements.txt") | named("requirements-optional.txt")
                             | named("requirements-dev.txt"))
    files = [path for folder in ("tests", "bench", "scripts", "common")
             for path in (ROOT / folder).rglob("*.py")]
    local = {p.stem for p in ROOT.glob("*/*.py")}  # the tests' helpers, docs/make_diffs.py ...
    for path in files:
        for top in set(third_party_imports(path)) - local:
            assert distributions_of(top) & everything, f"{path.relative_to(ROOT)} imports {top}"
    # pyproject.toml reads its dependencies from the same files (pip install -e ".[optional]")
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"]["file"] == ["requirements.txt"]
    assert dynamic["optional-dependencies"]["optional"]["file"] == ["requirements-optional.txt"]
    assert "-e ." not in (ROOT / "Makefile").read_text() and "-r requirements-dev.txt" in \
        (ROOT / "Makefile").read_text()


def test_a_run_without_the_optional_and_development_packages_trains_and_says_so(tmp_path):
    """The default flags on the copier's install alone: every package of the optional and the
    development files made absent as Python finds an absent one; the trackers asked for besides
    the default are one warning line each, and the run trains to its end."""
    absent = named("requirements-optional.txt") | named("requirements-dev.txt")
    kept = installable(named("requirements.txt"))
    modules = sorted(top for top, owners in providers().items()
                     if owners & absent and not owners & kept and top.isidentifier())
    assert {"mlflow", "tensorboard", "pynvml", "pytest", "matplotlib"} <= set(modules)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    out = tmp_path / "run"
    done = run("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", 64,
               "--synthetic-test-size", 16, "--model", "resnet20", "--batch-size", 32,
               "--epochs", 1, "--max-steps", 2, "--report-to", "wandb", "tensorboard", "mlflow",
               "--output-dir", out,
               env_extra={"PYTHONPATH": f"{shim}:{ROOT}"}, cwd=tmp_path)
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: --report-to {name} needs the {name} package, which is not "
                        f"installed (pip install {name}); training goes on without it"
                        for name in ("tensorboard", "mlflow")]
    assert "done: step 2" in done.stdout and (out / "model.safetensors").is_file()
    assert "wandb sync" in done.stdout  # the default tracker ran (offline: no API key here)


# Loaded first into every Python process of the test below (a folder on PYTHONPATH, alone): it
# takes the project's own install away (the editable finder of `pip install -e .`, a path to the
# repository), as a virtual environment made by `pip install -r requirements.txt` alone lacks it,
# and at exit writes where each module of the project's packages came from.
WITHOUT_PROJECT = """import atexit, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
_root = os.path.realpath(os.environ["NO_PROJECT_ROOT"])
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _root]
def _where():
    files = [str(getattr(m, "__file__", None)) for n, m in list(sys.modules.items())
             if n.split(".")[0] in ("common", "bench")]
    with open(os.path.join(os.environ["NO_PROJECT_OUT"], str(os.getpid())), "w") as f:
        f.write("\\n".join(files))
atexit.register(_where)
"""


def readme_scripts() -> set[str]:
    """The scripts of this repository that the README's commands run (python, accelerate launch,
    torchrun); `train.py` is a copier's name for one."""
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"(?:python|accelerate launch|torchrun)\b[^`\n|]*?\bscripts/(\w+\.py)", readme)
    return {name for name in named if (ROOT / "scripts" / name).is_file()}


def test_the_readmes_commands_run_from_the_root_after_the_readmes_install_alone(tmp_path):
    """Each script a README command runs, started from the repository's root as the README starts
    it, in this environment without the project's own install: its imports of common/ (and bench/)
    come through the script's folder (scripts/common, scripts/bench: links), as a copied script's
    do. The launchers run the same file, so they find the same folder first."""
    shim, out = tmp_path / "shim", tmp_path / "loaded"
    shim.mkdir()
    out.mkdir()
    (shim / "sitecustomize.py").write_text(WITHOUT_PROJECT)
    env = user_env(PYTHONPATH=str(shim), NO_PROJECT_ROOT=str(ROOT), NO_PROJECT_OUT=str(out))
    # Negative control: without the script's folder, the project is not importable at all
    alone = subprocess.run([sys.executable, "-c", "import common"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert "No module named 'common'" in alone.stderr, alone.stderr[-2000:]
    scripts = readme_scripts()
    assert {f"{name}.py" for name in [*TRAINING, "evaluate"]} <= scripts, scripts
    started = {name: subprocess.Popen([sys.executable, f"scripts/{name}", "--help"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL) for name in sorted(scripts)}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and stdout.startswith("usage:"), f"{name}: {stderr[-2000:]}"
    loaded = {file for report in out.iterdir() for file in report.read_text().splitlines()}
    assert len(list(out.iterdir())) == len(scripts) + 1 and loaded
    via = [ROOT / "scripts" / "common", ROOT / "scripts" / "bench"]
    assert all(any(Path(file).is_relative_to(folder) for folder in via) for file in loaded), sorted(loaded)[:5]
