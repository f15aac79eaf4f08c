"""A warm start for the scripts' plain `python scripts/X.py` runs in the tests, and for the console
scripts that start them (`accelerate launch`, `torchrun`: the processes they start start cold) or
collect tests (`pytest`).

Every script spends about 7 of its first 8 seconds on 2 CPU cores importing torch, torchvision and
accelerate, which is most of what a test of a bad flag or a short run costs. This process imports
them once, before any tensor work (so no thread pool exists yet), then forks one child per run. The
child takes the run's environment, folder, arguments and output files, and runs the script as
`python script.py` would: as __main__, with its folder first on sys.path, its atexit functions run
at the end, its exit status that of SystemExit, an uncaught exception reported through
sys.excepthook (the scripts install their own) with status 1, an uncaught KeyboardInterrupt ending
it by SIGINT.

The Hub, datasets and wandb are not imported here, so a child reads their settings from its own
environment as a fresh process would. What a fork cannot give a child is its own string hash
seed (drawn once, by the zygote), so set and dict orders that hang on it repeat from run to run;
the scripts' random numbers do not (common.data.transform.sample_seed hashes ints, which is not salted).
What python, torch and accelerate read while starting (PYTHON*, TORCH_LOGS, OMP_NUM_THREADS,
TMPDIR ...) is the zygote's: helpers.execute starts a run that sets those differently cold.

Protocol: one JSON request a line on stdin ({argv, env, cwd, stdout, stderr}; stderr the same file as
stdout merges the two); for each, a line {"pid": N} when the child starts and a line
{"returncode": N} when it ends, as subprocess reports it.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import threading

import accelerate  # noqa: F401
import torch  # noqa: F401
import torchvision  # noqa: F401
import torchvision.transforms.v2  # noqa: F401 - the scripts' data path: 0.2 s of each run


def run_script(request: dict) -> None:
    """In the forked child: become `python argv[0] argv[1:]` and never return."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
            if fd == 2 and path == request["stdout"]:  # stderr into stdout, as Popen's stderr=STDOUT
                os.dup2(1, 2)
                continue
            opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = exit_code(e.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as python at exit: wait for non-daemon threads (thread pools' work)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code == -signal.SIGINT:  # as CPython ends on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def exit_code(code) -> int:
    """The status CPython gives sys.exit(code): None is 0, an int is itself, anything else is
    printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_script(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
