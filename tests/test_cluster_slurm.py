"""accelerate_configs/slurm_2nodes.sh under a real SLURM: a two-node cluster on this machine
(accelerate_configs/slurm_cluster.py: slurmctld and a slurmd per node, each node a network
namespace), the script submitted with sbatch as a user submits it, with --gpus-per-node=0 (one
process a node, on the CPU). What the script's comments promise, checked against what SLURM does:
the time limit's signal saves every process and requeues the job, which continues from its
checkpoint by itself (same job id, SLURM_RESTART_COUNT=1) to the weights of an uninterrupted run;
scancel saves and ends the job without a requeue; a node set DOWN requeues the job, which continues
from the checkpoint its processes saved. Every job: no traceback or C++ abort, every process's end
accounted for, nothing of it left on any node.

Marked `cluster` (make test-cluster runs it; make test leaves it out): it needs root, network
namespaces and Debian's slurmd, slurmctld, slurm-client and munge, and skips, saying which is
missing, without them. 2.5 to 3.5 minutes on 2 cores, the busier the longer. Run with -s for the
time limit's timeline.
"""

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import ROOT, Processes, assert_same_weights, bad_ends, user_env
from test_fault_tolerance import LAUNCHER_STOPPED, STOP_LINE

sys.path.insert(0, str(ROOT / "accelerate_configs"))
import nodes  # noqa: E402
import slurm_cluster  # noqa: E402

WHY_NOT = slurm_cluster.why_not()
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no SLURM cluster here: {WHY_NOT}")]
BIN = Path(sys.executable).parent
# A cluster of the tests' own: a user's rehearsal cluster (mgcs-, /run/mgc-slurm) is left alone.
PREFIX, STATE = f"mgct{os.getpid()}", Path(f"/run/mgc-slurm-test-{os.getpid()}")  # another suite's beside
# 40 steps an epoch, 320 in all, a checkpoint every 16. The time limit's signal comes at
# slurmctld's check every 30 s, so the job must still train 30 s after its limit is shortened (at
# step 16): 320 steps took 40 s on 2 idle cores (8 a second), 60 to 100 s on busy ones.
FLAGS = ["--dataset", "synthetic", "--synthetic-train-size", "2560", "--synthetic-test-size", "100",
         "--model", "resnet20", "--batch-size", "64", "--reference-batch-size", "64", "--epochs", "8",
         "--checkpoint-every", "16", "--keep-checkpoints", "100", "--report-to", "none"]
STEPS = 320
UNDERWAY = 16  # the first checkpoint: every process trains
DAEMONS = {"munged", "slurmctld", "slurmscriptd", "slurmd"}
SRUN_END = re.compile(r"srun: error: (node\d+): task (\d+): ([^\r\n]+)")
LOG_TIME = re.compile(r"^\[(\S+)\] (.*)$")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE"}


