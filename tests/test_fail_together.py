"""A failure that one process of a 2-process job meets alone ends both within seconds, said once.

Each fault is real: a damaged image in one process's slice of the training or of the evaluation
data, SIGKILL to one process mid-training, an exception in one process while the other waits outside
any collective (as a process waits in an NCCL collective that nothing fails), a disk that fills under
load. The processes are started as torchrun starts its workers, but without a launcher
(helpers.Processes): nothing stops a process but our own code, and each process's exit status and
output are checked, not only the lines printed.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from helpers import (ROOT, Forked, Processes, bad_ends, free_port, image_folder, tmpfs, user_env, wandb_runs,
                     worker_lines)
from test_workers import children
from wandb_records import offline_run

FOLDER = ["--image-size", "32", "--model", "resnet20", "--batch-size", "8", "--epochs", "1", "--loader",
          "workers", "--workers", "1", "--report-to", "none"]
ABORTS = ("Traceback", "terminate called", "core dumped")


def lines(text: str) -> list[str]:
    """The warning and error lines of a process's stderr, after any progress bar on their line."""
    found = (re.match(r"(?:.*?\])?\s*((?:warning|error): .*)$", line.strip()) for line in re.split(r"[\r\n]", text))
    return [m.group(1) for m in found if m]


def damaged(root, split: str, index: int):
    """The index-th image of a split, cut to its first 300 bytes: a file that cannot be decoded."""
    path = sorted((root / split).rglob("*.jpg"))[index]
    path.write_bytes(path.read_bytes()[:300])
    return path


def ended_as_one(job: Processes, failed: int | None = None) -> list[str]:
    """Both processes exited 1 within 5 s of each other, neither by a signal nor an abort, with one
    line in all (on a line of its own, from process ``failed``); that line."""
    assert job.wait() == [1, 1], job.output()
    assert job.spread() < 5, (job.spread(), job.output())
    said = {rank: lines(job.stderr(rank)) for rank in (0, 1)}
    assert sum(len(found) for found in said.values()) == 1, job.output()
    for rank in (0, 1):
        assert not any(sign in job.stderr(rank) for sign in ABORTS), job.output()
    if failed is not None:
        assert said[failed] and said[failed][0] in job.stderr(failed).splitlines(), job.output()
    return [line for found in said.values() for line in found]


@pytest.fixture
def folder(tmp_path):
    return image_folder(tmp_path / "data", train=48, val=8, classes=2)


def test_a_bad_training_image_in_one_process_ends_both_and_the_advice_finishes_the_run(folder, tmp_path):
    """Process 1 reads the damaged image (the order is a function of the seed); process 0 is in a
    collective by then. The printed advice, followed, finishes the run."""
    bad = damaged(folder, "train", 17)
    command = ["train_ddp.py", "--data-dir", folder, *FOLDER, "--output-dir", tmp_path / "run"]
    [line] = ended_as_one(Processes(*command, cwd=tmp_path), failed=1)
    assert line.startswith(f"error: cannot decode image {bad} (OSError: ")
    assert line.endswith("); replace or remove the file, or pass --bad-images skip to train without it; then the "
                         "same command with --resume continues the run")
    bad.unlink()  # "remove the file", "then the same command with --resume"
    again = tmp_path / "again"
    again.mkdir()
    job = Processes(*command, "--resume", cwd=again)
    assert job.wait() == [0, 0], job.output()
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_bad_evaluation_image_in_one_process_ends_both(folder, tmp_path):
    """With the default --report-to wandb (offline: no API key): wandb's own excepthook, around ours on
    the main process, prints no traceback, and its run is recorded as failed."""
    bad = damaged(folder, "val", 7)
    flags = [*FOLDER[:-1], "wandb"]
    job = Processes("train_ddp.py", "--data-dir", folder, *flags, "--output-dir", tmp_path / "run", cwd=tmp_path)
    [line] = ended_as_one(job)
    [record] = wandb_runs(tmp_path / "run")
    assert offline_run(record)["exit_code"] == 1
    assert line.startswith(f"error: cannot decode image {bad} (OSError")
    assert "--bad-images skip" in line


