"""The GPU paths of common/ tested on the CPU: CUDA calls patched where the code asks the hardware.

What only a GPU can show (no host-device synchronisation per step, TF32 and bit-for-bit resume
under --deterministic on real kernels) is in tests/test_gpu.py, run by `make gpu-check`.
"""

import dataclasses
import os
import signal
import sys
import types

import pytest
import torch

from common.data.device import on_device
from common.data.synthetic import make_synthetic
from common.data.transform import BatchTransform
from common.errors import UserError
from common.observe import tracking, utilisation
from common.observe.tracking import start_tracking
from common.observe.utilisation import DataWait
from common.parallel.amp import SkippedSteps, choose_mixed_precision
from common.parallel.step_guard import STOPPED_EXIT_CODE, StepGuard, announce_stop
from common.recipe.numerics import set_numerics
from common.run.checkpoints import latest_checkpoint


class FakeAccelerator:
    """What the guards use of an Accelerator, in one process."""

    is_main_process = True
    num_processes, process_index = 1, 0
    device = torch.device("cpu")

    def __init__(self):
        self.waited = self.ended = 0
        self.printed = []
        self.optimizer_step_was_skipped = False
        self.scaler = type("Scaler", (), {"get_scale": lambda self: 2.0 ** -30})()

    def reduce(self, tensor, reduction):
        return tensor.clone()

    def wait_for_everyone(self):
        self.waited += 1

    def print(self, *values, **kwargs):
        self.printed.append(" ".join(map(str, values)))

    def end_training(self):
        self.ended += 1


class OtherProcessSignalled(FakeAccelerator):
    num_processes = 2

    def reduce(self, tensor, reduction):  # the sum over 2 processes, the other one signalled
        return tensor + torch.tensor([0.0, 1.0]) if tensor.dim() else tensor + 1


