"""scripts/benchmark.py and scripts/check_gpus.py end to end on the CPU, as users run them.

The figures of a tiny run on a shared CPU are noise; these tests check what the files claim: that
each row launched its real script the way users do (2-process DDP through accelerate launch really
ran 2 processes), that img/s is the protocol's formula over the recorded runs, that the three
report files are well formed, and that check_gpus verifies a real gloo all-reduce and fails, with
advice, when the sum or a GPU-to-GPU copy comes back wrong.
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import BIN, ROOT, make
from PIL import Image

# As small as the protocol allows, as the tests check what the figures are made of, not how large they
# are: the checks' 5 plain loops run STEPS steps in each of 3 rounds, and the bf16 one (precision)
# takes about 0.6 s a step at batch 8 on 2 CPU cores, 1.5 s at batch 16. STEPS = 4 is the fewest that
# keep a tracker's log step (step 5, --log-every 5) among the finetune check's measured ones: it is
# written after its optimizer step, inside the interval that ends with step 6. FILES: 4 batches an
# epoch in the loader check's epochs. One `make bench` for every check: a launch's time is mostly its
# imports (the finetune check's 4 launches and the rows' 2 in one run, 2 launches fewer than apart).
# --repeats 1: each row launched once, the finetune check one round; the medians over several
# launches and rounds, and the flags' order reversed every other round, are tested without launches
# (test_the_medians_are_over_launches_and_rounds_and_the_flags_alternate).
BATCH, STEPS, FILES = 8, 4, 32
TINY = ["--model", "resnet20", "--per-device-batch-size", BATCH, "--steps", STEPS, "--repeats", 1,
        "--strategies", "single", "ddp2",
        "--checks", "tta", "ops", "overhead", "data", "loader", "precision", "compute", "ema", "watch", "finetune",
        "--tta-flags", '"--epochs 1 --synthetic-train-size 256 --synthetic-test-size 64"',
        "--finetune-flags", "freeze", "tensorboard", "--loader-images", "256", "--loader-files", FILES,
        "--matmul-size", "256", "--sweep-batch-size", BATCH]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(path, *args):
    # One thread per process: on a 2-core machine shared with other tests, an OpenMP thread that waits
    # for a descheduled sibling spins, and a tiny training run took 10x longer with 2 threads. Speed
    # is not what these tests check.
    return subprocess.run([sys.executable, str(path), *map(str, args)], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


# ------------------------------------------------------------------------------ benchmark.py

@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # Launched as the README launches it: `make bench ARGS=...` (one thread per process, see run_script).
    out = tmp_path_factory.mktemp("bench")
    done = make("bench", "ARGS=" + " ".join(map(str, [*TINY, "--output-dir", out])), cwd=out)
    return out, json.loads((out / "benchmark.json").read_text()), done.stdout


def test_rows_launch_the_real_scripts_and_follow_the_protocol(report):
    _, result, _ = report
    assert {"cpu", "cpu_cores", "gpus", "versions", "load_average"} <= set(result["machine"])
    assert 0 <= result["other_work_cpu_share"] <= 1 and result["noise"].startswith("other processes used")
    assert result["machine"]["gpus"] == [] and result["machine"]["versions"]["torch"] == torch.__version__
    assert f"for 2 + N optimizer steps (N = {STEPS};" in result["protocol"] and result["steps"] == STEPS
    single, ddp2 = result["rows"]
    assert (single["name"], ddp2["name"]) == ("single", "ddp2")
    assert single["command"].startswith(f"{sys.executable} scripts/train_single.py --model resnet20 "
                                        f"--batch-size {BATCH} ")
    assert "accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2 scripts/train_ddp.py" \
        in ddp2["command"]
    assert ddp2["global_batch"] == BATCH and ddp2["devices"] == 1  # the CPU is one device, whatever the processes
    # Peak memory is per training process: the DDP row really ran two (ranks 0 and 1).
    assert len(single["peak_memory_gb"]) == 1 and len(ddp2["peak_memory_gb"]) == 2
    assert all(0.1 < gb < 20 for gb in single["peak_memory_gb"] + ddp2["peak_memory_gb"])
    for row in result["rows"]:
        assert "error" not in row, row.get("error")
        # Launched once (--repeats 1) for 2 warm-up + STEPS measured steps, each step timed inside the
        # script's own training loop; img/s = global batch / the median measured step.
        assert [r["steps"] for r in row["runs"]] == [2 + STEPS]
        for run in row["runs"]:
            # The 2 warm-up steps are the ones left out: intervals from the end of step 2 on.
            ends = run["step_end"]
            assert len(ends) == 2 + STEPS and run["step_seconds"] == [b - a for a, b in zip(ends[1:], ends[2:])]
            assert sum(run["step_seconds"]) < run["epoch_time_s"] < run["wall_s"]
            # Each step's data wait, from the script's own DataWait: together what the script logged; the
            # figure after the warm-up is the measured steps' waits over their time.
            assert len(run["data_wait"]) == 2 + STEPS
            assert sum(run["data_wait"]) == pytest.approx(run["data_wait_frac"] * run["epoch_time_s"])
            assert run["data_wait_steady_frac"] == pytest.approx(sum(run["data_wait"][2:]) / sum(run["step_seconds"]))
            assert run["loader"] == "device" and run["loader_workers"] == 0
        seconds = [s for run in row["runs"] for s in run["step_seconds"]]
        assert row["step_seconds"]["median"] == statistics.median(seconds)
        assert row["img_per_s"] == pytest.approx(row["global_batch"] / statistics.median(seconds))
        assert row["epoch_50k_s"] == pytest.approx(50_000 / row["img_per_s"])
        assert 0 <= row["data_wait_frac"] < 1 and 0 <= row["other_work"] <= 1
    assert single["speedup"] == 1 and ddp2["efficiency"] == pytest.approx(ddp2["img_per_s"] / single["img_per_s"])
    # The sweep at the rows' batch size reuses the single row instead of launching it again.
    assert [r["per_device_batch"] for r in result["sweep"]] == [BATCH] and result["sweep"][0]["runs"] == single["runs"]


def test_checks_state_each_ratio_against_its_target(report):
    _, result, stdout = report
    checks = {c["check"].split(":")[0]: c for c in result["checks"]}
    assert set(checks) == {"tta", "ops", "overhead", "data", "data wait", "loader", "precision", "compute", "ema",
                           "watch", "finetune"}
    assert checks["overhead"]["target"] == ">= 0.97x" and checks["data"]["target"] == ">= 5x"
    assert checks["data wait"]["target"] == "< 2 %" and checks["precision"]["target"] == ">= 1.8x"
    assert checks["compute"]["target"] == ">= 85 %"
    single = result["rows"][0]
    # Side by side: train_single's step times (the real script, under a step timer) against the plain
    # loop's, from the rounds that ran before, between and after its launches; the warm-up left out.
    overhead = checks["overhead"]
    # The overhead's loop runs in train_single's layout (channels_last); the precision check's fp32
    # baseline stays NCHW. Both run the same rounds.
    assert len(result["plain_loop_img_per_s"]["fp32"]) == len(single["runs"]) + 1
    plain = result["plain_loop_img_per_s"]["fp32_channels_last"]
    assert len(plain) == len(single["runs"]) + 1
    assert overhead["train_single_step_seconds"] == [s for run in single["runs"] for s in run["step_seconds"]]
    assert [len(run["step_seconds"]) for run in single["runs"]] == [STEPS]
    assert len(overhead["plain_step_seconds"]) == STEPS * len(plain)
    # Each launch against the mean of the plain-loop rounds just before and after it.
    rounds = [BATCH / statistics.median(overhead["plain_step_seconds"][STEPS * k:STEPS * (k + 1)]) for k in range(2)]
    assert plain == pytest.approx(rounds)
    [launch] = [BATCH / statistics.median(run["step_seconds"]) for run in single["runs"]]
    ratio = launch / ((plain[0] + plain[1]) / 2)
    assert overhead["value"] == pytest.approx(ratio)
    assert overhead["launch_ratios"] == pytest.approx([ratio])  # the spread, reported beside the median
    assert overhead["measured"].endswith(f"1 launch: {ratio:.3f}x to {ratio:.3f}x)")
    for name, target in {"overhead": 0.97, "data": 5, "loader": 1.5, "precision": 1.8, "compute": 0.85}.items():
        assert checks[name]["passed"] == (checks[name]["value"] >= target) and checks[name]["value"] > 0
    assert checks["data wait"]["passed"] == (checks["data wait"]["value"] < 0.02)
    assert "| overhead: train_single / plain PyTorch loop |" in stdout  # the checks table is printed too
    # --ema-decay's cost: the same loop with and without the average, the same rounds; one update alone.
    ema, with_ema = checks["ema"], result["plain_loop_img_per_s"]["ema"]
    assert len(with_ema) == len(plain) and ema["target"] == "reported" and ema["passed"] is None
    assert ema["value"] == pytest.approx(statistics.median(e / p for e, p in zip(with_ema, plain)))
    assert 0 < ema["update_s"] < ema["step_s"] and f"one update {ema['update_s'] * 1e3:.2f} ms" in ema["measured"]
    # The failure watch's cost: the same loop with the watch's thread asking a real store, the same rounds.
    watch, watched = checks["watch"], result["plain_loop_img_per_s"]["watch"]
    assert len(watched) == len(plain) and watch["target"] == "reported" and watch["passed"] is None
    assert watch["value"] == pytest.approx(statistics.median(w / p for w, p in zip(watched, plain)))
    assert 0 < watch["question_s"] < 0.01 and f"one question to the store {watch['question_s'] * 1e6:.0f} us" \
        in watch["measured"]


def test_time_to_accuracy_and_the_operators_a_step_costs_come_first(report):
    """tta: each configuration launched to its done line, its wall time and accuracy; ops: train_single's steady
    step dispatches at most 8 operators more than the plain loop with the same data work (the cap: 12 before the
    stop check stopped all-reducing a lone process's loss), every one named, the model's own work equal."""
    _, result, stdout = report
    first = [c["check"] for c in result["checks"][:3]]
    assert first == ["tta: defaults (make demo)", "tta: fastest: bf16",
                     "ops: train_single's operators per step - the plain loop's"], first
    for check in result["checks"][:2]:
        run = check["first"]
        assert check["passed"] is None and check["value"] == run["wall_s"] > run["first_epoch_s"] > 0
        assert 0 <= run["test_acc"] <= 1 and run["epochs"] == 1 and run["steps"] == 2  # 256 images, batch 128
        assert check["second"] is None and run["compile"] == "--compile auto: eager (no GPU); --compile inductor compiles"
        assert f"{run['wall_s']:.0f} s to test_acc {run['test_acc']:.4f} (1 epochs, 2 steps)" == check["measured"]
    assert "--model resnet20 --epochs 8 --mixed-precision bf16 --epochs 1" in result["checks"][1]["note"]
    ops = result["checks"][2]
    print(f"ops per step: {ops['measured']}")
    assert ops["value"] == ops["script_ops"] - ops["plain_ops"] == sum(ops["surplus"].values())
    assert ops["passed"] and ops["value"] <= 8, ops["measured"]
    assert ops["plain_ops"] > 100 and not any(name.startswith(("aten.convolution", "aten.native_batch_norm",
                                                                "aten.relu", "aten.mm"))
                                               for name in ops["surplus"]), ops["surplus"]  # the model's work, equal
    assert "| ops: train_single's operators per step - the plain loop's |" in stdout


def test_loader_check_compares_the_workers_path_with_torchvision_side_by_side(report):
    out, result, _ = report
    inputs = result["inputs"]
    # The scripts' worker count on both sides, the rows' batch, the JPEGs --loader-files asked for.
    assert inputs["workers"] == max(1, min(16, len(os.sched_getaffinity(0)) - 1)) and inputs["batch"] == BATCH
    assert inputs["folder"]["train_files"] == FILES and 20 < inputs["folder"]["mean_kb"] < 200
    ours, theirs = inputs["rates"]["ours"], inputs["rates"]["torchvision"]
    assert len(ours) == len(theirs) == 5 and min(ours + theirs) > 0  # 5 rounds, one epoch each
    ratio = statistics.median(o / t for o, t in zip(ours, theirs))  # round by round
    loader = next(c for c in result["checks"] if c["check"].startswith("loader:"))
    assert inputs["ratio"] == loader["value"] == pytest.approx(ratio)
    assert loader["passed"] == (ratio >= 1.5) and loader["target"] == ">= 1.5x"
    assert loader["measured"].startswith(f"{ratio:.2f}x ({statistics.median(ours):,.0f} vs "
                                         f"{statistics.median(theirs):,.0f} img/s, 224 px crops, batch {BATCH})")
    markdown = (out / "benchmark.md").read_text()
    assert "## Input paths" in markdown and f"Ratio, workers path / torchvision: {ratio:.2f}x" in markdown
    assert "| workers path: worker_loader (decode_image, transforms.v2) + normalise on the device | " in markdown


def test_report_files_are_well_formed(report):
    out, result, _ = report
    markdown = (out / "benchmark.md").read_text()
    assert "| strategy | processes | global batch | img/s | 50,000-image epoch | speed-up | scaling efficiency |" \
           in markdown
    assert f"| `single`: train_single, fp32 | 1 | {BATCH} |" in markdown
    assert f"| `ddp2`: train_ddp, 2 processes on gloo, fp32 | 2 | {BATCH} |" in markdown
    assert "Protocol: each row launches its script once, as users launch it" in markdown
    assert "## Batch size sweep (`single`)" in markdown and "## Checks" in markdown
    assert markdown.count("PASS") + markdown.count("BELOW") == sum(c["passed"] is not None for c in result["checks"])
    assert "| ema: plain loop with --ema-decay / without |" in markdown
    with Image.open(out / "benchmark.png") as image:
        assert image.format == "PNG" and image.width > 800 and image.height > 200


# ---------------------------------------------------------------------- the finetune check
# What a fine-tuning flag costs per step: train_single launched with the flag and without it, rounds
# alternated (bench/finetune.py), in the same `make bench` as the rows.

def test_each_flag_is_measured_against_the_launches_without_it_around_its_round(report):
    out, result, stdout = report
    checks = [c for c in result["checks"] if c["check"].startswith("finetune:")]
    assert [c["check"] for c in checks] == ["finetune: --pretrained-path FILE --freeze backbone",
                                            "finetune: --report-to tensorboard"]
    for check in checks:
        assert check["target"] == "reported" and check["passed"] is None and 0 <= check["other_work"] <= 1
        # --repeats 1: one round of one launch per flag, two launches without flags around it
        assert len(check["runs"]) == 1 and len(check["base_runs"]) == 2
        for run in check["runs"] + check["base_runs"]:
            # the protocol's launches: 2 warm-up + STEPS measured steps, on the workers path, a log every 5 steps
            assert run["steps"] == 2 + STEPS and len(run["step_seconds"]) == STEPS and run["loader"] == "workers"
            assert run["args"]["log_every"] == 5 and run["args"]["loader"] == "workers"
        # A launch's step is the mean of its measured steps (the tracker's log steps included); each round's
        # launch with the flag against the mean of the launches without flags before and after its round.
        base = [statistics.fmean(run["step_seconds"]) for run in check["base_runs"]]
        flagged = [statistics.fmean(run["step_seconds"]) for run in check["runs"]]
        around = [(base[0] + base[1]) / 2]
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
    # Launched in this order: a base launch, the flags, a base launch.
    base, first, second = freeze["base_runs"], freeze["runs"], tensorboard["runs"]
    ends = [run["step_end"][-1] for run in (base[0], first[0], second[0], base[1])]
    assert ends == sorted(ends)


def test_the_medians_are_over_launches_and_rounds_and_the_flags_alternate(monkeypatch, tmp_path):
    """What `make bench`'s default --repeats 2 adds to the fixture's single launch and round, its
    launches faked: each train_single launch against the plain-loop rounds around it and the median
    of those ratios; the finetune check's rounds, the flags' order reversed every other round, each
    round's flag launch against the base launches around its round."""
    benchmark = load_script("benchmark")
    args = benchmark.parse_args(["--model", "resnet20", "--per-device-batch-size", "8", "--repeats", "2"])
    single = {"runs": [{"step_seconds": [0.1, 0.1]}, {"step_seconds": [0.4, 0.4]}], "img_per_s": 40.0,
              "data_wait_frac": 0.01, "other_work": 0.0}
    plain = {"fp32_channels_last": [100.0, 60.0, 20.0]}  # img/s of the rounds before, between, after
    loops = {"fp32_channels_last": types.SimpleNamespace(step_seconds=[0.1] * 6)}
    [overhead] = benchmark.run_checks(["overhead"], single, plain, {}, loops, args, 2, torch.device("cpu"))
    assert overhead["launch_ratios"] == pytest.approx([80 / 80, 20 / 40])  # launch k between rounds k, k + 1
    assert overhead["value"] == pytest.approx(0.75)
    assert overhead["measured"].endswith("2 launches: 0.500x to 1.000x)")

    launched = []

    def launch(strategy, *_):
        launched.append(strategy.name)
        return {"step_seconds": [0.1 * len(launched)], "data_wait_steady_frac": 0.0}

    monkeypatch.setattr(benchmark, "launch", launch)
    checks = benchmark.finetune_checks(
        benchmark.parse_args(["--model", "resnet20", "--per-device-batch-size", "8", "--repeats", "3",
                              "--finetune-flags", "freeze", "tensorboard"]), 1, 0, tmp_path)
    assert launched == ["finetune-base", "finetune-freeze", "finetune-tensorboard",
                        "finetune-base", "finetune-tensorboard", "finetune-freeze",
                        "finetune-base", "finetune-freeze", "finetune-tensorboard", "finetune-base"]
    freeze = checks[0]
    # freeze's launches were the 2nd, 6th and 8th (0.2, 0.6, 0.8 s), the rounds' bases 0.1, 0.4, 0.7, 1.0 s
    assert freeze["round_ratios"] == pytest.approx([0.2 / 0.25, 0.6 / 0.55, 0.8 / 0.85])
    assert freeze["value"] == pytest.approx(0.8 / 0.85) and freeze["measured"].startswith("-50.0 ms a step")
    assert "the medians over 3 rounds, the flags' order reversed every other round" in freeze["note"]


def test_finetune_is_not_part_of_all():
    # Two launches per flag: asked for by name only.
    benchmark = load_script("benchmark")
    assert "finetune" in benchmark.CHECKS and "finetune" not in benchmark.chosen_checks(["all"])
    assert benchmark.chosen_checks(["all", "finetune"]) == list(benchmark.CHECKS)
    assert benchmark.chosen_checks(["finetune"]) == ["finetune"] and benchmark.chosen_checks(["none"]) == []


def test_a_flag_name_the_check_does_not_know_is_one_line(tmp_path):
    done = subprocess.run([str(BIN / "python"), str(ROOT / "scripts" / "benchmark.py"), "--checks", "finetune",
                           "--finetune-flags", "dropout"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --finetune-flags: invalid choice: 'dropout'" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_rows_follow_the_gpu_count(monkeypatch):
    benchmark = load_script("benchmark")
    assert list(benchmark.available_strategies(0)) == ["single", "bf16", "ddp2"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert list(benchmark.available_strategies(1)) == ["single", "defaults", "fp16", "bf16", "bf16-graphs"]
    assert list(benchmark.available_strategies(6)) == ["single", "defaults", "dp", "ddp2", "ddp4", "ddp6", "fsdp6",
                                                       "ddp6-fp16", "ddp6-bf16", "bf16-graphs"]
    # eager rows, to compare strategies with each other and the eager plain loop; the defaults compile
    assert benchmark.available_strategies(1)["single"].flags == ("--compile", "none")
    assert benchmark.available_strategies(1)["defaults"].flags == ()
    graphs = benchmark.available_strategies(6)["bf16-graphs"]  # CUDA graphs: one GPU, bf16, reduce-overhead
    assert (graphs.script, graphs.processes, graphs.precision) == ("train_amp.py", 1, "bf16")
    assert graphs.flags == ("--mixed-precision", "bf16", "--compile", "--compile-mode", "reduce-overhead")
    rows = benchmark.available_strategies(4)
    assert rows["ddp4-bf16"].launcher()[-4:] == ["--config_file", "accelerate_configs/4gpu.yaml",
                                                  "--num_processes", "4"]
    assert rows["ddp4-bf16"].flags == ("--mixed-precision", "bf16", "--compile", "none")
    assert rows["dp"].launcher() == [sys.executable]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # no native bf16
    assert "bf16-graphs" not in benchmark.available_strategies(1)


# ------------------------------------------------------------ GPU memory and matmul peaks, faked

SMI_4_GPUS = [("0", "GPU-aaaa1111"), ("1", "GPU-bbbb2222"), ("2", "GPU-cccc3333"), ("3", "GPU-dddd4444")]


def fake_nvidia_smi(monkeypatch, mib_used=lambda: [100] * 4, error=None):
    """subprocess.run answering nvidia-smi's index,uuid,memory.used query for the 4 GPUs of
    SMI_4_GPUS with the MiB in use that ``mib_used()`` gives, or raising ``error``; nvidia-ml-py
    made absent, so that bench.tools falls back on nvidia-smi."""
    from bench import tools
    monkeypatch.setattr(tools, "pynvml", None)

    def run(command, **kwargs):
        assert command[:2] == ["nvidia-smi", "--query-gpu=index,uuid,memory.used"] and kwargs["timeout"]
        if error:
            raise error
        lines = [f"{index}, {uuid}, {mib}" for (index, uuid), mib in zip(SMI_4_GPUS, mib_used())]
        return subprocess.CompletedProcess(command, 0, "\n".join(lines) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory", "nvidia-smi"),
                                   subprocess.CalledProcessError(9, "nvidia-smi"),
                                   subprocess.TimeoutExpired("nvidia-smi", 30)])
def test_a_missing_or_failing_nvidia_smi_leaves_memory_to_the_scripts(monkeypatch, tmp_path, error):
    from bench import tools
    benchmark = load_script("benchmark")
    fake_nvidia_smi(monkeypatch, error=error)
    watcher = tools.PeakMemory(2, interval=0.01)
    assert watcher.stop() == [] and watcher.error.startswith(f"nvidia-smi failed ({type(error).__name__}")
    assert "as nvidia-smi failed here" in benchmark.memory_protocol(2)
    # A row on one GPU, its launches faked: the script's own gpu_mem_peak_gb stands in for nvidia-smi,
    # and this process's cached GPU memory is released before every launch.
    emptied, launches, run_watched = [], [], tools.run_watched
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def launched(command, cwd, gpus, timeout, env=None):
        assert gpus == 1 and len(emptied) == len(launches) + 1
        output_dir = Path(command[command.index("--output-dir") + 1])
        output_dir.mkdir()
        (output_dir / "metrics.jsonl").write_text(json.dumps(
            {"step": 5, "epoch_time_s": 1.0, "data_wait_frac": 0.01, "gpu_mem_peak_gb": [1.5 + len(launches)]}))
        (output_dir / "config.json").write_text(json.dumps({"args": {}, "loader": "device", "loader_workers": 0}))
        steps = command[command.index("bench.steptimer") + 1]
        Path(f"{steps}.0").write_text(json.dumps({"step_end": [0.1 * i for i in range(5)], "peak_rss_gb": 2,
                                                  "data_wait": [0.002] * 5}))
        launches.append(command)
        return run_watched([sys.executable, "-c", "pass"], cwd, gpus, timeout)  # the real watcher

    monkeypatch.setattr(tools, "run_watched", launched)
    args = benchmark.parse_args(["--steps", "3", "--repeats", "2"])
    row = benchmark.measure(benchmark.available_strategies(1)["single"], args, 16, 3, 1, tmp_path)
    assert "error" not in row and len(launches) == 2 and len(emptied) == 2
    assert row["peak_memory_gb"] == [2.5] and row["memory_kind"] == "GPU, torch max_memory_allocated"
    assert all(run["memory_error"].startswith("nvidia-smi failed") for run in row["runs"])
    # Neither nvidia-smi nor the scripts: the memory is unknown, not a crash.
    assert benchmark.peak_memory([{"peak_memory_gb": [], "torch_peak_memory_gb": []}], 1) == ([], "unknown")
    assert tools.row_cells({**row, "peak_memory_gb": [], "memory_kind": "unknown"})[4] == "-"


def test_workers_rows_train_on_image_folders_and_leave_the_warm_up_wait_out(monkeypatch, tmp_path):
    # The workers check's launches, faked: their command lines, and their data wait as the step timer
    # records it (the warm-up's worker start-up left out) beside the one the script logs.
    from bench import tools
    benchmark = load_script("benchmark")
    launches = []

    def launched(command, cwd, gpus, timeout, env=None):
        output_dir = Path(command[command.index("--output-dir") + 1])
        output_dir.mkdir()
        (output_dir / "config.json").write_text(json.dumps({"args": {}, "loader": "workers", "loader_workers": 1}))
        (output_dir / "metrics.jsonl").write_text(json.dumps({"step": 5, "epoch_time_s": 2.0, "data_wait_frac": 0.3}))
        steps = command[command.index("bench.steptimer") + 1]
        Path(f"{steps}.0").write_text(json.dumps({"step_end": [0.1, 0.2, 0.4, 0.6, 0.8], "peak_rss_gb": 1,
                                                  "data_wait": [0.5, 0.01, 0.02, 0.02, 0.02]}))
        launches.append(command)
        return tools.WatchedRun(0, "", "", [], 1.0)

    monkeypatch.setattr(tools, "run_watched", launched)
    args = benchmark.parse_args(["--steps", "3", "--repeats", "1", "--per-device-batch-size", "4",
                                 "--loader-files", "8", "--checks", "workers"])
    inputs = benchmark.input_paths(["workers"], args, 3, 0, torch.device("cpu"), tmp_path)
    small, large = inputs["rows"]
    assert "rates" not in inputs and len(launches) == 2 and not small.get("error") and not large.get("error")
    # The small row: the `single` row's model, batch and synthetic images, as 32 px PNG files.
    assert "scripts/train_single.py --model resnet18 --batch-size 4 " in small["command"]
    assert f"--loader workers --data-dir {tmp_path / 'png'} --image-size 32" in small["command"]
    assert len(list((tmp_path / "png" / "train").rglob("*.png"))) == (2 + 3 + 1) * 4
    # ResNet-50 on the JPEGs at 224 px, at the CPU's small batch; the folder holds one epoch of it.
    assert f"--model torchvision:resnet50 --batch-size {benchmark.LARGE_CPU_BATCH} " in large["command"]
    assert f"--loader workers --data-dir {tmp_path / 'jpeg'} --image-size 224" in large["command"]
    assert inputs["folder"]["train_files"] == (2 + 3 + 1) * benchmark.LARGE_CPU_BATCH
    for row in small, large:
        assert row["data_wait_frac"] == 0.3 and row["data_wait_steady_frac"] == pytest.approx(0.06 / 0.6)
        assert (row["loader"], row["loader_workers"]) == ("workers", 1)
    checks = benchmark.input_checks(inputs)
    assert [c["check"] for c in checks] == [f"data wait: {small['label']}", f"data wait: {large['label']}"]
    assert checks[1]["measured"] == "10.00 % after the warm-up, 30.00 % with it (batch 8, 1 worker, 40.0 img/s)"
    assert all(c["passed"] is None for c in checks)  # reported, no target


def test_cuda_visible_devices_pick_the_physical_gpus_nvidia_smi_watches(monkeypatch):
    from bench import tools
    launched, sampled = threading.Event(), threading.Event()

    def used():  # 100 MiB each before the launch; then GPU 0 (another job's) +10 GiB, GPU 2 +1 GiB, GPU 3 +3 GiB
        if not launched.is_set():
            return [100] * 4
        sampled.set()
        return [10340, 100, 1124, 3172]

    fake_nvidia_smi(monkeypatch, used)
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert [gpu[0] for gpu in tools.nvidia_smi_gpus(env)] == ["2", "3"]
    assert tools.describe_gpus(tools.nvidia_smi_gpus(env), env) == (
        "GPUs as the processes number them: cuda:0 = nvidia-smi's GPU 2, cuda:1 = nvidia-smi's GPU 3 "
        "(CUDA_VISIBLE_DEVICES=2,3)")
    watcher = tools.PeakMemory(2, interval=0.01, env=env)
    launched.set()
    assert sampled.wait(10)
    assert watcher.stop() == [round(2**30 / tools.GB, 3), round(3 * 2**30 / tools.GB, 3)]  # cuda:0, cuda:1
    # UUIDs, whole or a unique start, in the variable's order; CUDA stops at the first entry naming no GPU.
    listed = [(index, uuid, 0) for index, uuid in SMI_4_GPUS]
    assert [gpu[0] for gpu in tools.visible_gpus(listed, "GPU-dddd4444,GPU-bbbb")] == ["3", "1"]
    assert [gpu[0] for gpu in tools.visible_gpus(listed, "1, 3,7,0")] == ["1", "3"]
    assert tools.visible_gpus(listed, "") == [] and tools.visible_gpus(listed, None) == listed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0f1e2d3c")  # nvidia-smi tells no MIG slice's memory
    assert tools.PeakMemory(1).error.startswith("nvidia-smi failed (ValueError")


def fake_nvml(monkeypatch, used_bytes, fails=False):
    """nvidia-ml-py answering for the 4 GPUs of SMI_4_GPUS (UUIDs as bytes, as before 11.5) with
    the bytes in use that ``used_bytes()`` gives; every init matched by a shutdown, checked."""
    from bench import tools

    class NVMLError(Exception):
        pass

    opened = []

    def init():
        if fails:
            raise NVMLError("NVML Shared Library Not Found")
        opened.append(True)

    nvml = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=opened.pop,
        nvmlDeviceGetCount=lambda: len(SMI_4_GPUS), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda i: SMI_4_GPUS[i][1].encode(),
        nvmlDeviceGetMemoryInfo=lambda i: types.SimpleNamespace(used=used_bytes()[i]))
    monkeypatch.setattr(tools, "pynvml", nvml)
    monkeypatch.setattr(tools, "GPU_QUERY_ERRORS", (*tools.NVIDIA_SMI_ERRORS, NVMLError))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nvidia-smi started"))
    return opened


def test_peak_memory_reads_nvml_where_nvidia_ml_py_is_installed(monkeypatch):
    """The same figures as through nvidia-smi, without a process a sample: the GPUs of
    CUDA_VISIBLE_DEVICES, each one's rise over its memory before the launch; NVML failing is the
    scripts' figure standing in, as nvidia-smi failing is."""
    from bench import tools
    launched, sampled = threading.Event(), threading.Event()

    def used():  # as in the nvidia-smi test: GPU 0 (another job's) +10 GiB, GPU 2 +1 GiB, GPU 3 +3 GiB
        if not launched.is_set():
            return [100 * 2**20] * 4
        sampled.set()
        return [(100 + extra) * 2**20 for extra in (10240, 0, 1024, 3072)]

    opened = fake_nvml(monkeypatch, used)
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert [gpu[:2] for gpu in tools.nvml_gpus(env)] == [("2", "GPU-cccc3333"), ("3", "GPU-dddd4444")]
    watcher = tools.PeakMemory(2, interval=0.01, env=env)
    launched.set()
    assert sampled.wait(10)
    assert watcher.stop() == [round(2**30 / tools.GB, 3), round(3 * 2**30 / tools.GB, 3)]
    assert watcher.error is None and opened == []
    fake_nvml(monkeypatch, used, fails=True)
    watcher = tools.PeakMemory(1, interval=0.01)
    assert watcher.stop() == [] and watcher.error == (
        "NVML failed (NVMLError: NVML Shared Library Not Found)")


def test_matmul_peak_runs_many_matmuls_per_timing_in_the_requested_precision(monkeypatch):
    from bench import tools
    events, clock = [], [0.0]

    def mm(a, b):  # 1 ms of fake device time a matmul, and the TF32 settings it ran under
        clock[0] += 0.001
        events.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(tools, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(tools, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    for tf32_math, settings in ((True, (True, True)), (False, (False, False)), (None, before)):
        events.clear()
        flops = tools.matmul_peak(torch.device("cpu"), size=64, repeats=3, tf32_math=tf32_math)
        assert {e for e in events if e != "sync"} == {settings}
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
        # Matmuls between two synchronisations: a warm-up, doubled until a timing takes 25 ms, then 2 more.
        timings = "".join("|" if e == "sync" else "m" for e in events).strip("|").split("||")
        assert [len(t) for t in timings] == [1, 1, 2, 4, 8, 16, 32, 32, 32]
        assert flops == pytest.approx(2 * 64**3 * 32 / 0.032)
    with pytest.raises(RuntimeError), tools.tf32(True):  # restored when the block fails too
        raise RuntimeError
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


# ----------------------------------------------------------------------------- check_gpus.py

def test_check_gpus_on_a_cpu_verifies_a_gloo_all_reduce():
    done = run_script(ROOT / "scripts" / "check_gpus.py", "--size-mb", "1", "--iters", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "INFO  devices: no GPU" in done.stdout
    assert "PASS  all-reduce, 2 processes on gloo: sum verified on every process" in done.stdout
    assert "check_gpus: every check passed" in done.stdout


def test_check_gpus_fails_with_advice_when_the_sum_is_wrong(tmp_path):
    # A patched copy of the script whose all-reduce delivers one wrong value per process.
    source = (ROOT / "scripts" / "check_gpus.py").read_text()
    verified = "    dist.all_reduce(result)  #"
    assert source.count(verified) == 1
    patched = tmp_path / "check_gpus.py"
    patched.write_text(source.replace(verified, "    dist.all_reduce(result); result[rank] += 1  #"))
    done = run_script(patched, "--size-mb", "1", "--iters", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("FAIL  all-reduce, 2 processes on gloo: wrong sums (process 0: 1 of 250000, process 1: 1 of 250000 "
            "values differ from the known answer)") in done.stdout
    assert "      try: " in done.stdout and "check_gpus: 1 check(s) failed" in done.stdout


def test_gpus_that_torch_cannot_see_are_a_failure(monkeypatch):
    check_gpus = load_script("check_gpus")
    monkeypatch.setattr(check_gpus, "nvidia_smi", lambda *args: "0, NVIDIA A100\n1, NVIDIA A100")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = check_gpus.check_devices()  # torch here sees no GPU
    assert result.ok is False and result.detail == "nvidia-smi lists 2 GPU(s) but torch sees none"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES=''" in check_gpus.check_devices().advice


def test_step_timer_counts_every_step_and_the_process_own_peak_memory(tmp_path):
    # fp16's GradScaler skips optimizer.step when the gradients overflow (step 2 here); that step
    # still took its time and must be counted, or the warm-up cut and the median shift. The parent
    # holds 2.1 GB: the child's peak memory is its own (importing torch maps up to ~1 GB), not the
    # parent's at the fork, which ru_maxrss would report. (4 GiB cost 9 s of CPU to fault in on a fresh
    # 2-core VM, 2.1 GB 0.6 s.)
    script = tmp_path / "train.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), 0.1)\n"
                      "scaler = torch.amp.GradScaler('cpu')\nfor i in range(5):\n"
                      "    loss = model(torch.ones(2, 4)).sum() * (float('inf') if i == 1 else 1.0)\n"
                      "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"
                      "    opt.zero_grad()\nassert scaler.get_scale() < 65536.0  # the step was skipped\n")
    timed = [sys.executable, "-m", "bench.steptimer", str(tmp_path / "t"), str(script)]
    parent = f"import subprocess, numpy as np; held = np.ones(2**28); subprocess.run({timed!r}, check=True)"
    subprocess.run([sys.executable, "-c", parent], check=True, cwd=ROOT, timeout=120)
    from bench import steptimer
    record = steptimer.read(str(tmp_path / "t"))
    assert len(record["step_end"]) == 5 and 0.05 < record["peak_rss_gb"] < 1.6


def test_docs_show_the_committed_benchmark_run():
    # The tables of docs/benchmarks.md are those of the real run kept in docs/benchmark, unedited, and
    # its figures follow the protocol: img/s = global batch / the median measured step.
    folder = ROOT / "docs" / "benchmark"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = [line for line in (folder / "benchmark.md").read_text().splitlines() if line.startswith("|")]
    # ... but its overhead row (PASS against the older NCHW loop), which the page shows from the later
    # run of the current check kept in docs/benchmark/overhead, unedited too
    overhead = [line for line in tables if line.startswith("| overhead:")]
    assert len(tables) > 15 and [line for line in tables if line not in page] == overhead
    later = (folder / "overhead" / "benchmark.md").read_text().splitlines()
    assert [line for line in later if line.startswith("| overhead:") and line in page] != []
    assert overhead[0].endswith("| PASS |") and not any(line in page for line in overhead)
    assert "](benchmark/benchmark.png)" in page
    report = json.loads((folder / "benchmark.json").read_text())
    assert report["machine"]["gpus"] == [] and report["sweep"] and not any(r.get("error") for r in report["rows"])
    for row in report["rows"] + report["sweep"]:
        seconds = [s for run in row["runs"] for s in run["step_seconds"]]
        assert row["img_per_s"] == pytest.approx(row["global_batch"] / statistics.median(seconds))
    with Image.open(folder / "benchmark.png") as image:
        assert image.format == "PNG" and image.width > 800
    # The finetune check's run, kept beside it: every flag's row on the page, unedited.
    tuned = [line for line in (folder / "finetune" / "benchmark.md").read_text().splitlines()
             if line.startswith("| finetune:")]
    assert len(tuned) == 11 and [line for line in tuned if line not in page] == []
    # The input paths' run, kept beside it: its section's tables are on the page, its ratio the rounds' median.
    section = (folder / "inputs" / "benchmark.md").read_text().split("## Input paths")[1].split("## Checks")[0]
    tables = [line for line in section.splitlines() if line.startswith("|")]
    assert len(tables) == 9 and [line for line in tables if line not in page] == []
    inputs = json.loads((folder / "inputs" / "benchmark.json").read_text())["inputs"]
    ours, theirs = inputs["rates"]["ours"], inputs["rates"]["torchvision"]
    assert inputs["ratio"] == pytest.approx(statistics.median(o / t for o, t in zip(ours, theirs)))


def test_an_ema_update_is_timed_alone_on_every_thread_of_the_loop(monkeypatch):
    """bench.tools.ema_update_seconds through torch.utils.benchmark.Timer: the median of the
    updates timed one by one (each after Timer's 2 untimed ones), with the loop's threads."""
    from bench import tools
    threads = []

    class Average:
        def update(self):
            threads.append(torch.get_num_threads())
            time.sleep(0.002)

    seconds = tools.ema_update_seconds(types.SimpleNamespace(ema=Average()), updates=5)
    assert len(threads) == 5 * 3 and set(threads) == {torch.get_num_threads()}
    assert 0.002 <= seconds < 0.05