def test_a_process_killed_mid_training_ends_the_other_with_one_line(tmp_path):
    job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "4096",
                    "--synthetic-test-size", "64", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                    "--report-to", "none", "--output-dir", tmp_path / "run", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while "epoch 1/1:" not in job.stderr(0):  # training has started
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.output()
        time.sleep(0.1)
    time.sleep(1)
    job.procs[1].send_signal(signal.SIGKILL)
    assert job.wait() == [1, -signal.SIGKILL], job.output()
    assert job.spread() < 5, (job.spread(), job.output())
    [line] = lines(job.stderr(0))
    assert re.fullmatch(r"error: process 0 lost another process of the job in a collective \(.+\): that process "
                        r"ended first; its own output or the launcher's report says why", line), line
    assert not any(sign in job.stderr(0) for sign in ABORTS), job.output()


def test_the_main_process_killed_leaves_its_mlflow_run_failed_not_running(tmp_path):
    """Process 0, which holds the MLflow run, SIGKILLed mid-training: process 1, which learnt the run from it at
    the start, loses it in a collective, says so in one line and marks the run FAILED (before: RUNNING for
    ever)."""
    from mlflow.tracking import MlflowClient

    job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "4096",
                    "--synthetic-test-size", "64", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                    "--report-to", "mlflow", "--output-dir", tmp_path / "run", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not re.search(r"epoch 1/1: .*\| [1-9]\d*/", job.stderr(0)):  # training has started
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.output()
        time.sleep(0.1)
    job.procs[0].send_signal(signal.SIGKILL)
    assert job.wait() == [-signal.SIGKILL, 1], job.output()
    [line] = lines(job.stderr(1))
    assert line.startswith("error: process 1 lost another process of the job in a collective"), line
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"


@contextmanager
def launchers_store():
    """A store hosted by a process of its own, as torchrun's agent hosts one for its workers
    (TORCHELASTIC_USE_AGENT_STORE: every process a client): its process, and the variables and port
    that point a job's processes at it. It outlives the jobs that use it, as the agent's outlives a
    restart."""
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as dist\n"
                             "store = dist.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
                             "print(store.port, flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        yield host, {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}, port
    finally:
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait()


def probe(tmp_path, name: str, port=None, **env) -> Processes:
    """tests/probe_watch.py on 2 processes, in a folder of its own, with PROBE_* and other ``env``."""
    (tmp_path / name).mkdir()
    return Processes(ROOT / "tests" / "probe_watch.py", cwd=tmp_path / name, env_extra={k: str(v) for k, v in env.items()},
                     port=port)


def ready(job: Processes) -> None:
    """Once both processes watch (they print "ready")."""
    deadline = time.monotonic() + 120
    while not all("ready" in job.stdout(rank) for rank in (0, 1)):
        assert time.monotonic() < deadline and None in (p.poll() for p in job.procs), job.output()
        time.sleep(0.1)


def ended_by_the_watch(job: Processes, failed: int, spread: float = 6) -> None:
    """Both processes exited 1 (no signal, no abort), ``failed`` with its bug's traceback, the other
    without a word and without sleeping out its 60 s: ended by the watch, within ``spread`` s."""
    assert job.wait(timeout=120) == [1, 1], job.output()
    assert job.spread() < spread, (job.spread(), job.output())  # the watch asks every 0.5 s, then waits 3 s
    assert job.stderr(failed).count(f"RuntimeError: a bug in process {failed}") == 1, job.output()
    other = 1 - failed
    assert lines(job.stderr(other)) == [] and "not ended" not in job.stdout(other), job.output()
    assert "Traceback" not in job.stderr(other), job.output()
    assert not any(sign in job.stderr(rank) for rank in (0, 1) for sign in ABORTS[1:]), job.output()


def test_a_process_waiting_outside_a_collective_is_ended_by_the_watch(tmp_path):
    ended_by_the_watch(probe(tmp_path, "one"), failed=1)


