"""Crash, restart, stop, resume: a killed worker costs the steps since the last checkpoint, nothing more,
and a stop signal costs nothing.

The contract, on 2 CPU processes: kill one worker with SIGKILL in the middle of an epoch, let the
launcher restart the job, and the final weights equal those of an uninterrupted run bit for bit
(test_make_restart.py, through `make ddp`; without restarts the job ends, below). SIGTERM or
SIGUSR1 (a scheduler's "stop now") to one process or to the launcher: every process stops after the
same step with a checkpoint and exit code 75, and --resume continues bit for bit.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import Forked, Processes, ROOT, assert_same_weights, bad_ends, execute, two_processes, user_env, weights

BIN = Path(sys.executable).parent
# 8 steps an epoch, 24 in all; a checkpoint every 4 steps, so step 12 is the middle of epoch 2. A
# batch of 32 (16 per process under DDP) at the lr of 0.05 (--lr 0.1 at half the reference batch):
# what these tests check does not depend on the batch, and each step costs half of one of 64.
FLAGS = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "100",
         "--model", "resnet20", "--batch-size", "32", "--reference-batch-size", "64", "--epochs", "3",
         "--checkpoint-every", "4", "--keep-checkpoints", "10", "--report-to", "none"]
SINGLE = [sys.executable, str(ROOT / "scripts" / "train_single.py"), *FLAGS, "--deterministic"]
STOPPED = 75  # common.parallel.step_guard.STOPPED_EXIT_CODE
STOP_LINE = re.compile(r"stopped by (.+?) after step (\d+): the training state is in (\S+); .*?\(exit code 75\)")


def env(tmp_path):
    return user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))


def accelerate(*launch_args, script="train_ddp.py"):
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
            "--num_processes", "2", *launch_args, str(ROOT / "scripts" / script), *FLAGS]


def wait_for(process, checkpoint: Path, timeout=180):
    """Return as soon as ``checkpoint`` exists, while ``process`` still runs."""
    deadline = time.time() + timeout
    while not checkpoint.exists():
        assert process.poll() is None, "the job ended before the checkpoint to signal after"
        assert time.time() < deadline, f"{checkpoint} never appeared"
        time.sleep(0.05)


def kill_worker_after(process, checkpoint: Path, local_rank: str, timeout=180, signum=signal.SIGKILL):
    """Send ``signum`` to the worker with ``local_rank`` as soon as ``checkpoint`` exists; returns its pid."""
    wait_for(process, checkpoint, timeout)
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "train_" in " ".join(child.cmdline()) and child.environ().get("LOCAL_RANK") == local_rank:
                child.send_signal(signum)
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no worker to kill")


def stopped_at(output: str, out: Path, signal_name: str, listed: list[str] | None = None) -> int:
    """The step of the one stop line in ``output``, checked: named ``signal_name``, pointing at its
    checkpoint, no final weights in ``out`` (``listed``: what it held when the run stopped, for a
    run that has been resumed since)."""
    lines = STOP_LINE.findall(output)
    assert len(lines) == 1, output[-3000:]  # one line for the job, from the main process
    name, step, checkpoint = lines[0][0], int(lines[0][1]), Path(lines[0][2])
    assert name == signal_name and 4 < step < 12, lines  # the resumed runs go on to step 12
    assert checkpoint == out / "checkpoints" / f"step_{step:08d}" and (checkpoint / "checkpoint.json").is_file()
    assert "model.safetensors" not in (listing(out) if listed is None else listed)
    return step


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference the launched runs must meet bit for bit: 2 processes started as torchrun starts
    them, forked warm (tests/helpers.py's Processes)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    two_processes("train_ddp.py", *FLAGS, "--output-dir", out, cwd=out.parent)
    return out


def single_env(tmp_path) -> dict:
    return user_env(CIFAR_CACHE_DIR=str(tmp_path / ".cache"))


def run_single(tmp_path, *extra):
    """train_single.py with FLAGS to its end, no signal sent to it (forked from the zygote)."""
    done = execute([*SINGLE, *map(str, extra)], cwd=ROOT, env=single_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory):
    """An uninterrupted train_single run: the reference for the single-process stops and kills."""
    out = tmp_path_factory.mktemp("single") / "reference"
    run_single(tmp_path_factory.getbasetemp(), "--output-dir", out)
    return out


def test_without_restarts_a_killed_worker_ends_the_job(tmp_path):
    """Negative control: the kill is real, and the job fails fast, naming the rank, instead of hanging."""
    out = tmp_path / "run"
    process = Forked([*accelerate(), "--output-dir", out], ROOT, env(tmp_path), merged=True)  # the launcher warm
    pid = kill_worker_after(process, out / "checkpoints" / "step_00000004", local_rank="1")
    start = time.time()
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0 and time.time() - start < 60, output
    assert f"pid: {pid}" in output and "rank      : 1" in output
    # the killed one's signal, and nothing else: rank 0 says once that it lost it, and exits 1
    assert bad_ends(output) == ["a worker ended by signal -9"], output[-3000:]
    assert len(re.findall(r"error: process 0 lost another process of the job", output)) == 1, output[-3000:]
    assert not (out / "model.safetensors").exists()
    assert (out / "checkpoints" / "step_00000004").is_dir()  # the work up to the last checkpoint stays


# ----------------------------------------------------------------------------------- stop signals
# One run of each script is interrupted twice and finished, and the tests below read it. A stop is
# checked against the uninterrupted run's step-12 checkpoint (both keep all of theirs), the second
# interruption and the resume by hand that ends the run against its final weights.


def sigterm_after_step_4(process, out):
    """SIGTERM ``process``, a run into ``out``, once the step-4 checkpoint exists: the process, its
    output, the seconds from the signal to its exit, and what ``out`` then holds."""
    wait_for(process, out / "checkpoints" / "step_00000004")
    sent = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    output = "".join(part or "" for part in process.communicate(timeout=120))
    return process, output, time.perf_counter() - sent, listing(out)


@pytest.fixture(scope="module")
def single_interrupted(tmp_path_factory):
    """train_single.py SIGTERMed once its step-4 checkpoint exists (it saves the step it is at and
    exits); --resume, SIGKILLed once the step-12 checkpoint exists (mid-epoch 2, nothing saved after
    it); --resume again, by hand, to the end."""
    tmp_path = tmp_path_factory.mktemp("single-interrupted")
    out = tmp_path / "run"
    stop = sigterm_after_step_4(Forked([*SINGLE, "--output-dir", out], ROOT, single_env(tmp_path)), out)
    process = Forked([*SINGLE, "--output-dir", out, "--resume"], ROOT, single_env(tmp_path))
    wait_for(process, out / "checkpoints" / "step_00000012")
    process.kill()
    resumed = "".join(process.communicate(timeout=60))
    killed = listing(out)
    done = run_single(tmp_path, "--output-dir", out, "--resume")
    return {"out": out, "stop": stop, "resumed": resumed, "killed": killed, "finished": done}


def test_single_stops_on_sigterm_and_resumes_bit_for_bit(single_interrupted, single_reference):
    out = single_interrupted["out"]
    process, output, seconds, listed = single_interrupted["stop"]
    print(f"\ntrain_single: SIGTERM to exit {seconds:.1f} s")
    assert process.returncode == STOPPED and seconds < 60, output[-3000:]
    step = stopped_at(output, out, "SIGTERM", listed)
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in single_interrupted["resumed"]
    assert_same_weights(out / "checkpoints" / "step_00000012", single_reference / "checkpoints" / "step_00000012")


def test_single_killed_and_resumed_by_hand(single_interrupted, single_reference):
    out = single_interrupted["out"]
    assert "model.safetensors" not in single_interrupted["killed"]
    assert f"resumed from {out / 'checkpoints' / 'step_00000012'}" in single_interrupted["finished"].stdout
    assert_same_weights(out, single_reference)


@pytest.fixture(scope="module")
def ddp_interrupted(tmp_path_factory):
    """train_ddp.py on 2 processes, SIGTERM to the launcher once the step-4 checkpoint exists; --resume
    with --max-steps 13, which stops inside epoch 2; --resume again, by hand, to the end."""
    tmp_path = tmp_path_factory.mktemp("ddp-interrupted")
    out = tmp_path / "run"
    stop = sigterm_after_step_4(Forked([*accelerate(), "--output-dir", out], ROOT, env(tmp_path), merged=True), out)
    # The resumes, by hand: 2 processes started as torchrun starts them, forked warm
    resumed = two_processes("train_ddp.py", *FLAGS, "--output-dir", out, "--resume", "--max-steps", "13",
                            cwd=tmp_path)
    done = two_processes("train_ddp.py", *FLAGS, "--output-dir", out, "--resume", cwd=tmp_path)
    return {"out": out, "stop": stop, "resumed": resumed, "finished": done}


def test_ddp_stops_on_sigterm_to_the_launcher_and_resumes_bit_for_bit(ddp_interrupted, uninterrupted):
    """The launcher passes SIGTERM on to its workers, which stop together; the launcher itself then
    exits 1 or 143 (LAUNCHER_STOPPED), not 75."""
    out = ddp_interrupted["out"]
    process, output, seconds, listed = ddp_interrupted["stop"]
    print(f"\ntrain_ddp, 2 processes: SIGTERM to the launcher to its exit {seconds:.1f} s")
    assert process.returncode not in (0, STOPPED) and seconds < 60, output[-3000:]
    assert "closing signal SIGTERM" in output  # passed on by the launcher, not sent to the workers by us
    step = stopped_at(output, out, "SIGTERM", listed)
    resumed = ddp_interrupted["resumed"]
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in resumed.stdout
    assert_same_weights(out / "checkpoints" / "step_00000012", uninterrupted / "checkpoints" / "step_00000012")


def test_ddp_stop_and_resume_by_hand(ddp_interrupted, uninterrupted):
    """Stopped by --max-steps 13 inside epoch 2, continued with --resume: the uninterrupted run's weights."""
    out, done = ddp_interrupted["out"], ddp_interrupted["finished"]
    assert "resumed from" in done.stdout and "step 13" in done.stdout
    assert_same_weights(out, uninterrupted)


