"""wandb tracking: offline by default without a key, one run per job, resumes keep the run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_single import ROOT
from wandb_records import offline_run

from common.tracking import has_wandb_credentials, track

TINY = ["--dataset", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "200",
        "--model", "resnet20", "--batch-size", "64", "--epochs", "2", "--log-every", "4"]


def no_key_env(tmp_path, **extra):
    """A user who never logged in: no WANDB_API_KEY, no ~/.netrc, no WANDB_MODE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "CIFAR_CACHE_DIR": str(tmp_path / ".cache"), **extra}


def train(tmp_path, *args, env=None, check=True):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_single.py"), *TINY, *map(str, args)],
                          cwd=ROOT, env=env or no_key_env(tmp_path), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def runs_in(out: Path):
    return sorted((out / "wandb").glob("offline-run-*"))


def test_offline_without_a_key_and_the_run_matches_metrics_jsonl(tmp_path):
    out = tmp_path / "run"
    done = train(tmp_path, "--output-dir", out)
    (run_dir,) = runs_in(out)  # under --output-dir, next to the run record
    notice = [line for line in done.stdout.splitlines() if line.startswith("wandb:")]
    assert notice == [f"wandb: no API key configured, so this run is logged offline to {run_dir}; "
                      f"upload it with: wandb sync {run_dir}"]

    run = offline_run(run_dir)
    assert run["exit_code"] == 0  # finished
    config = json.loads((out / "config.json").read_text())
    assert run["config"]["args"] == config["args"] and run["config"]["world_size"] == 1
    assert run["config"]["versions"]["torch"] == config["versions"]["torch"] and "git_commit" in run["config"]

    # Per-step loss and lr every --log-every steps, at the global optimizer step.
    assert [step for step in sorted(run["history"]) if "train/loss" in run["history"][step]] == [4, 8, 12, 16]
    assert "train/img_per_s" in run["history"][8]
    # Per epoch: the numbers of metrics.jsonl, at the step the epoch ended.
    for metrics in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        row = run["history"][metrics["step"]]
        for key in ("epoch", "train_loss", "test_acc", "epoch_time_s", "img_per_s", "data_wait_frac", "lr"):
            assert row[key] == pytest.approx(metrics[key], rel=1e-12), key


def test_a_resumed_run_keeps_its_id_and_step_count(tmp_path):
    out = tmp_path / "run"
    train(tmp_path, "--output-dir", out, "--max-steps", 12)
    train(tmp_path, "--output-dir", out, "--resume")
    first, second = (offline_run(path) for path in runs_in(out))
    assert first["id"] == second["id"]  # `wandb sync` of both folders fills one run
    assert max(first["history"]) == 12
    assert sorted(step for step in second["history"] if step is not None) == [16]  # continues, no restart at 0


def test_report_to_none_tracks_nothing(tmp_path):
    out = tmp_path / "run"
    done = train(tmp_path, "--output-dir", out, "--report-to", "none", "--epochs", 1)
    assert not (out / "wandb").exists() and "wandb" not in done.stdout


def test_a_tracking_failure_does_not_stop_training(tmp_path):
    out = tmp_path / "run"
    done = train(tmp_path, "--output-dir", out, "--epochs", 1, env=no_key_env(tmp_path, WANDB_MODE="bogus"))
    assert "warning: wandb did not start" in done.stdout and "training goes on without tracking" in done.stdout
    assert (out / "model.safetensors").exists()


def test_a_log_failure_mid_run_is_one_warning():
    class Tracker:
        def finish(self):
            self.finished = True

    class Accelerator:
        is_main_process = True
        trackers = [Tracker()]
        printed = []

        def log(self, values, step):
            raise OSError("disk full")

        def print(self, *text):
            self.printed.append(" ".join(text))

    accelerator = Accelerator()
    track(accelerator, {"loss": 1.0}, step=1)
    track(accelerator, {"loss": 0.5}, step=2)  # tracking is off now: no second warning
    assert accelerator.printed == ["warning: wandb failed to log (OSError: disk full); training goes on without "
                                   "tracking"]
    assert accelerator.trackers == []


def test_ctrl_c_finishes_the_run(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_single.py"), *TINY,
                                "--synthetic-train-size", "4096", "--epochs", "5", "--output-dir", str(out)],
                               cwd=ROOT, env=no_key_env(tmp_path), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not runs_in(out) and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # well inside the first epoch
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0, output
    (run_dir,) = runs_in(out)
    run = offline_run(run_dir)
    assert run["exit_code"] not in (None, 0), output  # finished, and marked as failed


def test_credentials_are_found_where_wandb_looks(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / ".netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert not has_wandb_credentials()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    assert has_wandb_credentials()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "y" * 40)
    assert has_wandb_credentials()