@pytest.mark.parametrize("store", ["own", "launcher's"])
def test_the_store_s_host_failing_first_ends_the_others_and_a_restart_starts_clean(tmp_path, store):
    """Process 0 fails first. Without a launcher's store it hosts the store (as under make ddp and
    Processes): it holds it until the other process has read the failure, which it would otherwise
    meet as a closed store (before: process 1 finished its wait and exited 0). A launcher's store
    stays, and outlives the job as torchrun's outlives an attempt: the job restarted
    (TORCHELASTIC_RESTART_COUNT 1) runs its 8 s and exits 0 (before: ended about 3.5 s in, by the
    first attempt's failure)."""
    with launchers_store() if store != "own" else nullcontext((None, {}, None)) as (_, env, port):
        ended_by_the_watch(probe(tmp_path, "job", port=port, PROBE_FAILS="0", **env), failed=0)
        if port:
            # torch 2.14 keys its own keys by no attempt either: a restarted process may read the last
            # attempt's gloo addresses and fail to connect (seen). Those go; the failure watch's stay.
            store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
            for key in store.list_keys():
                if "first-failure" not in key and "ended-for-a-failure" not in key:
                    store.delete_key(key)
            again = probe(tmp_path, "again", port=port, PROBE_FAILS="none", **dict(env, TORCHELASTIC_RESTART_COUNT="1"))
            assert again.wait(timeout=120) == [0, 0], again.output()
            assert all(again.stderr(rank).strip() == "" for rank in (0, 1)), again.output()


def test_the_store_s_host_killed_ends_the_others_with_one_line(tmp_path):
    """Process 0, which hosts the store, killed (SIGKILL) while both wait outside any collective: the
    store goes with it, and process 1's watch meets the error, which is itself the news that the job is
    failing: one line, exit 1 (before: the watch ended silently and process 1 slept on and exited 0)."""
    job = probe(tmp_path, "job", PROBE_FAILS="none", PROBE_WAIT_S=60)
    ready(job)
    job.procs[0].send_signal(signal.SIGKILL)
    assert job.wait(timeout=120) == [-signal.SIGKILL, 1], job.output()
    assert job.spread() < 6, (job.spread(), job.output())
    [line] = lines(job.stderr(1))
    assert re.fullmatch(r"error: process 1 lost the store through which the job's processes meet \(.+\): its host "
                        r"\(process 0, or the launcher\) ended or stopped, so the job is failing; that process's "
                        r"output or the launcher's report says why", line), line
    assert not any(sign in job.stderr(1) for sign in ABORTS), job.output()


def test_a_stopped_store_ends_every_process_each_with_one_line(tmp_path):
    """The launcher's store process stopped (SIGSTOP): it holds every connection and never answers.
    Then process 1 fails: it cannot learn whether it is first and says its traceback; process 0's
    watch gets no answer and says that the store is lost. Every store call is bounded (5 s)."""
    with launchers_store() as (host, env, port):
        job = probe(tmp_path, "job", port=port, PROBE_GO="go", **env)
        ready(job)
        host.send_signal(signal.SIGSTOP)
        (tmp_path / "job" / "go").touch()
        stopped = time.monotonic()
        assert job.wait(timeout=120) == [1, 1], job.output()
        assert time.monotonic() - stopped < 30, job.output()  # bounds: 5 s an answer, 3 s of grace
    assert job.stderr(1).count("RuntimeError: a bug in process 1") == 1, job.output()
    assert lines(job.stderr(1)) == [], job.output()
    [line] = lines(job.stderr(0))
    assert re.fullmatch(r"error: process 0 lost the store through which the job's processes meet \(TimeoutError: "
                        r"no answer in 5 s\): its host \(process 0, or the launcher\) ended or stopped, so the job is "
                        r"failing; that process's output or the launcher's report says why", line), line
    assert not any(sign in job.stderr(rank) for rank in (0, 1) for sign in ABORTS[1:]), job.output()