# The launcher of one process killed: SIGKILL passes nothing on, so the training process asks the
# kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG). The orphan is adopted by this child
# subreaper (PR_SET_CHILD_SUBREAPER), which reads how it ended, as the launcher would have.
ORPHAN_WATCHER = """import ctypes, json, os, signal, subprocess, sys, time
import psutil
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
report, checkpoint, log, command = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with open(log, "w") as output:
    launcher = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
deadline, found = time.time() + 180, {}
while not os.path.isdir(checkpoint) and launcher.poll() is None and time.time() < deadline:
    time.sleep(0.05)
trainers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "train_single" in " ".join(p.cmdline())]
if launcher.poll() is None and len(trainers) == 1:
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 120
    while "status" not in found and time.time() < deadline:
        pid, status = os.waitpid(trainers[0].pid, os.WNOHANG)
        if pid:
            found["status"] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    if "status" not in found:
        trainers[0].kill()
found.update(launcher=launcher.returncode, trainers=len(trainers))
open(report, "w").write(json.dumps(found))
"""


def test_killing_the_launcher_of_one_process_stops_the_training_process_with_a_checkpoint(tmp_path):
    """`accelerate launch --num_processes 1` killed with SIGKILL: its training process gets SIGTERM,
    saves the step and exits 75 (README, "Preemption and clusters")."""
    out, report, log = tmp_path / "run", tmp_path / "report.json", tmp_path / "train.log"
    launch = [str(BIN / "accelerate"), "launch", "--num_processes", "1", str(ROOT / "scripts" / "train_single.py"),
              *FLAGS, "--output-dir", str(out)]
    watcher = [sys.executable, "-c", ORPHAN_WATCHER, report, out / "checkpoints" / "step_00000004", log, *launch]
    subprocess.run(watcher, cwd=ROOT, env=env(tmp_path), timeout=360, check=True)
    found, output = json.loads(report.read_text()), log.read_text()
    assert found == {"status": STOPPED, "launcher": -signal.SIGKILL, "trainers": 1}, (found, output[-3000:])
    stopped_at(output, out, "SIGTERM")