def checkpoints(folder, *steps):
    for step in steps:
        (folder / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (folder / "checkpoints" / f"step_{step:08d}" / "checkpoint.json").write_text('{"files": {}, "crc32": {}}')


# ------------------------------------------------------------------------------ non-finite loss

def test_a_non_finite_loss_stops_before_anything_is_saved(tmp_path, capsys):
    checkpoints(tmp_path, 40)
    accelerator = FakeAccelerator()
    guard = StepGuard(accelerator, tmp_path)
    assert guard.check(torch.tensor(2.3), 41) is None
    stop = guard.check(torch.tensor(float("nan")), 42)  # on a CPU read at once; on a GPU one step later
    assert stop is not None and not stop.saves and stop.exit_code == 1
    assert announce_stop(accelerator, stop, 42, None) == 1
    assert accelerator.waited == 1 and accelerator.ended == 0  # every process speaks before any exits
    assert capsys.readouterr().err == (
        f"error: the loss is nan at step 42: training stopped and nothing of that step was saved; the last good "
        f"checkpoint is {tmp_path / 'checkpoints' / 'step_00000040'}: resume from it with a lower --lr (the "
        f"same command with --resume and the new --lr)\n")


def test_after_a_nan_the_checkpoints_written_since_the_loss_grew_are_passed_over(tmp_path):
    """Step 40's loss is 10 times the first one read: it is the loss of the weights after step 39, so the
    checkpoints of steps 39 and 40 hold weights that had blown up; step 38's does not."""
    checkpoints(tmp_path, 36, 38, 39, 40)
    guard = StepGuard(FakeAccelerator(), tmp_path)
    for step, loss in ((37, 2.3), (38, 2.5), (39, 9.0), (40, 23.5)):
        assert guard.check(torch.tensor(loss), step) is None
    stop = guard.check(torch.tensor(float("nan")), 41)
    assert stop.message.endswith(
        f"the loss grew from 2.3 to 23.5 at step 40, so the checkpoints since hold weights that blew up; the last "
        f"one before is {tmp_path / 'checkpoints' / 'step_00000038'}: continue from it with a lower --lr (the "
        f"same command with --resume {tmp_path / 'checkpoints' / 'step_00000038'} --output-dir NEW and the new "
        f"--lr)")
    fresh = StepGuard(FakeAccelerator(), tmp_path / "other")  # no checkpoint from before the loss grew
    checkpoints(tmp_path / "other", 1)
    for step, loss in ((1, 2.3), (2, 1e9)):
        fresh.check(torch.tensor(loss), step)
    assert fresh.check(torch.tensor(float("nan")), 3).message.endswith(
        "the loss grew from 2.3 to 1e+09 at step 2, and no checkpoint of this run is from before it: start again "
        "with a lower --lr in a new --output-dir")


def test_a_gpu_step_is_read_one_step_later_and_at_once_before_a_checkpoint(tmp_path, monkeypatch):
    """The GPU path on the CPU: the copy to the host and its event stand in for the device's."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self.clone())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("Event", (), {"record": lambda self, stream: None,
                                                                      "synchronize": lambda self: None})())
    guard = StepGuard(FakeAccelerator(), tmp_path)
    assert guard.check(torch.tensor(1.0), 1) is None
    assert guard.check(torch.tensor(float("inf")), 2) is None  # pending: the host did not wait for it
    stop = guard.check(torch.tensor(1.0), 3)  # step 2's sums arrive with step 3
    assert stop is not None and not stop.saves and "the loss is inf at step 2" in stop.message
    assert "there is no checkpoint yet: start again with a lower --lr" in stop.message
    later = StepGuard(FakeAccelerator(), tmp_path)
    assert later.check(torch.tensor(1.0), 1) is None
    stop = later.check(torch.tensor(float("nan")), 2, now=True)  # a step to be saved: read at once
    assert stop is not None and not stop.saves and "the loss is nan at step 2" in stop.message


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_finishes_the_step_then_every_process_stops(tmp_path, stop_signal, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the failure watch's, put back after the test
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    accelerator = FakeAccelerator()
    try:
        guard = StepGuard(accelerator, tmp_path)
        guard.install_signal_handlers()
        assert guard.check(torch.tensor(2.0), 6) is None
        os.kill(os.getpid(), stop_signal)  # the handler only notes it: this process goes on
        assert guard.received == stop_signal.name and guard.stop is None
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal (the launcher's and SLURM's) changes nothing
        assert guard.received == stop_signal.name
        stop = guard.check(torch.tensor(2.0), 7)
        assert stop is not None and stop.saves and guard.signalled() is stop
        code = announce_stop(accelerator, stop, 7, tmp_path / "checkpoints" / "step_00000007")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the launcher's next SIGTERM waits
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert code == STOPPED_EXIT_CODE == 75 and accelerator.ended == 1
    assert accelerator.printed == [
        f"stopped by {stop_signal.name} after step 7: the training state is in {tmp_path}/checkpoints/step_00000007; "
        f"the same command with --resume continues from there (exit code 75)"]


def test_a_non_finite_loss_overrides_a_stop_signal(tmp_path):
    """A signal and a diverged step together: nothing of the step may be saved."""
    stop = StepGuard(OtherProcessSignalled(), tmp_path).check(torch.tensor(float("nan")), 3)
    assert stop is not None and not stop.saves


def test_a_signal_to_another_process_stops_this_one_at_the_same_step(tmp_path):
    guard = StepGuard(OtherProcessSignalled(), tmp_path)
    stop = guard.check(torch.tensor(2.0), 3)
    assert guard.received is None and stop is not None and stop.saves
    assert stop.message == "a stop signal to another process"
    without = StepGuard(FakeAccelerator(), tmp_path)
    assert without.check(torch.tensor(2.0), 3) is None and without.signalled() is None
    during_evaluation = StepGuard(OtherProcessSignalled(), tmp_path)
    assert during_evaluation.signalled().saves  # at an epoch's end, for a signal during evaluation


# ------------------------------------------------------------------------------ fp16 skipped steps

def test_fp16_stops_after_100_skipped_steps_in_a_row(tmp_path, capsys):
    checkpoints(tmp_path, 100, 150, 200)  # 150 and 200 were saved while every step was skipped
    accelerator = FakeAccelerator()
    skipped = SkippedSteps(accelerator, tmp_path)
    for step in range(101, 201):  # 1 skipped, 1 applied, then 99 skipped in a row: goes on
        accelerator.optimizer_step_was_skipped = step != 102
        skipped.count(step)
    assert skipped.in_epoch == 99 and skipped.in_a_row == 98
    accelerator.optimizer_step_was_skipped = True
    assert skipped.count(201) is None
    stop = skipped.count(202)
    assert stop is not None and not stop.saves
    assert announce_stop(accelerator, stop, 202, None) == 1 and accelerator.waited == 1
    err = capsys.readouterr().err
    assert err.startswith("error: fp16 skipped 100 steps in a row (103 to 202) because the gradients overflowed "
                          "at every loss scale (now 9.31323e-10): training diverged and stopped; the newest "
                          f"checkpoint before them is {tmp_path / 'checkpoints' / 'step_00000100'}: continue "
                          f"from it with a lower --lr or --clip-grad (the same command with --resume "
                          f"{tmp_path / 'checkpoints' / 'step_00000100'} --output-dir NEW and the new flag)")
    assert err.count("\n") == 1


def test_latest_checkpoint_up_to_a_step(tmp_path):
    checkpoints(tmp_path, 50, 100, 150)
    assert latest_checkpoint(tmp_path).name == "step_00000150"
    assert latest_checkpoint(tmp_path, up_to=149).name == "step_00000100"
    assert latest_checkpoint(tmp_path, up_to=49) is None


# ------------------------------------------------------------------------------ the data on the GPU

def test_a_dataset_too_big_for_the_gpu_is_refused_before_the_copy(monkeypatch):
    data = make_synthetic(1000, 200)  # 3.7 MB of images
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6_000_000, 80_000_000_000))
    with pytest.raises(UserError, match=r"^error: the decoded dataset takes 0\.0 GB, and this template keeps it on "
                                        r"every GPU: more than 50% of the 0\.0 GB free on cuda:0; train on fewer"):
        on_device(data, torch.device("cuda", 0))


def test_on_a_cpu_the_data_stays_where_it_is():
    data = make_synthetic(100, 20)
    moved = on_device(data, torch.device("cpu"))
    assert moved.train_images.data_ptr() == data.train_images.data_ptr()  # no copy
    assert dataclasses.replace(moved, source=data.source) == moved


def test_the_normalisation_constants_move_to_the_device_once():
    transform = BatchTransform([120.0, 115.0, 100.0], [60.0, 60.0, 60.0])
    batch = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    transform.eval(batch)
    mean = transform.mean
    transform.train(batch, seed=(0, 1))
    assert transform.mean is mean  # not copied again per batch


# ------------------------------------------------------------------------------ data wait

def test_data_wait_sums_the_waits_of_an_epoch_and_starts_again(monkeypatch):
    """A clock the test moves (a loaded machine's sleeps overshoot): 20 ms waits, 30 ms steps."""
    now = [100.0]
    monkeypatch.setattr(utilisation, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    wait = DataWait(torch.device("cpu"))
    for _ in range(3):
        wait.start()
        now[0] += 0.02  # waiting for the batch
        wait.stop()
        now[0] += 0.03  # the step: not waiting
    assert wait.seconds() == pytest.approx(0.06)  # the waits alone, not the steps (0.15 in all)
    assert wait.seconds() == 0.0


# ------------------------------------------------------------------------------ numerics

@pytest.fixture
def restore_numerics():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32,
              torch.backends.cudnn.allow_tf32, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before[2]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[3], before[4]
    if before[5] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_tf32_only_where_the_gpu_has_it(monkeypatch, restore_numerics):
    capability = {0: (8, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device.index])
    assert set_numerics(torch.device("cuda", 0), tf32=True, deterministic=False) == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
    assert set_numerics(torch.device("cuda", 1), tf32=True, deterministic=False) == "ieee"  # Turing: no TF32
    assert set_numerics(torch.device("cuda", 0), tf32=False, deterministic=False) == "ieee"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert set_numerics(torch.device("cpu"), tf32=True, deterministic=False) == "ieee"


def test_deterministic_turns_off_the_algorithm_search(monkeypatch, restore_numerics):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_numerics(torch.device("cpu"), tf32=True, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_the_mixed_precision_is_chosen_on_the_process_own_gpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)

    def capability(device=None):
        assert device is None and current, "asked before this process's GPU was made current"
        return {0: (9, 0), 1: (7, 5)}[current[-1]]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    for local_rank, expected in (("0", "bf16"), ("1", "fp16")):  # H100 bf16; T4 only emulates it: fp16
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert choose_mixed_precision(None) == expected
    assert current == [0, 1]


# ------------------------------------------------------------------------------ tracking start-up

def test_wandb_start_up_is_bounded_below_the_process_group_timeout(monkeypatch, tmp_path):
    started = {}

    class Accelerator(FakeAccelerator):
        log_with, trackers = ["wandb"], []

        def init_trackers(self, project, config, init_kwargs):
            started.update(init_kwargs["wandb"])

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    progress = type("Progress", (), {"tracker_run_id": None})()
    start_tracking(Accelerator(), {}, tmp_path, progress)
    assert started["settings"] == {"init_timeout": tracking.START_TIMEOUT} and tracking.START_TIMEOUT < 90
    started.clear()
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "30")  # the user's own bound: wandb reads it
    start_tracking(Accelerator(), {}, tmp_path, progress)
    assert "settings" not in started