@pytest.mark.parametrize("failed", [0, 1])
def test_mlflow_reads_the_failed_run_as_failed_whichever_process_fails(tmp_path, failed):
    """MLflow's and TensorBoard's trackers on the main process, read back with MLflow's client: FAILED
    (before: FINISHED when the main process failed, its excepthook's thread ending nothing; RUNNING
    when the watch ended it), the TensorBoard events flushed; MLflow's own lines not on stderr."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = probe(tmp_path, "job", PROBE_TRACK="mlflow,tensorboard", PROBE_DIR=tmp_path / "tb", PROBE_FAILS=str(failed),
                MLFLOW_TRACKING_URI=uri)
    ended_by_the_watch(job, failed)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"
    assert [p.stat().st_size > 0 for p in (tmp_path / "tb").rglob("events.out.tfevents.*")] == [True]


def test_a_tracker_that_never_finishes_costs_its_bounds(tmp_path):
    """wandb offline on the main process, its service process (wandb-core) stopped (SIGSTOP) before
    process 1 fails: wandb's finish and its service's teardown at exit never return. Process 0, ended
    by the watch, waits 10 s for each and exits 1 (before: never)."""
    job = probe(tmp_path, "job", PROBE_TRACK="wandb", WANDB_MODE="offline", WANDB_DIR=tmp_path, PROBE_GO="go")
    ready(job)
    service = [int(child) for task in Path(f"/proc/{job.procs[0].pid}/task").iterdir()
               for child in (task / "children").read_text().split()]
    assert service, job.output()
    for pid in service:
        os.kill(pid, signal.SIGSTOP)
    try:
        (tmp_path / "job" / "go").touch()
        ended_by_the_watch(job, failed=1, spread=3.5 + 10 + 10 + 10)
    finally:
        for pid in service:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(shutil.which("mount") is None, reason="mounts a tmpfs")
def test_a_full_disk_under_load_ends_both_processes_every_time(tmp_path):
    """3 MB hold the first checkpoint (step 2) of resnet20, not the second: every process writes its
    part (save_state) and learns of the failure in one collective. Three runs, a busy process beside;
    in the second, process 1 saves 2 s late (tests/late_save.py), after the main process has failed
    and ended: the folder it makes again is removed too. The last one's advice followed, with the
    space freed, finishes the run."""
    flags = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "64", "--model",
             "resnet20", "--batch-size", "32", "--epochs", "2", "--report-to", "none", "--checkpoint-every", "2",
             "--keep-checkpoints", "5"]
    # At the lowest priority: it takes the cores the suite's other tests leave idle (all of them when
    # this test runs alone), not the ones they are using.
    busy = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    try:
        for attempt in range(3):
            with tmpfs(tmp_path / f"disk{attempt}", "3m") as disk:
                out = disk / "run"
                late = [ROOT / "tests" / "late_save.py"] if attempt == 1 else []
                job = Processes(*late, ROOT / "scripts" / "train_ddp.py", *flags, "--output-dir", out, cwd=tmp_path)
                [line] = ended_as_one(job)
                assert line.startswith(f"error: cannot write checkpoint {out}/checkpoints/step_00000004 (no space left")
                assert line.endswith(f"the checkpoint {out}/checkpoints/step_00000002 is intact: free space in "
                                     f"{out}, then run the same command with --output-dir {out} --resume")
                assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
                if attempt == 2:
                    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
                    job = Processes("train_ddp.py", *flags, "--output-dir", out, "--resume", cwd=tmp_path)
                    assert job.wait() == [0, 0], job.output()
                    assert "resumed from" in job.stdout(0) and (out / "model.safetensors").is_file()
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(shutil.which("mount") is None, reason="mounts a tmpfs")
def test_a_full_disk_under_fsdp2_with_a_weight_average_ends_both_processes(tmp_path):
    """FSDP2 forced on 2 CPU processes (tests/probe_fsdp.py) with --ema-decay: save_state gathers the
    average's slices and only the main process writes it, so a process whose write fails may leave the
    other inside save_state's collectives. 6 MB hold the first checkpoint (3.8 MB), not the second."""
    flags = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "64", "--model",
             "resnet20", "--batch-size", "32", "--epochs", "2", "--report-to", "none", "--checkpoint-every", "2",
             "--keep-checkpoints", "5", "--ema-decay", "0.9"]
    with tmpfs(tmp_path / "disk", "6m") as disk:
        out = disk / "run"
        job = Processes(ROOT / "tests" / "probe_fsdp.py", ROOT / "scripts" / "train_fsdp.py", *flags, "--output-dir",
                        out, cwd=tmp_path)
        [line] = ended_as_one(job)
        assert line.startswith(f"error: cannot write checkpoint {out}/checkpoints/step_00000004 (no space left")
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


