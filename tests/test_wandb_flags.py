"""The wandb run as a user finds it: named by the flags, or by the WANDB_* variables when a flag is
not given, and marked failed when the run fails (docs/usage.md, "Tracking").

Each run is read back from its offline datastore with wandb's own protobuf schema (tests/wandb_records.py).
"""

from helpers import run, wandb_runs
from wandb_records import offline_run, records

TINY = ["--dataset", "synthetic", "--synthetic-train-size", "128", "--synthetic-test-size", "32", "--model", "resnet20",
        "--batch-size", "64", "--epochs", "1"]
VARIABLES = {"WANDB_PROJECT": "project-of-env", "WANDB_NAME": "name-of-env", "WANDB_TAGS": "env-a,env-b",
             "WANDB_RUN_GROUP": "group-of-env"}
FLAGS = ["--wandb-project", "project-of-flag", "--run-name", "name-of-flag", "--wandb-tags", "flag-a", "flag-b",
         "--wandb-group", "group-of-flag"]


def names(out) -> dict:
    """The project, name, tags and group of the run's first run record."""
    (run_dir,) = wandb_runs(out)
    (datastore,) = run_dir.glob("run-*.wandb")
    record = next(r.run for r in records(datastore) if r.WhichOneof("record_type") == "run")
    return {"project": record.project, "name": record.display_name, "tags": list(record.tags),
            "group": record.run_group}


def test_the_naming_flags_win_over_the_wandb_variables(tmp_path):
    out = tmp_path / "run"
    run("train_single.py", *TINY, "--max-steps", 1, *FLAGS, "--output-dir", out, env_extra=VARIABLES)
    assert names(out) == {"project": "project-of-flag", "name": "name-of-flag", "tags": ["flag-a", "flag-b"],
                          "group": "group-of-flag"}
    assert offline_run(wandb_runs(out)[0])["exit_code"] == 0  # finished


def test_the_wandb_variables_name_the_run_without_the_flags(tmp_path, full_run):
    out = tmp_path / "run"
    run("train_single.py", *TINY, "--max-steps", 1, "--output-dir", out, env_extra=VARIABLES)
    assert names(out) == {"project": "project-of-env", "name": "name-of-env", "tags": ["env-a", "env-b"],
                          "group": "group-of-env"}
    default = names(full_run[0])  # neither: the project the docs name, no tags, no group
    assert (default["project"], default["tags"], default["group"]) == ("multigpu-cifar", [], "")


def test_a_run_that_fails_is_marked_failed(tmp_path):
    """An lr of 1e30 makes the loss NaN at step 2: the run stops with exit status 1, and its wandb run
    is marked failed (a non-zero exit code), as docs/usage.md says."""
    out = tmp_path / "run"
    done = run("train_single.py", *TINY, "--lr", "1e30", "--output-dir", out, check=False)
    assert done.returncode == 1 and "error: the loss is nan at step 2" in done.stderr, done.stderr[-2000:]
    assert offline_run(wandb_runs(out)[0])["exit_code"] not in (0, None)
