"""TensorBoard and MLflow through Accelerate (--report-to): into the run folder and nowhere else,
read back with each tracker's own reader, one MLflow run per job across --resume, and a missing
package one warning line."""

import json
import os
import re
from types import SimpleNamespace

import pytest
from helpers import ROOT, image_folder, run
from wandb_records import offline_run

# 256 images at batch 64: 4 optimizer steps an epoch, seconds on a CPU.
SMALL = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64",
         "--model", "resnet20", "--batch-size", "64", "--epochs", "2", "--log-every", "2"]


def epochs(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def numeric(row: dict) -> dict:
    """The values of a metrics.jsonl row that a tracker logs as numbers (True is 1)."""
    return {key: value for key, value in row.items() if isinstance(value, (int, float))}


def empty_but_for_cache(folder) -> list[str]:
    """What a run left in its working directory (``folder``) beyond the data cache of the tests."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".cache")


@pytest.mark.floor
def test_tensorboard_writes_every_epoch_into_the_run_folder_beside_the_other_trackers(tmp_path):
    """All three trackers at once, each started once: Accelerate's init_trackers starts every
    tracker it holds, so starting them one at a time began a second wandb run and MLflow refused
    ("already active"), which took TensorBoard's start down with it."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    done = run("train_single.py", *SMALL, "--report-to", "wandb", "mlflow", "tensorboard",
               "--output-dir", out, cwd=cwd)
    folder = out / "tensorboard" / "multigpu-cifar"  # --output-dir/tensorboard/<project>
    assert [line for line in done.stdout.splitlines() if line.startswith("tensorboard:")] == [
        f"tensorboard: events in {folder}; see them with: tensorboard --logdir {out / 'tensorboard'}"]
    assert "warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert empty_but_for_cache(cwd) == []
    [wandb_run] = (out / "wandb").glob("offline-run-*")  # one wandb.init
    assert offline_run(wandb_run)["exit_code"] == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.info.status == "FINISHED"

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()  # 0: keep all
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert sorted(scalars["train/loss"]) == [2, 4, 6, 8]  # every --log-every optimizer steps
    rows = epochs(out)
    assert [row["step"] for row in rows] == [4, 8]
    for row in rows:  # TensorBoard keeps float32
        for key, value in numeric(row).items():
            assert scalars[key][row["step"]] == pytest.approx(float(value), rel=1e-6, abs=1e-30), key


def test_mlflow_keeps_one_run_in_the_run_folder_across_a_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    out, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    first = run("train_single.py", *SMALL, "--report-to", "mlflow", "--max-steps", 4,
                "--output-dir", out, cwd=cwd)  # stops after epoch 1 of 2
    second = run("train_single.py", *SMALL, "--report-to", "mlflow", "--output-dir", out, "--resume",
                 cwd=cwd)
    uri = f"sqlite:///{out.resolve() / 'mlflow.db'}"
    for done in (first, second):
        assert [line for line in done.stdout.splitlines() if line.startswith("mlflow:")] == [
            f"mlflow: run in {uri}; see it with: mlflow ui --backend-store-uri {uri}"]
    assert empty_but_for_cache(cwd) == []  # no ./mlruns, no ./mlflow.db, no ./mlartifacts

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("multigpu-cifar")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.info.experiment_id == experiment.experiment_id
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["args/model"] == "resnet20"  # config.json's values, flattened
    assert mlflow_run.data.params["global_batch_size"] == "64"

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, key)}

    assert sorted(history("train/loss")) == [2, 4, 6, 8]  # both parts of the job, one run
    rows = epochs(out)
    assert [row["step"] for row in rows] == [4, 8]
    for row in rows:
        for key, value in numeric(row).items():
            assert history(key)[row["step"]] == pytest.approx(float(value), rel=1e-12), key