def test_a_train_single_checkpoint_resumes_under_ddp_as_its_continuation(tmp_path):
    """train_single's step-4 checkpoint resumed by 2-process DDP (BatchNorm frozen and augmentation
    off, as tests/test_train_ddp.py compares them) ends where train_single itself went on to: the
    weights, the momentum and the schedule were taken over, the data order too."""
    agree = ["--no-augment", "--lr", "0.001", "--max-steps", "8"]
    single, resumed = tmp_path / "single", tmp_path / "resumed"
    frozen_single = [sys.executable, str(ROOT / "tests" / "frozen_bn.py"), str(ROOT / "scripts" / "train_single.py"),
                     *FLAGS, *agree, "--output-dir", str(single)]
    done = execute(frozen_single, cwd=ROOT, env=user_env(CIFAR_CACHE_DIR=str(tmp_path / ".cache")), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    done = two_processes(ROOT / "tests" / "frozen_bn.py", ROOT / "scripts" / "train_ddp.py", *FLAGS, *agree,
                         "--resume", single / "checkpoints" / "step_00000004", "--output-dir", resumed, cwd=tmp_path)
    assert f"resumed from {single / 'checkpoints' / 'step_00000004'}" in done.stdout and "on 2 x cpu" in done.stdout
    ours, theirs = weights(resumed), weights(single)
    assert ours.keys() == theirs.keys()
    difference = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)
    assert difference < 1e-5, difference  # 2-process DDP against one process: float32 rounding only


