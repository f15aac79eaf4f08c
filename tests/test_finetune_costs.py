"""scripts/benchmark.py's finetune check, as users run it: what a fine-tuning flag costs per step,
train_single launched with the flag and without it, rounds alternated."""

import json
import statistics
import subprocess

import pytest
from helpers import BIN, ROOT, make


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune-bench")
    args = ["--model", "resnet20", "--per-device-batch-size", "16", "--steps", "5", "--strategies", "single",
            "--checks", "finetune", "--finetune-flags", "freeze", "tensorboard", "--output-dir", str(out)]
    done = make("bench", "ARGS=" + " ".join(args), cwd=out)
    return out, json.loads((out / "benchmark.json").read_text()), done.stdout


def test_each_flag_is_measured_against_launches_without_it_in_the_same_rounds(report):
    out, result, stdout = report
    checks = [c for c in result["checks"] if c["check"].startswith("finetune:")]
    assert [c["check"] for c in checks] == ["finetune: --pretrained-path FILE --freeze backbone",
                                            "finetune: --report-to tensorboard"]
    for check in checks:
        assert check["target"] == "reported" and check["passed"] is None and 0 <= check["other_work"] <= 1
        assert len(check["runs"]) == len(check["base_runs"]) == 2  # --repeats 2: two rounds
        for run in check["runs"] + check["base_runs"]:
            # the protocol's launches: 2 warm-up + 5 measured steps, on the workers path, a log every 5 steps
            assert run["steps"] == 7 and len(run["step_seconds"]) == 5 and run["loader"] == "workers"
            assert run["args"]["log_every"] == 5 and run["args"]["loader"] == "workers"
        # A step's cost is the mean of the measured steps (the tracker's log steps included), each round's
        # launch with the flag over the same round's launch without it.
        means = [[statistics.fmean(run["step_seconds"]) for run in check[key]] for key in ("base_runs", "runs")]
        ratios = [flagged / base for base, flagged in zip(*means)]
        assert check["round_ratios"] == pytest.approx(ratios) and check["value"] == pytest.approx(statistics.median(ratios))
        assert check["cost_ms"] == pytest.approx(1e3 * (statistics.median(means[1]) - statistics.median(means[0])))
        assert check["measured"].startswith(f"{check['cost_ms']:+.1f} ms a step, {check['value']:.3f}x")
        assert f"| {check['check']} |" in stdout  # in the printed checks table
    freeze, tensorboard = checks
    # The base is the same launch for both flags; each flag really reached the script.
    assert freeze["base_runs"] == tensorboard["base_runs"]
    for run in freeze["base_runs"]:
        assert run["args"]["freeze"] == "none" and run["args"]["pretrained_path"] is None
        assert run["args"]["report_to"] == ["none"]
    for run in freeze["runs"]:
        assert run["args"]["freeze"] == "backbone" and run["args"]["pretrained_path"].endswith("weights.safetensors")
    # The protocol's --report-to none comes first: the flag's own value wins.
    assert all(run["args"]["report_to"] == ["tensorboard"] for run in tensorboard["runs"])
    # Launched in rounds: base, freeze, tensorboard, then again.
    ends = [run["step_end"][-1] for pair in zip(freeze["base_runs"], freeze["runs"], tensorboard["runs"])
            for run in pair]
    assert ends == sorted(ends)


def test_a_flag_name_the_check_does_not_know_is_one_line(tmp_path):
    done = subprocess.run([str(BIN / "python"), str(ROOT / "scripts" / "benchmark.py"), "--checks", "finetune",
                           "--finetune-flags", "dropout"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --finetune-flags: invalid choice: 'dropout'" in done.stderr
    assert list(tmp_path.iterdir()) == []
