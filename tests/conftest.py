import os
from pathlib import Path

import pytest
from helpers import TINY, run

# `make test` runs the suite on 2 pytest-xdist workers: much of a test's time is a process starting,
# importing torch or waiting for a timeout, which leaves the other core idle. An OpenMP thread that
# waits for its sibling then sleeps instead of spinning: with the other worker's process on a core,
# the spinning took a tiny run 10x longer.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The files, and the tests of other files, that launch several processes: they meet at accelerate
# launch's and torchrun's default port (29500), where a second job at the same time finds it taken
# (accelerate then moves to another port, with a warning). They run one at a time, on one worker.
LAUNCHING_FILES = {"test_benchmark", "test_copy_set", "test_ema", "test_fault_tolerance", "test_faults_checkpoints",
                   "test_faults_data", "test_faults_signals", "test_fine_tune", "test_gpu", "test_make_restart",
                   "test_run_folder", "test_train_ddp", "test_train_fsdp", "test_train_single", "test_workers"}
LAUNCHING_TESTS = {"test_a_bad_launch_gets_one_line"}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (make gpu-check runs them)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by file (a file's module fixtures run once), with the launching tests
    together in one unit of work."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file, _, test = nodeid.partition("::")
            launches = Path(file).stem in LAUNCHING_FILES or test.partition("[")[0] in LAUNCHING_TESTS
            return "launching" if launches else file

    return Scheduler(config, log)


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """One uninterrupted 3-epoch train_single run, tracked offline, shared by several test files."""
    out = tmp_path_factory.mktemp("full") / "run"
    done = run("train_single.py", *TINY, "--log-every", 8, "--output-dir", out)
    return out, done