def test_a_tracker_whose_package_is_missing_is_one_warning(tmp_path):
    """mlflow made absent for the run as Python finds an absent package (find_spec gives None,
    import raises ModuleNotFoundError): one warning, and TensorBoard, also asked for, goes on."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text('import sys\n\nsys.modules["mlflow"] = None\n')
    path = os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", str(ROOT))])
    out = tmp_path / "run"
    done = run("train_single.py", *SMALL, "--epochs", 1, "--report-to", "mlflow", "tensorboard",
               "--output-dir", out, env_extra={"PYTHONPATH": path}, cwd=tmp_path)
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    expected = ("warning: --report-to mlflow needs the mlflow package, which is not installed "
                "(pip install mlflow); training goes on without it")
    assert warnings == [expected]
    assert "mlflow" not in done.stderr  # nothing else said about it
    assert (out / "model.safetensors").exists() and len(epochs(out)) == 1  # trained to its end
    assert not (out / "mlflow.db").exists()
    assert list((out / "tensorboard" / "multigpu-cifar").glob("events.out.tfevents.*"))


def test_a_failed_job_marks_its_mlflow_run_failed(tmp_path, monkeypatch):
    """common.failures.end_tracking on an MLflow tracker, from the thread that started the run
    (fail_together) and from another (end_now's): Accelerate's MLflowTracker's finish()
    (mlflow.end_run()) would record the run as FINISHED, and MLflow's active run is the thread's own."""
    import threading

    import mlflow
    from mlflow.tracking import MlflowClient

    from common.failures import end_tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        for elsewhere in (False, True):
            started = mlflow.start_run()  # what MLflowTracker.start does, without a job around
            accelerator = SimpleNamespace(is_main_process=True, trackers=[
                SimpleNamespace(name="mlflow", active_run=started, finish=mlflow.end_run)])
            closing = threading.Thread(target=end_tracking, args=(accelerator,))
            closing.start() if elsewhere else end_tracking(accelerator)
            closing.join() if elsewhere else None
            assert MlflowClient(tracking_uri=uri).get_run(started.info.run_id).info.status == "FAILED", elsewhere
            assert accelerator.trackers == [] and (elsewhere or mlflow.active_run() is None)
            mlflow.end_run("FAILED")  # end_now never returns to this thread: its run is left to os._exit
    finally:  # a run left open would be ended at exit, in a ./mlflow.db (the variable gone by then)
        mlflow.end_run()


def test_a_run_that_fails_on_a_bad_image_is_one_line_and_failed_in_every_tracker(tmp_path):
    """train_single.py with wandb (offline) and MLflow on a folder holding a damaged image: the bad
    image's line alone on stderr (no traceback from wandb's excepthook, no MLflow INFO lines), exit 1;
    MLflow's client reads the run as FAILED (before: FINISHED), wandb's record has exit code 1."""
    from mlflow.tracking import MlflowClient

    folder = image_folder(tmp_path / "data", train=48, val=8, classes=2)
    bad = sorted((folder / "train").rglob("*.jpg"))[5]
    bad.write_bytes(bad.read_bytes()[:300])
    out = tmp_path / "run"
    done = run("train_single.py", "--data-dir", folder, "--image-size", "32", "--model", "resnet20", "--batch-size", 8,
               "--epochs", 1, "--loader", "workers", "--workers", 1, "--report-to", "wandb", "mlflow",
               "--output-dir", out, cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    said = [line for line in re.split(r"[\r\n]", done.stderr)  # but wandb's own lines and the progress bar
            if line.strip() and not line.startswith("wandb:") and "|" not in line]
    assert len(said) == 1 and said[0].startswith(f"error: cannot decode image {bad}"), done.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.info.status == "FAILED"
    [wandb_run] = (out / "wandb").glob("offline-run-*")  # one wandb.init
    assert offline_run(wandb_run)["exit_code"] == 1


def test_the_config_is_flattened_for_tensorboard_hparams_and_mlflow_params():
    from common.run.record import MAX_PARAM_CHARS, flat_config

    flat = flat_config({"args": {"lr": 0.1, "milestones": [4, 9], "resume": None, "tf32": True},
                        "classes": ["airplane"] * 1000})  # 1,000 class names: over MLflow's limit
    assert flat["args/lr"] == 0.1 and flat["args/milestones"] == "[4, 9]" and flat["args/tf32"] is True
    assert "args/resume" not in flat
    assert len(flat["classes"]) == MAX_PARAM_CHARS and flat["classes"].endswith("...")


def test_an_mlflow_server_that_does_not_answer_costs_seconds_not_minutes(tmp_path):
    """A real server that takes connections and never answers (MLflow's default: 120 s a request and
    7 retries, 252 s measured): the run says where it starts MLflow and what that may cost, gives up
    within that bound with one warning, and trains to the end, tracked by the other tracker asked
    for (trackers start one at a time: one that fails takes only itself)."""
    import socket
    import threading
    import time

    held = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def accept_and_say_nothing():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    uri = f"http://127.0.0.1:{server.getsockname()[1]}"
    started = time.monotonic()
    try:
        done = run("train_single.py", *SMALL, "--epochs", "1", "--report-to", "mlflow", "tensorboard", "--output-dir",
                   tmp_path / "run", env_extra={"MLFLOW_TRACKING_URI": uri}, timeout=200)
    finally:
        server.close()
        for connection in held:
            connection.close()
    elapsed = time.monotonic() - started
    lines = done.stdout.splitlines()
    assert f"mlflow: starting its run at {uri} (one that does not answer costs about 23 s, then training " \
           f"goes on)" in lines
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow did not start (") \
        and warnings[0].endswith("training goes on without it"), warnings
    # the other tracker is not taken with it: TensorBoard started and has the run's scalars
    assert f"tensorboard: events in {tmp_path / 'run' / 'tensorboard'}" in done.stdout
    assert list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))
    assert lines[-1].startswith("done: step 4, test_acc ") and held  # it did connect, and was held
    assert elapsed < 23 + 60, elapsed  # the bound, and the run itself (about 10 s here)