def test_tracker_servers_that_do_not_answer_cost_their_bounds_and_one_warning_each(tmp_path):
    """wandb online and MLflow, their server accepting connections and never answering, wandb's
    start bounded at 12 s (WANDB_INIT_TIMEOUT) and MLflow's at about 15 s (two requests of 6 s, as
    the user's MLFLOW_HTTP_REQUEST_TIMEOUT asks), each above --dist-timeout's 10: the other process
    waits for the main one in the store, not in a collective that the timeout would end; the run
    finishes, one warning said for each."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel accepts; nothing reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": url, "WANDB_INIT_TIMEOUT": "12", "MLFLOW_TRACKING_URI": url,
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "6"}
    with silent:
        job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "64",
                        "--synthetic-test-size", "32", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                        "--report-to", "wandb", "mlflow", "--dist-timeout", "10", "--output-dir", tmp_path / "run",
                        cwd=tmp_path, env_extra=env)
        assert job.wait(timeout=240) == [0, 0], job.output()
    said = job.stdout(0).splitlines()
    assert "wandb: starting its run online (a server that does not answer costs 12 s, then training goes on " \
           "without it)" in said, job.output()
    assert f"mlflow: starting its run at {url} (one that does not answer costs about 15 s, then training goes " \
           f"on)" in said, job.output()
    warnings = [line for line in said if line.startswith("warning:")]
    assert [warning.split(" (")[0] for warning in warnings] == ["warning: wandb did not start",
                                                                "warning: mlflow did not start"], warnings
    assert all(warning.endswith("); training goes on without tracking") for warning in warnings), warnings
    assert "done: step 4" in job.stdout(0) and lines(job.stderr(1)) == []
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_killed_dataloader_worker_ends_both_with_one_line_that_says_it_may_be_memory(folder, tmp_path):
    """SIGKILL, as the out-of-memory killer sends it, to process 1's DataLoader worker mid-training: one line
    from process 1 naming the worker and what kills that way, both processes exit 1, no traceback."""
    job = Processes("train_ddp.py", "--data-dir", folder, *FOLDER, "--output-dir", tmp_path / "run", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not (workers := children(job.procs[1].pid)) or "epoch 1/1:" not in job.stderr(0):
        assert time.monotonic() < deadline and job.procs[1].poll() is None, job.output()
        time.sleep(0.1)
    os.kill(workers[0], signal.SIGKILL)
    [line] = ended_as_one(job, failed=1)
    assert re.fullmatch(rf"error: process 1: its DataLoader worker \(pid {workers[0]}\) was killed \(Killed\), as the "
                        r"kernel kills a process when memory runs out: give the job more memory, or pass fewer "
                        r"--workers; then the same command with --resume continues from the last checkpoint", line), line


def test_a_node_killed_during_start_up_ends_the_other_node_with_one_line(tmp_path):
    """Two torchrun nodes of one process each (a c10d rendezvous on this machine); node 1's process
    SIGKILLed as it starts to load its data, after the process group is made (tests/probe_startup.py):
    node 0's process meets it in start-up's next collective and says so in one line, exit 1, no traceback
    of its own; both launchers end, neither hangs."""
    port, out = free_port(), tmp_path / "run"
    env = user_env(WANDB_MODE="offline", CIFAR_CACHE_DIR=str(tmp_path / ".cache"))
    nodes = [Forked([Path(sys.executable).parent / "torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", rank,
                     ROOT / "tests" / "probe_startup.py", ROOT / "scripts" / "train_ddp.py", "--dataset", "synthetic",
                     "--model", "resnet20", "--batch-size", "16", "--epochs", "1", "--report-to", "none",
                     "--output-dir", out], tmp_path, env, merged=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [1, 1], "\n".join(outputs)
    said = lines(worker_lines(outputs[0]))
    assert len(said) == 1 and re.fullmatch(r"error: process 0 lost another process of the job in a collective "
                                           r"\(.+\): that process ended first; its own output or the launcher's "
                                           r"report says why", said[0]), outputs[0]
    assert bad_ends(outputs[0]) == [], outputs[0]
    assert "exitcode: -9" in outputs[1] and lines(worker_lines(outputs[1])) == [], outputs[1]


def test_a_process_out_of_memory_ends_both_with_one_line(tmp_path):
    """Process 1's third step asks the allocator for more memory than there is (tests/probe_oom.py: a real
    refusal of torch's CPU allocator): one line from process 1 with what to lower, both exit 1, no traceback."""
    job = Processes(ROOT / "tests" / "probe_oom.py", ROOT / "scripts" / "train_ddp.py", "--dataset", "synthetic",
                    "--synthetic-train-size", "256", "--synthetic-test-size", "32", "--model", "resnet20",
                    "--batch-size", "16", "--epochs", "1", "--report-to", "none", "--output-dir", tmp_path / "run",
                    cwd=tmp_path)
    [line] = ended_as_one(job, failed=1)
    assert re.fullmatch(r"error: process 1 ran out of memory \(RuntimeError: .*DefaultCPUAllocator: can't allocate "
                        r"memory: .*\): pass a smaller --batch-size \(with --grad-accum N to keep the global batch\), "
                        r"or --compile none \(CUDA graphs hold memory of their own\); then the same command with "
                        r"--resume continues from the last checkpoint", line), line


