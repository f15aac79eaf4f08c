"""pytest plugin of scripts/gpu_check.py (`-p bench.gpu_pytest`): each check's outcome written as it
ends, so a check cut short still has its report, and no check started that the time left cannot
hold by its estimate (bench/gpu_plan.py).

Environment (set by gpu_check.py): GPU_CHECK_OUTCOMES, the JSON-lines file to append to;
GPU_CHECK_DEADLINE, the time (epoch seconds) by which the checks must end; GPU_CHECK_ESTIMATES,
{test name: estimated seconds} as JSON.
"""

import json
import os
import re
import time

import pytest

_phases: dict[str, dict] = {}


def pytest_runtest_setup(item):
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", "inf"))
    need = json.loads(os.environ.get("GPU_CHECK_ESTIMATES", "{}")).get(item.name, 0)
    left = deadline - time.time()
    if need > left:
        pytest.skip(f"not run: out of time ({need} s estimated, {max(left, 0):.0f} s left)")


# What ended a failed launch, in the order looked for below its message's first line: a script's
# one line, a signal the launcher names (a crash), an exception with its text, a worker's as torch
# prints it once its process group exists ("[rank1]: RuntimeError: ..."), not the launcher's own
# report that a worker failed (ChildFailedError, CalledProcessError).
RANK = r"^(?:\[rank\d+\]:\s*)?"
CAUSES = [re.compile(RANK + r"(error: .*)"), re.compile(r"(Signal \d+ \(\w+\).*)"),
          re.compile(RANK + r"((?![\w.]*(?:ChildFailedError|CalledProcessError))"
                            r"[\w.]*(?:Error|Exception): .+)")]


def _message(report) -> str:
    """A skip's reason; a failure's first line and, from the lines below it (a launch's output),
    the last that says what ended it."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    first, *rest = [line.strip() for line in text.strip().splitlines()] or [""]
    cause = next((found[-1] for pattern in CAUSES
                  if (found := [m.group(1) for line in rest if (m := pattern.search(line))])), None)
    return (first if cause is None else f"{first} ... {cause}")[:500]


def pytest_runtest_logreport(report):
    """setup, call and teardown of each test: its status is the first phase that did not pass."""
    outcome = _phases.setdefault(report.nodeid, {"status": "passed", "message": "", "seconds": 0.0})
    outcome["seconds"] += report.duration
    if outcome["status"] == "passed" and not report.passed:
        outcome["status"] = ("skipped" if report.skipped else
                             "failed" if report.when == "call" else "error")
        outcome["message"] = _message(report)
    if report.when == "teardown" and os.environ.get("GPU_CHECK_OUTCOMES"):
        name = report.nodeid.split("::")[-1]
        with open(os.environ["GPU_CHECK_OUTCOMES"], "a") as f:
            f.write(json.dumps({"name": name, **_phases.pop(report.nodeid),
                                "ended": time.time()}) + "\n")
