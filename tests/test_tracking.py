"""wandb tracking: offline by default without a key, one run per job, resumes keep the run."""

import json

import pytest
from helpers import run, wandb_runs
from wandb_records import offline_run

from common.observe.tracking import has_wandb_credentials, track

SMALL = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64",
         "--model", "resnet20", "--batch-size", "64"]


def test_offline_without_a_key_and_the_run_matches_metrics_jsonl(full_run):
    out, done = full_run  # train_single, 3 epochs of 16 steps, --log-every 8, no API key
    (run_dir,) = wandb_runs(out)  # under --output-dir, next to the run record
    notice = [line for line in done.stdout.splitlines() if line.startswith("wandb:")]
    assert notice == [f"wandb: no API key configured, so this run is logged offline to {run_dir}; "
                      f"upload it with: wandb sync {run_dir}"]

    run = offline_run(run_dir)
    assert run["exit_code"] == 0  # finished
    config = json.loads((out / "config.json").read_text())
    assert run["config"]["args"] == config["args"] and run["config"]["world_size"] == 1
    assert run["config"]["versions"]["torch"] == config["versions"]["torch"] and "git_commit" in run["config"]

    # Per-step loss and lr every --log-every steps, at the global optimizer step.
    assert [step for step in sorted(run["history"]) if "train/loss" in run["history"][step]] == [8, 16, 24, 32,
                                                                                                 40, 48]
    assert "train/img_per_s" in run["history"][16]
    # Per epoch: the numbers of metrics.jsonl, at the step the epoch ended.
    for metrics in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        row = run["history"][metrics["step"]]
        for key in ("epoch", "train_loss", "test_acc", "epoch_time_s", "img_per_s", "data_wait_frac", "lr"):
            assert row[key] == pytest.approx(metrics[key], rel=1e-12), key


def test_an_unreachable_wandb_server_does_not_stop_training(tmp_path):
    """An API key and no route to the server: wandb gives up after its start-up timeout (the
    scripts bound it at tracking.START_TIMEOUT, 60 s; 3 s here) and the run goes on without it."""
    out = tmp_path / "run"
    done = run("train_single.py", *SMALL, "--epochs", 1, "--output-dir", out,
               env_extra={"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_MODE": "online",
                          "WANDB_INIT_TIMEOUT": "3"})
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: wandb did not start (")
    assert warnings[0].endswith("); training goes on without tracking")
    assert (out / "model.safetensors").exists()


def test_a_log_failure_mid_run_is_one_warning():
    class Tracker:
        name = "wandb"

        def log(self, values, step):
            raise OSError("disk full")

        def finish(self):
            self.finished = True

    class Accelerator:
        is_main_process = True
        trackers = [Tracker()]
        printed = []

        def log(self, values, step):  # as Accelerate's: each tracker's, none once they are dropped
            for tracker in self.trackers:
                tracker.log(values, step)

        def print(self, *text):
            self.printed.append(" ".join(text))

    accelerator = Accelerator()
    track(accelerator, {"loss": 1.0}, step=1)
    track(accelerator, {"loss": 0.5}, step=2)  # tracking is off now: no second warning
    assert accelerator.printed == ["warning: wandb failed to log (OSError: disk full); training goes on without "
                                   "tracking"]
    assert accelerator.trackers == []


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