@pytest.fixture(scope="module")
def cluster():
    """The cluster, up for the module and down at its end whatever happened."""
    slurm_cluster.up(2, STATE, PREFIX)
    try:
        yield STATE
    finally:
        slurm_cluster.down(STATE, PREFIX)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run the jobs must meet: the same flags on 2 processes of one machine, as
    torchrun starts them (forked warm, tests/helpers.py's Processes), started at once so that it
    trains while the first jobs wait; a function that waits for it and gives its folder."""
    out = tmp_path_factory.mktemp("reference") / "run"
    job = Processes("train_ddp.py", *FLAGS, "--output-dir", out, cwd=out.parent)

    def finished() -> Path:
        assert job.wait(600) == [0, 0], job.output()
        return out
    yield finished
    job.kill()


def client(*argv: str, check=True) -> str:
    """A SLURM client's output, run on node 1."""
    done = subprocess.run(slurm_cluster.command(1, list(argv), PREFIX), env=slurm_cluster.environ(STATE),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or not check, f"{argv}: {done.stdout}{done.stderr}"
    return done.stdout


def submit(tmp_path: Path, out: Path, *extra: str) -> str:
    """slurm_2nodes.sh submitted as a user submits it, from the project's root with the project's
    environment on PATH, its run folder in OUTPUT_DIR; its job id."""
    env = slurm_cluster.environ(STATE, user_env(
        WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"), OUTPUT_DIR=str(out),
        OMP_NUM_THREADS="1"))  # one thread a process, as torchrun gives the reference's: 2 cores
    env["PATH"] = f"{BIN}:{env['PATH']}"
    done = subprocess.run(slurm_cluster.command(1, [
        "sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1",
        f"--output={tmp_path}/job-%j.out", "accelerate_configs/slurm_2nodes.sh", *FLAGS, *extra], PREFIX),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().split(";")[0]


def job_record(job: str) -> dict[str, str]:
    """scontrol's record of the job (held MinJobAge after its end)."""
    return dict(re.findall(r"(\w+)=(\S*)", client("scontrol", "show", "job", "--oneliner", job)))


def output(tmp_path: Path, job: str) -> str:
    path = tmp_path / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""  # two nodes' progress bars interleave


def wait_until(condition, what: str, tmp_path: Path, job: str, timeout=300.0):
    """``condition()``'s value once it is true, polled; the job's record and output if never."""
    deadline = time.time() + timeout
    while not (value := condition()):
        if time.time() > deadline:
            raise AssertionError(f"job {job}: {what} not within {timeout:.0f} s: {job_record(job)}\n"
                                 f"{output(tmp_path, job)[-4000:]}")
        time.sleep(0.25)
    return value


def end_of(tmp_path: Path, job: str, timeout=300.0) -> dict[str, str]:
    """The job's record once it has ended, however."""
    return wait_until(lambda: (record := job_record(job))["JobState"] in ENDED and record, "the end", tmp_path, job,
                      timeout)


def state_is(job: str, *states: str, restarts: int | None = None):
    def check() -> bool:
        record = job_record(job)
        return record.get("JobState") in states and (
            restarts is None or record.get("Restarts") == str(restarts))
    return check


def left_on_nodes() -> dict[str, list[str]]:
    """What runs on each node besides SLURM's daemons: a job's processes."""
    found = {}
    for name in nodes.names(PREFIX):
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:  # it ended meanwhile
                continue
            if comm not in DAEMONS:
                found.setdefault(name, []).append(f"{pid} {comm}")
    return found


def assert_nothing_left(job: str) -> None:
    """No process of the job on any node (SIGKILL comes KillWait, 30 s, after SIGTERM)."""
    deadline = time.time() + 45
    while left := left_on_nodes():
        assert time.time() < deadline, f"job {job} left behind {left}"
        time.sleep(0.25)


def assert_gone_while_pending(job: str) -> None:
    """No process of the requeued job's last run on any node before it starts again."""
    while left := left_on_nodes():
        assert job_record(job)["JobState"] == "PENDING", f"job {job} started again beside its last run's {left}"
        time.sleep(0.25)


def assert_ended_well(said: str) -> None:
    """Every process ended by its own exit: no traceback, C++ abort or death by a signal."""
    assert not bad_ends(said) and "Traceback (most recent call last)" not in said, said[-4000:]


def task_ends(said: str) -> dict[str, str]:
    """How srun says each node's launcher ended, where it ended otherwise than with 0: `Exited with
    exit code N`, `Killed`, `Terminated` (a signal's death)."""
    return {f"{node} task {task}": how for node, task, how in SRUN_END.findall(said)}


def exited(*codes: int) -> set[str]:
    return {f"Exited with exit code {code}" for code in codes}


def stopped_at(said: str, signal_name: str, out: Path) -> int:
    """The one step every stop line of the job names, after ``signal_name``, checked: its checkpoint
    complete, with the state of both processes."""
    lines = STOP_LINE.findall(said)
    assert 1 <= len(lines) <= 2, said  # each node's main process says it once, if its output came through
    assert {(name, int(step)) for name, step, _ in lines} == {(signal_name, int(lines[0][1]))}, said
    assert not re.findall(r"^(?:error|warning): ", said, re.MULTILINE), said  # nothing else of ours
    step = int(lines[0][1])
    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    assert {Path(path) for _, _, path in lines} == {checkpoint}, lines
    assert {"checkpoint.json", "model.safetensors", "random_states_0.pkl", "random_states_1.pkl"} <= {
        p.name for p in checkpoint.iterdir()}, sorted(checkpoint.iterdir())
    return step


def completions(state: Path, job: str) -> list[str]:
    """The states jobcomp/filetxt recorded for the job, one for each end, a requeue's too."""
    log = state / "jobcomp.log"
    return re.findall(rf"^JobId={job} .*?JobState=(\S+)", log.read_text(), re.MULTILINE) if log.exists() else []


def events(state: Path, job: str) -> dict[str, list[float]]:
    """When slurmctld's log says each thing happened to the job (epoch seconds)."""
    patterns = {"submitted": "_slurm_rpc_submit_batch_job: JobId={} ", "started": "sched: Allocate JobId={} ",
                "limit": "setting time_limit to \\d+ for JobId={}$", "signal": "warning signal 10 to JobId={}$",
                "requeued": "Requeuing JobId={}$", "ended": "_job_complete: JobId={} done$"}
    found = {name: [] for name in patterns}
    for line in (state / "slurmctld.log").read_text().splitlines():
        if (match := LOG_TIME.match(line)) is None:
            continue
        for name, pattern in patterns.items():
            if re.search(pattern.format(job), match.group(2)):
                found[name].append(datetime.fromisoformat(match.group(1)).timestamp())
    return found


# ------------------------------------------------------------------------------- the time limit

def test_the_time_limit_s_signal_saves_every_process_and_the_requeued_job_continues_by_itself(
        cluster, reference, tmp_path):
    """The job as submitted (the script's --time=02:00:00 and --signal=B:USR1@300), its limit then
    shortened to 5 minutes once it trains (scontrol update TimeLimit=5), as if it had run 1 h 55 min:
    slurmctld, which checks the limits every 30 s (PERIODIC_TIMEOUT), finds it within 300 s of its
    end at its next check and sends SIGUSR1 to the batch shell. A one-minute --time and
    --signal=B:USR1@5 at submission would put the signal anywhere from 25 to 55 s after the start:
    before the training processes have their handlers on a busy machine, after the end on an idle
    one. The shell passes the signal
    on through srun; each node's launcher passes it to its process; both save the same step and exit
    75, the launchers 1 or 138 by Accelerate's version; the shell requeues the job. While the job
    waits (the begin time SLURM gives a requeued job, cred_expire + 1 s), its limit goes back to 2
    hours, so that it finishes in one more run instead of being stopped each minute. It starts again
    with the same id, in the same run folder, continues from the checkpoint without --resume
    (SLURM_RESTART_COUNT=1) and ends with the weights of the uninterrupted run, bit for bit."""
    out = tmp_path / "run"
    job = submit(tmp_path, out)
    wait_until((out / "checkpoints" / f"step_{UNDERWAY:08d}" / "checkpoint.json").exists, "a first checkpoint",
               tmp_path, job)
    client("scontrol", "update", f"JobId={job}", "TimeLimit=5")
    wait_until(state_is(job, "PENDING", restarts=1), "the requeue", tmp_path, job, timeout=120)
    client("scontrol", "update", f"JobId={job}", "TimeLimit=2:00:00")
    assert_gone_while_pending(job)
    first = output(tmp_path, job)  # the first run's, all of it: its processes have ended
    record = end_of(tmp_path, job)
    said = output(tmp_path, job)
    marks = timeline(cluster, job, out, first)
    print(f"\njob {job}, s from its submission: "
          + ", ".join(f"{name} {'-' if when is None else f'{when:.1f}'}" for name, when in marks))

    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), record
    assert completions(cluster, job) == ["PENDING", "COMPLETED"]  # the requeue's record, the end's
    step = stopped_at(first, "SIGUSR1", out)
    assert UNDERWAY <= step < STEPS
    # the shell's signal, passed on by each node's launcher to its process; each launcher's own end
    assert first.count("closing signal SIGUSR1") == 2, first
    ends = task_ends(first)
    assert set(ends) == {"node1 task 0", "node2 task 1"} and set(ends.values()) <= exited(*LAUNCHER_STOPPED), ends
    assert first.count(f"stopped before the time limit: requeued, to continue from the checkpoint in {out}") == 1
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'} at epoch" in said[len(first):]
    assert said.count(f"done: step {STEPS},") == 2, said[-3000:]  # each node's main process
    assert not task_ends(said[len(first):]), said[len(first):]
    assert_ended_well(said)
    assert_nothing_left(job)
    assert_same_weights(out, reference())
    # one signal, one requeue, each in its place
    assert None not in dict(marks).values() and list(dict(marks).values()) == sorted(dict(marks).values()), marks


def timeline(state: Path, job: str, out: Path, first: str) -> list[tuple[str, float | None]]:
    """When each thing happened to a job stopped once by its time limit, in seconds from its
    submission (None: it did not): slurmctld's log, and the stop's checkpoint on disk."""
    seen = events(state, job)
    submitted = seen["submitted"][0]
    stop = STOP_LINE.search(first)
    saved = Path(stop.group(3)) / "checkpoint.json" if stop else None

    def nth(name: str, n: int) -> float | None:
        return seen[name][n] - submitted if len(seen[name]) > n else None
    marks = [("submitted", 0.0), ("started", nth("started", 0)), ("limit shortened", nth("limit", 0)),
             ("signal", nth("signal", 0)),
             ("saved", saved.stat().st_mtime - submitted if saved and saved.exists() else None),
             ("requeued", nth("requeued", 0)), ("started again", nth("started", 1)),
             ("finished", nth("ended", 0))]
    assert len(seen["signal"]) <= 1 and len(seen["requeued"]) <= 1 and len(seen["ended"]) <= 1, seen
    return marks


# ------------------------------------------------------------------------------------- scancel

def test_scancel_saves_every_process_and_ends_the_job_without_a_requeue(cluster, tmp_path):
    """scancel: SIGTERM from each node's slurmd to every process of the job (the launchers, their
    processes, the batch shell), SIGKILL KillWait (30 s) later. Both processes save the same step and
    exit 75 within it, each launcher ends with its own code (143, or 1 before Accelerate 1.16), and
    the job is CANCELLED: not requeued, the run folder without final weights, continued by hand with
    --resume."""
    out = tmp_path / "run"
    job = submit(tmp_path, out)
    wait_until((out / "checkpoints" / f"step_{UNDERWAY:08d}" / "checkpoint.json").exists, "a first checkpoint",
               tmp_path, job)
    client("scancel", job)
    record = end_of(tmp_path, job, timeout=90)
    assert_nothing_left(job)
    said = output(tmp_path, job)

    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("CANCELLED", "0", "0:15"), record
    assert f"*** JOB {job} ON node1 CANCELLED AT" in said
    step = stopped_at(said, "SIGTERM", out)
    assert not (out / "model.safetensors").exists() and "requeued" not in said
    ends = task_ends(said)
    assert set(ends) == {"node1 task 0", "node2 task 1"} and set(ends.values()) <= exited(1, 143), ends
    assert_ended_well(said)
    time.sleep(3)  # not requeued a moment later either
    assert job_record(job)["JobState"] == "CANCELLED" and completions(cluster, job) == ["CANCELLED"]
    assert step >= UNDERWAY


# ------------------------------------------------------------------------------ a node lost

def test_a_node_set_down_requeues_the_job_which_continues_from_the_checkpoint_its_processes_saved(
        cluster, reference, tmp_path):
    """`scontrol update nodename=node2 state=down`: slurmctld requeues the job (JobRequeue=1,
    --requeue; NODE_FAIL in jobcomp's record, as sacct would say it) and the slurmd of each node sends SIGTERM to its
    processes, which save the same step and exit 75 (the output: `CANCELLED ... DUE TO NODE
    FAILURE`). node2's slurmd still answers, so ReturnToService=2 puts it back at once, and the job
    starts again when its begin time comes, continues from that checkpoint by itself and ends, at
    --max-steps 48, with the uninterrupted run's weights at step 48. A node that really dies takes
    its processes with it unsaved: that is rehearsed without SLURM (tests/test_fail_together.py)."""
    out = tmp_path / "run"
    job = submit(tmp_path, out, "--max-steps", "48")
    wait_until((out / "checkpoints" / f"step_{UNDERWAY:08d}" / "checkpoint.json").exists, "a first checkpoint",
               tmp_path, job)
    client("scontrol", "update", "nodename=node2", "state=down", "reason=rehearsal")
    wait_until(state_is(job, "PENDING", restarts=1), "the requeue", tmp_path, job, timeout=90)
    assert_gone_while_pending(job)  # requeued at once: its processes were still saving
    first = output(tmp_path, job)
    record = end_of(tmp_path, job)
    said = output(tmp_path, job)

    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), record
    assert completions(cluster, job) == ["NODE_FAIL", "COMPLETED"]
    assert record["NodeList"] == "node[1-2]"  # node2 back in service (ReturnToService=2)
    assert f"*** JOB {job} ON node1 CANCELLED AT" in first and "DUE TO NODE FAILURE" in first
    step = stopped_at(first, "SIGTERM", out)
    # srun hears of node2's launcher, on the node set down, only sometimes: its end is the checkpoint's
    # random_states_1.pkl (stopped_at) and no process left on node2
    ends = task_ends(first)
    assert "node1 task 0" in ends and set(ends) <= {"node1 task 0", "node2 task 1"}, ends
    assert set(ends.values()) <= exited(1, 143), ends
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'} at epoch" in said[len(first):]
    assert said.count("done: step 48,") == 2, said[-3000:]
    assert_ended_well(said)
    assert_nothing_left(job)
    assert_same_weights(out, reference() / "checkpoints" / "step_00000048")