def test_a_stop_in_progress_keeps_its_checkpoint_when_the_store_goes(tmp_path):
    """The launcher killed outright takes the store it hosts (here a process of its own, as torchrun's agent
    hosts it), and its death signal, SIGTERM, reaches every process: their stop, whose save takes 8 s, longer
    than the watch's 3 s grace for a lost store (tests/probe_slow_save.py), finishes. Both save the step and
    exit 75 with the stop line (before: both said they lost the store and exited 1, no checkpoint)."""
    out = tmp_path / "run"
    with launchers_store() as (host, env, port):
        job = Processes(ROOT / "tests" / "probe_slow_save.py", ROOT / "scripts" / "train_ddp.py", "--dataset",
                        "synthetic", "--synthetic-train-size", "2048", "--synthetic-test-size", "32", "--model",
                        "resnet20", "--batch-size", "16", "--epochs", "1", "--report-to", "none", "--output-dir", out,
                        cwd=tmp_path, env_extra=env, port=port)
        deadline = time.monotonic() + 120
        while not re.search(r"epoch 1/1: .*\| [1-9]\d*/", job.stderr(0)):  # a step: both handle signals
            assert time.monotonic() < deadline and job.procs[0].poll() is None, job.output()
            time.sleep(0.1)
        host.kill()
        host.wait()
        time.sleep(1)  # the watch (every 0.5 s) meets the lost store before the stop signal comes
        for process in job.procs:
            process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == [75, 75], job.output()
    stops = re.findall(r"stopped by SIGTERM after step (\d+): the training state is in (\S+);", job.stdout(0))
    assert len(stops) == 1 and (Path(stops[0][1]) / "checkpoint.json").is_file(), job.output()
    assert all(lines(job.stderr(rank)) == [] for rank in (0, 1)), job.output()


def test_a_stopped_process_is_named_by_the_next_one_long_before_the_dist_timeout(tmp_path):
    """SIGSTOP to process 1 mid-training, --dist-timeout 40: its heartbeat stops, and process 0, which hears
    it, says so in one line naming it, its host and its last step, within a quarter of the timeout (10 s), and
    exits 1 (before: the collective's timeout, 40 s, and a line that could not say which process). Process 1,
    continued, exits 1 too, having lost process 0 (which hosted the store: no failure left to read) in one line
    of its own at most; under a launcher the launcher ends it."""
    job = Processes("train_ddp.py", "--dataset", "synthetic", "--synthetic-train-size", "4096",
                    "--synthetic-test-size", "64", "--model", "resnet20", "--batch-size", "16", "--epochs", "1",
                    "--report-to", "none", "--dist-timeout", "40", "--output-dir", tmp_path / "run", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not re.search(r"epoch 1/1: +\d+%.*\| ([4-9]\d|\d{3,})/", job.stderr(0)):  # 40 steps: 2 s of beats since
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.output()
        time.sleep(0.1)
    job.procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    assert job.procs[0].wait(timeout=120) == 1, job.output()
    assert time.monotonic() - stopped < 35, job.output()  # the heartbeat's 10 s, not the timeout's 40
    job.procs[1].send_signal(signal.SIGCONT)
    assert job.wait(timeout=60) == [1, 1], job.output()
    [line] = lines(job.stderr(0))
    assert re.fullmatch(rf"error: process 0: process 1 on {re.escape(socket.gethostname())} has not answered for "
                        r"10 s, after step \d+: it is stopped \(SIGSTOP, a frozen node\) or cut off; the job ends "
                        r"now, not at --dist-timeout", line), line
    assert [line.split(" (")[0] for line in lines(job.stderr(1))] in (
        [], ["error: process 1 lost another process of the job in a collective"]), job.output()
    assert not any(sign in job.output() for sign in ABORTS), job.output()