def test_sigusr1_to_one_worker_stops_both_after_the_same_step(tmp_path):
    """The signal to one process only, as a scheduler may send it: the processes forked as torchrun
    starts them (what the launcher does with a stop signal is tested above and below)."""
    out = tmp_path / "run"
    job = Processes("train_ddp.py", *FLAGS, "--output-dir", out, cwd=tmp_path)
    wait_for(job.procs[1], out / "checkpoints" / "step_00000004")
    job.procs[1].send_signal(signal.SIGUSR1)
    assert job.wait(timeout=120) == [STOPPED, STOPPED] and bad_ends(job.output()) == [], job.output()[-3000:]
    # Rank 0 got no signal and says so; it stopped because rank 1 did, after the same step.
    step = stopped_at(job.output(), out, "a stop signal to another process")
    # One checkpoint after step 4, written by both processes together.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", f"step_{step:08d}"]
    saved = {p.name for p in (out / "checkpoints" / f"step_{step:08d}").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "checkpoint.json"} <= saved, saved


def test_a_nan_loss_stops_every_process_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    job = Processes("train_ddp.py", *FLAGS, "--lr", "1e6", "--checkpoint-every", "2", "--output-dir", out,
                    cwd=tmp_path)
    assert job.wait(timeout=300) == [1, 1] and bad_ends(job.output()) == [], job.output()
    # One line for the job, from the main process (it may follow a progress bar on its line).
    lines = re.findall(r"error: the loss is .*? with a lower --lr.*", job.stderr(0))
    assert len(lines) == 1 and "error:" not in job.stderr(1), job.output()
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    newest = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
    named = re.findall(r"checkpoints/step_(\d+)", lines[0])  # none: start again
    assert newest < step and all(int(n) <= newest for n in named), lines[0]
    assert not (out / "model.safetensors").exists()


