import pytest
from helpers import TINY, run


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (make gpu-check runs them)")


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """One uninterrupted 3-epoch train_single run, tracked offline, shared by several test files."""
    out = tmp_path_factory.mktemp("full") / "run"
    done = run("train_single.py", *TINY, "--log-every", 8, "--output-dir", out)
    return out, done
