"""The same flag means the same thing in every script: same default, same help, same effect.

Each script's own parser is read (captured as its parse_args builds it), so a flag redefined in
one script, or given another default or help there, fails here.
"""

import argparse
import importlib.util
import subprocess
import sys

import pytest
from helpers import ROOT

from common.cli import Parser

TRAINING = ["train_single", "train_dp", "train_ddp", "train_amp", "train_fsdp"]
# What each script adds to the shared flags: its strategy's own, and nothing else.
DDP_FLAGS = {"--sync-bn", "--dist-timeout", "--share-gpus"}  # common.cli.add_ddp_args
OWN_FLAGS = {"train_single": set(), "train_dp": {"--loss-in-replicas"}, "train_ddp": DDP_FLAGS,
             "train_amp": DDP_FLAGS | {"--mixed-precision"},
             "train_fsdp": DDP_FLAGS}  # --sync-bn there: refused, in one line


PARSE = Parser.parse_args


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser the script's parse_args builds, as it parses the defaults."""
    spec = importlib.util.spec_from_file_location(script, ROOT / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports and definitions only: main() runs under __main__
    built = []
    monkeypatch.setattr(Parser, "parse_args", lambda self, *a, **k: built.append(self) or PARSE(self, *a, **k))
    module.parse_args(["--weights", "model.safetensors"] if script == "evaluate" else [])
    return built[-1]


def flags(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """Each option string with everything that decides its meaning."""
    return {option: (type(action).__name__, action.dest, action.default, action.type, action.choices, action.nargs,
                     action.const, action.metavar, action.help)
            for action in parser._actions for option in action.option_strings}


@pytest.fixture(scope="module")
def parsers():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {script: flags(parser_of(script, monkeypatch)) for script in [*TRAINING, "evaluate"]}


@pytest.mark.parametrize("script", TRAINING[1:])
def test_shared_flags_are_identical_in_every_training_script(parsers, script):
    reference, theirs = parsers["train_single"], parsers[script]
    for option in set(reference) & set(theirs):
        assert theirs[option] == reference[option], f"{option} differs between train_single.py and {script}.py"


@pytest.mark.parametrize("script", TRAINING)
def test_a_script_adds_only_its_strategy_flags(parsers, script):
    shared = set(parsers["train_single"])
    assert set(parsers[script]) - shared == OWN_FLAGS[script]
    assert shared <= set(parsers[script]), f"{script}.py lacks shared flags: {shared - set(parsers[script])}"


def test_flags_added_by_two_scripts_agree(parsers):
    for option in OWN_FLAGS["train_ddp"]:  # train_amp.py and train_fsdp.py build on train_ddp.py
        for script in ("train_amp", "train_fsdp"):
            assert parsers[script][option] == parsers["train_ddp"][option], (script, option)


def test_evaluate_reads_the_data_with_the_training_flags(parsers):
    data_flags = ["--dataset", "--data-dir", "--cache-dir", "--synthetic-train-size", "--synthetic-test-size"]
    for option in data_flags:
        assert parsers["evaluate"][option] == parsers["train_single"][option], option
    # Flags of evaluate.py that training scripts also have mean the same there; --model is the same
    # name, read from the weights when not given.
    for option in set(parsers["evaluate"]) & set(parsers["train_single"]) - {"-h", "--help", "--model", *data_flags}:
        assert parsers["evaluate"][option] == parsers["train_single"][option], option


def test_a_flag_that_differs_is_caught(parsers, monkeypatch):
    """The comparison sees a changed default (a negative control for the tests above)."""
    original = argparse._ActionsContainer.add_argument  # of parsers and their argument groups

    def other_default(self, *names, **kwargs):
        if "--dist-timeout" in names:
            kwargs["default"] = 30
        return original(self, *names, **kwargs)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", other_default)
    changed = flags(parser_of("train_amp", monkeypatch))
    assert changed["--dist-timeout"] != parsers["train_ddp"]["--dist-timeout"]


# A fresh python that imports torch alone, then forks one child per script to run it as `python
# script.py --help` does (its folder first on sys.path, run as __main__), each child's output in a file.
FRESH = """
import os, runpy, sys, traceback
import torch  # what every script imports first; imported alone, it brings no other package
for path, log in zip(sys.argv[1::2], sys.argv[2::2]):
    if os.fork() == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 1), os.dup2(fd, 2)
        sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            sys.stdout.flush(), os._exit(stop.code if isinstance(stop.code, int) else 1)
        except BaseException:
            traceback.print_exc(), sys.stderr.flush(), os._exit(1)
        sys.stdout.flush(), os._exit(0)
    print(os.waitstatus_to_exitcode(os.wait()[1]), flush=True)
"""


def test_every_script_starts_in_a_fresh_python(tmp_path):
    """The suite forks most plain `python script.py` runs from a warm process (tests/zygote.py) that
    has imported torch, torchvision and accelerate already: each script must also start on its own,
    importing everything it uses. Each runs in a child forked from a python that imported torch alone
    (one import of torch for all, 4 s of CPU a start; everything else each script imports itself)."""
    scripts = [*TRAINING, "evaluate"]
    pairs = [str(part) for s in scripts for part in (ROOT / "scripts" / f"{s}.py", tmp_path / f"{s}.log")]
    done = subprocess.run([sys.executable, "-c", FRESH, *pairs], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    for script, code in zip(scripts, done.stdout.split(), strict=True):
        output = (tmp_path / f"{script}.log").read_text()
        assert code == "0" and output.startswith("usage: "), f"{script}:\n{output}"