def test_a_stalled_worker_fails_the_job_after_the_dist_timeout(tmp_path):
    """Rank 1 stops answering after 3 steps; rank 0 waits --dist-timeout (10 s here, 600 by default)
    in its next all-reduce, fails, and the launcher ends the job instead of letting it hang."""
    cmd = [*accelerate(), "--dist-timeout", "10", "--output-dir", str(tmp_path / "run")]
    cmd.insert(cmd.index(str(ROOT / "scripts" / "train_ddp.py")), str(ROOT / "tests" / "stall_rank.py"))
    start = time.perf_counter()
    done = execute(cmd, cwd=ROOT, env=env(tmp_path), timeout=300)
    elapsed = time.perf_counter() - start
    assert done.returncode != 0
    # one line, from rank 0, with gloo's own words and the wait that --dist-timeout set; rank 1, still
    # stalled, is ended by the failure watch (exit 1), not by the launcher's signals
    lines = re.findall(r"error: .*", done.stderr)
    assert len(lines) == 1 and re.fullmatch(
        r"error: process 0 waited --dist-timeout in a collective for another process that never came \(.*Timed "
        r"out waiting 10000ms for (recv|send) operation to complete\): it stalled .*", lines[0]), done.stderr[-3000:]
    assert bad_ends(done.stderr) == [], done.stderr[-3000:]
    assert elapsed < 200, f"the job took {elapsed:.0f} s to fail"  # start-up + 10 s, not the 3,600 s stall


LISTENER = """import os, pathlib, signal, sys, time
# A worker that records the stop signals it gets; it ends when one comes or its launcher dies.
folder, parent, got = pathlib.Path(sys.argv[1]), os.getppid(), []
for stop in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(stop, lambda signum, frame: got.append(signal.Signals(signum).name))
(folder / f"ready-{os.environ['RANK']}").touch()
deadline = time.time() + 60
while not got and os.getppid() == parent and time.time() < deadline:
    time.sleep(0.02)
(folder / f"got-{os.environ['RANK']}").write_text(",".join(got))
"""


# How torch's launcher ends after passing a stop signal on to its workers (whatever their 75): torchrun,
# and accelerate launch before Accelerate 1.16, let torch's SignalException out (a traceback, exit 1);
# accelerate launch from 1.16 on catches it and exits 128 + the signal's number (_run_torchrun in
# accelerate/commands/launch.py). Neither is a death by the signal, which Python reads as -signum.
LAUNCHER_STOPPED = (1, 128 + signal.SIGUSR1)


@pytest.mark.parametrize("variable", ["PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"])
def test_the_launcher_passes_sigusr1_on_only_through_pet_signals_to_handle(variable, tmp_path):
    """What slurm_2nodes.sh relies on: torch's launcher (here under accelerate launch) passes SIGUSR1 on
    to its workers and then exits (1 or 138, by Accelerate's version) only when PET_SIGNALS_TO_HANDLE
    (torchrun's --signals-to-handle) names it; otherwise SIGUSR1 kills it before its workers hear of it.
    The launcher overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with that list, so setting that one does
    nothing, as leaving the variable out or misspelling it does nothing."""
    (tmp_path / "listener.py").write_text(LISTENER)
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "4gpu.yaml"),
           "--num_processes", "2", str(tmp_path / "listener.py"), str(tmp_path)]
    environment = {**env(tmp_path), variable: "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    process = Forked(cmd, tmp_path, environment, merged=True)
    deadline = time.time() + 60
    while not all((tmp_path / f"ready-{rank}").exists() for rank in "01"):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.02)
    workers = sorted(child.pid for child in psutil.Process(process.pid).children())
    process.send_signal(signal.SIGUSR1)
    output = process.communicate(timeout=60)[0]
    deadline = time.time() + 10  # workers orphaned by a killed launcher notice it within 20 ms
    while not all((tmp_path / f"got-{rank}").exists() for rank in "01") and time.time() < deadline:
        time.sleep(0.02)
    got = [(tmp_path / f"got-{rank}").read_text() for rank in "01"]
    passed_on = sorted(int(pid) for pid in re.findall(r"Sending process (\d+) closing signal SIGUSR1", output))
    print(f"\n{variable}: the launcher's exit {process.returncode}, its workers got {got}")
    if variable == "PET_SIGNALS_TO_HANDLE":
        # passed on by the launcher itself to each of its workers, which got it, then an exit of the
        # launcher's own: a launcher killed first (-SIGUSR1) leaves its workers nothing to record
        assert got == ["SIGUSR1", "SIGUSR1"] and passed_on == workers, output
        assert process.returncode in LAUNCHER_STOPPED, output
    else:
        assert got == ["", ""] and passed_on == [] and process.returncode == -signal.SIGUSR1, output


