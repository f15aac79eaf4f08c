"""scripts/benchmark.py's finetune check, as users run it: what a fine-tuning flag costs per step,
train_single launched with the flag and without it, rounds alternated."""

import importlib.util
import json
import statistics
import subprocess

import pytest
from helpers import BIN, ROOT, make

# Small, as a launch's time is mostly its imports and the tests check what the figures are made of.
# STEPS = 4 is the fewest that keep a tracker's log step (step 5, --log-every 5) among the measured
# ones: it is written after its optimizer step, inside the interval that ends with step 6.
BATCH, STEPS = 8, 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune-bench")
    args = ["--model", "resnet20", "--per-device-batch-size", BATCH, "--steps", STEPS, "--strategies", "single",
            "--checks", "finetune", "--finetune-flags", "freeze", "tensorboard", "--output-dir", out]
    done = make("bench", "ARGS=" + " ".join(map(str, args)), cwd=out)
    return out, json.loads((out / "benchmark.json").read_text()), done.stdout


def test_each_flag_is_measured_against_the_launches_without_it_around_its_round(report):
    out, result, stdout = report
    checks = [c for c in result["checks"] if c["check"].startswith("finetune:")]
    assert [c["check"] for c in checks] == ["finetune: --pretrained-path FILE --freeze backbone",
                                            "finetune: --report-to tensorboard"]
    for check in checks:
        assert check["target"] == "reported" and check["passed"] is None and 0 <= check["other_work"] <= 1
        # --repeats 2: two rounds of one launch per flag, three launches without flags around them
        assert len(check["runs"]) == 2 and len(check["base_runs"]) == 3
        for run in check["runs"] + check["base_runs"]:
            # the protocol's launches: 2 warm-up + STEPS measured steps, on the workers path, a log every 5 steps
            assert run["steps"] == 2 + STEPS and len(run["step_seconds"]) == STEPS and run["loader"] == "workers"
            assert run["args"]["log_every"] == 5 and run["args"]["loader"] == "workers"
        # A launch's step is the mean of its measured steps (the tracker's log steps included); each round's
        # launch with the flag against the mean of the launches without flags before and after its round.
        base = [statistics.fmean(run["step_seconds"]) for run in check["base_runs"]]
        flagged = [statistics.fmean(run["step_seconds"]) for run in check["runs"]]
        around = [(base[0] + base[1]) / 2, (base[1] + base[2]) / 2]
        ratios = [f / b for f, b in zip(flagged, around)]
        assert check["round_ratios"] == pytest.approx(ratios)
        assert check["value"] == pytest.approx(statistics.median(ratios))
        assert check["cost_ms"] == pytest.approx(1e3 * statistics.median(f - b for f, b in zip(flagged, around)))
        assert check["measured"].startswith(f"{check['cost_ms']:+.1f} ms a step, {check['value']:.3f}x")
        assert f"| {check['check']} |" in stdout  # in the printed checks table
    freeze, tensorboard = checks
    # The launches without flags are the same for both flags; each flag really reached the script.
    assert freeze["base_runs"] == tensorboard["base_runs"]
    for run in freeze["base_runs"]:
        assert run["args"]["freeze"] == "none" and run["args"]["pretrained_path"] is None
        assert run["args"]["report_to"] == ["none"]
    for run in freeze["runs"]:
        assert run["args"]["freeze"] == "backbone" and run["args"]["pretrained_path"].endswith("weights.safetensors")
    # The protocol's --report-to none comes first: the flag's own value wins.
    assert all(run["args"]["report_to"] == ["tensorboard"] for run in tensorboard["runs"])
    # Launched in this order: a base launch, the flags, a base launch, the flags reversed, a base launch.
    base, first, second = freeze["base_runs"], freeze["runs"], tensorboard["runs"]
    ends = [run["step_end"][-1] for run in (base[0], first[0], second[0], base[1], second[1], first[1], base[2])]
    assert ends == sorted(ends)


def test_finetune_is_not_part_of_all():
    # Two launches per flag: asked for by name only.
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    assert "finetune" in benchmark.CHECKS and "finetune" not in benchmark.chosen_checks(["all"])
    assert benchmark.chosen_checks(["all", "finetune"]) == list(benchmark.CHECKS)
    assert benchmark.chosen_checks(["finetune"]) == ["finetune"] and benchmark.chosen_checks(["none"]) == []


def test_a_flag_name_the_check_does_not_know_is_one_line(tmp_path):
    done = subprocess.run([str(BIN / "python"), str(ROOT / "scripts" / "benchmark.py"), "--checks", "finetune",
                           "--finetune-flags", "dropout"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --finetune-flags: invalid choice: 'dropout'" in done.stderr
    assert list(tmp_path.iterdir()) == []
