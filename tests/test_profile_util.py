"""--profile (a torch.profiler trace of chosen steps and the per-step table of the top ops) and each
GPU's utilisation (NVML, sampled beside training): a real run on the CPU, NVML replaced where no GPU
exists."""

import json
import re
import threading
import time

import pytest
import torch
from helpers import DATA, run

from common.observe import utilisation
from common.observe.tracking import log_line
from common.observe.utilisation import GpuBusy, utilisation_figures

FLAGS = [*DATA, "--model", "resnet20", "--batch-size", "64", "--epochs", "1", "--report-to", "none"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "run"
    return out, run("train_single.py", *FLAGS, "--profile", "3:2", "--output-dir", out, cwd=out.parent)


def test_profile_writes_a_trace_of_the_chosen_steps(profiled):
    out, _ = profiled
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names  # steps 4 and 5 of the launch (counted from 0)
    assert not {"ProfilerStep#2", "ProfilerStep#5"} & names  # the warm-up step, the step after
    assert any(str(name).startswith("aten::convolution") for name in names)


def test_profile_prints_the_ops_that_cost_most_per_step(profiled):
    out, done = profiled
    head = f"--profile: steps 4-5 of this launch traced in {out / 'profile'}"
    assert head in done.stdout
    table = done.stdout.split(head, 1)[1].splitlines()[1:]
    assert re.match(r"op +calls +self CPU us$", table[0])
    rows = [re.match(r"(\S.*?) +([\d.]+) +([\d.]+)$", line) for line in table[2:18]]
    assert all(rows), table
    times = [float(row.group(3)) for row in rows[:-1]]
    assert times == sorted(times, reverse=True) and rows[-1].group(1) == "all ops"
    assert float(rows[-1].group(3)) >= sum(times)  # the total holds every op, not only the top 15
    # a conv layer's ops run once per convolution per step: ResNet-20 has 19 (forward)
    assert any(row.group(1).startswith("aten::") for row in rows)


def test_profile_attributes_each_step_s_time_to_what_the_loop_called(profiled):
    """The per-step work outside the model, counted: each op under the call of train_single.py's loop it
    ran for (the model, the backward, the optimizer, the augmentation, the stop check ...)."""
    _, done = profiled
    head = "--profile: per step, by what train_single.py's loop called (the model, and all the rest):"
    assert head in done.stdout
    table = done.stdout.split(head, 1)[1].splitlines()[1:]
    assert re.match(r"called from the loop +ops +self CPU us$", table[0])
    rows = {}
    for line in table[2:]:
        found = re.match(r"(\S.*?) +([\d.]+) +([\d.]+)$", line)
        if not found:
            break
        rows[found.group(1)] = (float(found.group(2)), float(found.group(3)))
    times = [cpu for _, cpu in rows.values()]
    assert times == sorted(times, reverse=True), rows
    for caller in ("the backward (autograd's engine)", "common/recipe/models.py: forward", "common/data/transform.py: train",
                   "accelerate/optimizer.py: step", "common/parallel/step_guard.py: check"):
        assert caller in rows, (caller, rows)
    # ResNet-20: the forward and backward of its 19 convolutions are most of the step, each op counted once
    model = rows["the backward (autograd's engine)"][1] + rows["common/recipe/models.py: forward"][1]
    assert model > 0.8 * sum(times), rows
    assert rows["common/recipe/models.py: forward"][0] >= 19 * 3  # a convolution, a norm and an activation each


def test_a_cpu_run_says_why_it_has_no_gpu_utilisation(profiled):
    out, done = profiled
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["gpu_util_absent"] == "no GPU: training on the CPU" and "gpu_util_pct" not in record
    assert "gpu_util" not in done.stdout.split("epoch=1/1", 1)[1].splitlines()[0]  # the log line as before


def test_a_profile_window_after_the_run_is_said(tmp_path):
    done = run("train_single.py", *FLAGS, "--max-steps", "3", "--profile", "5", "--output-dir", tmp_path / "run",
               cwd=tmp_path)
    assert "--profile: the run ended before steps 6-10 of this launch: nothing traced" in done.stdout
    assert not (tmp_path / "run" / "profile").exists()


def test_a_run_that_ends_inside_the_window_says_so_and_divides_by_the_steps_it_traced(tmp_path):
    # steps 3-7 asked, the run ends after step 4: steps 3 and 4 and the run's end are traced
    done = run("train_single.py", *FLAGS, "--max-steps", "4", "--profile", "2:5", "--output-dir", tmp_path / "run",
               cwd=tmp_path)
    said = "--profile: the run ended inside the window: steps 3-4 and the run's end (3 steps) of this launch traced"
    assert said in done.stdout
    trace = json.loads((tmp_path / "run" / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name")).startswith("ProfilerStep#")}
    assert len(steps) == 3
    # the table is per traced step: the top op's calls are its calls in the trace over 3, not over 5
    top = done.stdout.split("of this launch traced", 1)[1].splitlines()[3].split()
    in_trace = sum(e.get("name") == top[0] and e.get("ph") == "X" for e in trace["traceEvents"])
    assert float(top[1]) == pytest.approx(in_trace / 3, abs=0.05), (top, in_trace)


# ---------------------------------------------------------------------------------- NVML, replaced

def test_utilisation_is_sampled_beside_training_and_averaged_per_gpu(monkeypatch):
    monkeypatch.setattr(utilisation, "SAMPLE_SECONDS", 0.01)
    readers = set()

    def read(device):  # two GPUs: 30 % and 90 % busy
        readers.add(threading.current_thread().name)
        return {0: 30, 1: 90}[device.index]

    busy = GpuBusy([torch.device("cuda", 0), torch.device("cuda", 1)], read=read)
    time.sleep(0.2)
    busy.restart()
    time.sleep(0.2)
    assert utilisation_figures(busy) == {"gpu_util_pct": [30.0, 90.0]}
    assert readers <= {"MainThread", "gpu-busy"} and "gpu-busy" in readers  # read in its own thread
    line = log_line({"epoch": 1, "epochs": 1, "step": 2, "batch_size": 8, "lr": 0.1, "train_loss": 1.0,
                     "test_acc": 0.5, "epoch_time_s": 1.0, "img_per_s": 8, "data_wait_frac": 0.0,
                     "gpu_util_pct": [30.0, 90.0]})
    assert line.endswith(" gpu_util_pct=30.00,90.00")


def test_an_epoch_shorter_than_a_sample_still_reads_its_utilisation():
    """A short epoch on a fast GPU ended before the thread's next sample (an H200 run logged
    gpu_util_absent="no NVML sample yet"): NVML is then read once as the window closes."""
    busy = GpuBusy([torch.device("cuda", 0)], read=lambda device: 40)
    time.sleep(0.1)  # the thread's first sample is taken; the next is utilisation.SAMPLE_SECONDS away
    busy.restart()
    assert utilisation_figures(busy) == {"gpu_util_pct": [40.0]}


def test_without_nvml_the_field_says_why():
    def read(device):
        raise ModuleNotFoundError("No module named 'pynvml'")

    busy = GpuBusy([torch.device("cuda", 0)], read=read)
    assert utilisation_figures(busy) == {
        "gpu_util_absent": "NVML cannot be read (ModuleNotFoundError: No module named 'pynvml'); install "
                           "nvidia-ml-py with a "
                           "driver that has NVML"}