# --------------------------------------------------------------------------------------- SLURM
# accelerate_configs/slurm_2nodes.sh run as sbatch would start it, with srun, scontrol and accelerate
# replaced by stand-ins on PATH: no training, only what the script passes on and decides. The real
# thing, under sbatch on a two-node SLURM, is tests/test_cluster_slurm.py (make test-cluster).

FAKE_SRUN = """#!/bin/bash
# srun on one node: runs its task and passes SIGUSR1 on to it, as srun does to its step's processes.
"$@" &
task=$!
trap 'kill -USR1 "$task"' USR1
status=0
wait "$task" || status=$?
while kill -0 "$task" 2>/dev/null; do status=0; wait "$task" || status=$?; done
exit "$status"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
    show) printf 'node1\\nnode2\\n' ;;
    *) echo "$*" >> "$FAKE_LOG/scontrol" ;;
esac
"""
# The launcher: records what it got. FAKE_OUTCOME "finish" writes the final weights and exits 0, "fail"
# exits 1 at once; "stop" and "finish-late" run until a signal and then exit FAKE_STOP_EXIT (1 or 138),
# as torch's launcher does after passing a signal on to its workers (LAUNCHER_STOPPED), "finish-late"
# with the final weights written.
FAKE_ACCELERATE = """#!{python}
import json, os, pathlib, signal, sys, time
log, args, got = pathlib.Path(os.environ["FAKE_LOG"]), sys.argv[1:], []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signal.Signals(signum).name))
(log / "started").touch()
outcome, deadline = os.environ["FAKE_OUTCOME"], time.time() + 60
while outcome in ("stop", "finish-late") and not got and time.time() < deadline:
    time.sleep(0.02)
if outcome.startswith("finish"):
    output_dir = pathlib.Path(args[args.index("--output-dir") + 1])
    output_dir.mkdir(parents=True)
    (output_dir / "model.safetensors").touch()
names = ("PET_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
(log / "accelerate.json").write_text(json.dumps({{"args": args, "signals": got,
                                                 "env": {{name: os.environ.get(name) for name in names}}}}))
sys.exit({{"finish": 0, "fail": 1}}.get(outcome, int(os.environ["FAKE_STOP_EXIT"])))
"""


@pytest.fixture(scope="module")
def fake_slurm(tmp_path_factory):
    """A folder of stand-ins for srun, scontrol and accelerate, to put first on PATH."""
    folder = tmp_path_factory.mktemp("fake-slurm")
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("accelerate", FAKE_ACCELERATE.format(python=sys.executable))]:
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def sbatch(fake_slurm, job: Path, outcome: str, job_id="4242", restart_count=0, usr1=False, stop_exit=1):
    """Run the SLURM script in ``job`` (its working folder) as the batch shell of job ``job_id``; with
    ``usr1``, SIGUSR1 to the shell once the launcher runs, as --signal=B:USR1 sends it, and the launcher
    then exits ``stop_exit``. Returns the exit code, the output, what the launcher recorded and what
    scontrol was asked."""
    job.mkdir()
    environment = {**os.environ, "PATH": f"{fake_slurm}:{os.environ['PATH']}", "FAKE_LOG": str(job),
                   "FAKE_OUTCOME": outcome, "FAKE_STOP_EXIT": str(stop_exit), "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "train-ddp",
                   "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
                   "SLURM_RESTART_COUNT": str(restart_count)}
    environment.pop("OUTPUT_DIR", None)
    process = subprocess.Popen(["bash", str(ROOT / "accelerate_configs" / "slurm_2nodes.sh"), "--model", "resnet50"],
                               cwd=job, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if usr1:
        deadline = time.time() + 30
        while not (job / "started").exists():
            assert process.poll() is None and time.time() < deadline, process.communicate()[0]
            time.sleep(0.02)
        process.send_signal(signal.SIGUSR1)
    output = process.communicate(timeout=60)[0]
    launcher = json.loads((job / "accelerate.json").read_text())
    asked = (job / "scontrol").read_text().splitlines() if (job / "scontrol").exists() else []
    return process.returncode, output, launcher, asked


def sbatch_option(name: str) -> str:
    script = (ROOT / "accelerate_configs" / "slurm_2nodes.sh").read_text()
    (value,) = re.findall(rf"^#SBATCH --{name}(?:=(\S+))?$", script, re.MULTILINE)
    return value


# Stays beside tests/test_cluster_slurm.py's real SLURM, which runs only the installed Accelerate's exit code, on CPUs.
@pytest.mark.parametrize("stop_exit", LAUNCHER_STOPPED)
def test_the_slurm_script_saves_before_the_time_limit_and_requeues(stop_exit, fake_slurm, tmp_path):
    """Whichever way the launcher ends after passing SIGUSR1 on (LAUNCHER_STOPPED), the job is requeued
    and ends with that exit code."""
    assert sbatch_option("requeue") == "" and sbatch_option("open-mode") == "append"
    warning = sbatch_option("signal")  # B:USR1@seconds: to the batch shell, before the time limit
    assert re.fullmatch(r"B:USR1@\d+", warning), warning

    code, output, launcher, asked = sbatch(fake_slurm, tmp_path / "first", "stop", usr1=True, stop_exit=stop_exit)
    assert launcher["signals"] == ["SIGUSR1"], output  # the shell passed it on, through srun
    assert asked == ["requeue 4242"] and code == stop_exit, output
    # The launcher passes SIGUSR1 on to its workers (TORCHELASTIC_SIGNALS_TO_HANDLE would be overwritten)
    # and gives them less time to save than the warning leaves before the time limit.
    assert "SIGUSR1" in launcher["env"]["PET_SIGNALS_TO_HANDLE"].split(",")
    assert 30 < int(launcher["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < int(warning.split("@")[1])
    args = launcher["args"]
    assert args[:3] == ["launch", "--config_file", "accelerate_configs/2nodes_4gpu.yaml"]
    assert args[args.index("--machine_rank") + 1] == "0" and args[args.index("--main_process_ip") + 1] == "node1"
    assert args[-2:] == ["--model", "resnet50"]

    # The requeued job: same id, so the same run folder, where it finds its checkpoints.
    _, _, requeued, _ = sbatch(fake_slurm, tmp_path / "requeued", "finish", restart_count=1)
    folder = args[args.index("--output-dir") + 1]
    assert folder == "runs/train-ddp-4242" and requeued["args"] == args


# Stays: a real SLURM's signal, on slurmctld's 30 s tick, cannot be made to land just after the final weights.
def test_the_slurm_script_requeues_neither_a_finished_nor_a_failed_job(fake_slurm, tmp_path):
    code, output, launcher, asked = sbatch(fake_slurm, tmp_path / "finished", "finish")
    assert (code, asked, launcher["signals"]) == (0, [], []), output
    code, output, _, asked = sbatch(fake_slurm, tmp_path / "failed", "fail")  # a crash: no signal came
    assert (code, asked) == (1, []), output
    # The warning came, but the run finished meanwhile (final weights): nothing to continue.
    code, output, launcher, asked = sbatch(fake_slurm, tmp_path / "finished-late", "finish-late", usr1=True)
    assert (code, asked, launcher["signals"]) == (1, [], ["SIGUSR1"]), output
