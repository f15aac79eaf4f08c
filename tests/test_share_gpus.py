"""--share-gpus: several processes on each GPU, to rehearse a launch for more GPUs than the machine
has. Without it more processes than GPUs is refused; with it the backend is NCCL where its version
shares a GPU (2.30 and newer, asked in the environment), else gloo, and the run says which.

These are the decisions, made here with the GPU count and NCCL version a GPU machine would report;
the 2-process gloo runs with --share-gpus (tests/test_train_ddp.py) and its refusal on a CPU
(tests/test_bad_input.py) are the same code launched for real. On a GPU: tests/test_gpu.py."""

import os
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState

from common.cli import Parser, add_ddp_args
from common.errors import UserError
from common.observe.tracking import start_line
from common.parallel import launch
from common.parallel.fsdp import refuse_gloo

OLD, NEW = (2, 28, 9), (2, 30, 7)  # the GPU machines' torch 2.11; torch 2.14's bundled NCCL


def on_node(monkeypatch, processes: int, gpus: int, nccl=OLD, rank: int = 0):
    """This process as torchrun starts local rank ``rank`` of ``processes`` on a node of ``gpus``."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(launch, "nccl_version", lambda: nccl)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    for name in ("NCCL_MULTI_RANK_GPU_ENABLE", "ACCELERATE_BYPASS_DEVICE_MAP",  # what set_gpu_sharing sets
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(name, "")  # so that monkeypatch removes it again after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(PartialState, "wait_for_everyone", PartialState.wait_for_everyone)  # and this


REFUSAL = ("the launch starts 8 processes on this node but it has 4 GPUs: pass --num_processes 4 (per node) to "
           "accelerate launch, or use a config for 4 GPUs (to rehearse this launch here, several processes a GPU: "
           "add --share-gpus)")


def test_more_processes_than_gpus_is_refused_in_one_line_a_node(monkeypatch):
    on_node(monkeypatch, 8, 4)
    with pytest.raises(UserError) as error:
        launch.set_gpu_sharing(None)
    assert error.value.message == REFUSAL
    on_node(monkeypatch, 8, 4, rank=5)  # the node's other processes stop too, without a second line
    with pytest.raises(SystemExit) as quiet:
        launch.set_gpu_sharing(None)
    assert not isinstance(quiet.value, UserError) and quiet.value.code == 1
    on_node(monkeypatch, 4, 4)  # one process per GPU: nothing to share, NCCL as Accelerate picks it
    assert launch.set_gpu_sharing(None) is None and launch.set_gpu_sharing("auto") is None
    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in os.environ and "ACCELERATE_BYPASS_DEVICE_MAP" not in os.environ


@pytest.mark.parametrize(("given", "chosen"), [(None, "2"), ("1", "2"), ("0", "0"), ("3", "3")])
def test_nccl_errors_reach_the_main_thread_unless_the_user_chose_another_mode(monkeypatch, given, chosen):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING: torchrun's 1 (or none) becomes 2, CleanUpOnly, under which NCCL's
    watchdog raises in the main thread instead of aborting the process; another mode set is kept. What NCCL
    then does is a GPU check (tests/test_gpu.py)."""
    on_node(monkeypatch, 4, 4)
    if given is not None:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given)
    launch.set_gpu_sharing(None)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == chosen


# (--share-gpus, processes, GPUs, NCCL) -> (processes per GPU, backend)
CHOICES = [
    (("auto", 2, 1, NEW), (2, "nccl")), (("auto", 2, 1, (2, 31, 0)), (2, "nccl")),
    (("auto", 2, 1, OLD), (2, "gloo")), (("auto", 8, 1, None), (8, "gloo")),  # no NCCL in this torch
    (("gloo", 2, 1, NEW), (2, "gloo")), (("nccl", 8, 4, NEW), (2, "nccl")),
    (("auto", 3, 2, OLD), (2, "gloo")),  # Accelerate puts rank r on GPU r % 2: 2 on GPU 0, 1 on GPU 1
    (("auto", 2, 2, OLD), (1, None)), ((None, 1, 1, OLD), (1, None)),  # a GPU each: no change
    (("auto", 2, 0, None), (0, "gloo")), ((None, 2, 0, None), (0, None)),  # the CPU: gloo either way
    (("auto", 1, 0, None), (0, None)),  # one process: no process group to name a backend for
]


@pytest.mark.parametrize("given, chosen", CHOICES, ids=[str(given) for given, _ in CHOICES])
def test_the_backend_is_nccl_where_it_shares_a_gpu_else_gloo(given, chosen):
    assert launch.plan_gpu_sharing(*given) == chosen


@pytest.mark.parametrize("given, message", [
    (("nccl", 2, 1, OLD), "--share-gpus nccl: this torch's NCCL (2.28.9) refuses several processes on one GPU; "
                          "2.30 and newer share it: use --share-gpus gloo"),
    (("nccl", 2, 1, None), "--share-gpus nccl: this torch's NCCL (none) refuses several processes on one GPU; "
                           "2.30 and newer share it: use --share-gpus gloo"),
    (("nccl", 2, 0, None), "--share-gpus nccl: no GPU here, and NCCL reduces GPU tensors only: use --share-gpus "
                           "gloo, or drop the flag"),
])
def test_nccl_asked_where_it_cannot_share_is_refused(given, message):
    with pytest.raises(UserError) as error:
        launch.plan_gpu_sharing(*given)
    assert error.value.message == message


FSDP_OVER_GLOO = "--share-gpus: FSDP2's processes share a GPU over NCCL only (over gloo its collectives on sharded " \
                 "CUDA tensors crash, pytorch#132471); "
OLD_NCCL_ADVICE = ("this torch's NCCL (2.28.9) cannot share a GPU: use a torch whose NCCL is 2.30 or newer, pass "
                   "--num_processes 1 (per node) to accelerate launch, or rehearse the launch with train_ddp.py "
                   "--share-gpus")


def test_fsdp2_shares_a_gpu_over_nccl_only(monkeypatch):
    """Over gloo FSDP2's two processes sharing an H200 both died of SIGSEGV (torch 2.11, docs/gpu/nvidia-h200.md):
    refused in one line before any process group, with what to do; over NCCL, on a CPU and a GPU each it runs."""
    for given, instead in [(("auto", 2, 1, OLD), OLD_NCCL_ADVICE), (("nccl", 2, 1, OLD), OLD_NCCL_ADVICE),
                           (("gloo", 8, 4, NEW), "use --share-gpus nccl")]:
        with pytest.raises(UserError) as error:
            launch.plan_gpu_sharing(*given, refuse_gloo=refuse_gloo)
        assert error.value.message == FSDP_OVER_GLOO + instead
    assert launch.plan_gpu_sharing("auto", 2, 1, NEW, refuse_gloo=refuse_gloo) == (2, "nccl")
    assert launch.plan_gpu_sharing("nccl", 8, 4, NEW, refuse_gloo=refuse_gloo) == (2, "nccl")
    assert launch.plan_gpu_sharing("auto", 2, 0, None, refuse_gloo=refuse_gloo) == (0, "gloo")
    assert launch.plan_gpu_sharing(None, 4, 4, OLD, refuse_gloo=refuse_gloo) == (1, None)
    on_node(monkeypatch, 2, 1, nccl=OLD)  # what train_fsdp.py calls: the refusal, as the other launch refusals
    with pytest.raises(UserError) as error:
        launch.set_gpu_sharing("auto", refuse_gloo=refuse_gloo)
    assert error.value.message.startswith(FSDP_OVER_GLOO)


def test_nccl_is_asked_to_share_in_the_environment_unless_the_user_said_otherwise(monkeypatch):
    on_node(monkeypatch, 2, 1, nccl=NEW)
    assert launch.set_gpu_sharing("auto") == "nccl" and os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    on_node(monkeypatch, 2, 1, nccl=NEW)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")  # the user's own setting stays
    assert launch.set_gpu_sharing("nccl") == "nccl" and os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "0"
    on_node(monkeypatch, 2, 1, nccl=OLD)  # gloo: NCCL is not asked for anything
    assert launch.set_gpu_sharing("auto") == "gloo" and "NCCL_MULTI_RANK_GPU_ENABLE" not in os.environ


def test_shared_gpus_put_accelerate_s_barrier_on_the_process_s_own_gpu(monkeypatch):
    """Accelerate's wait_for_everyone asks torch for a barrier on cuda:<local rank>, where torch allocates
    its tensor: rank 1 of 2 on one GPU would ask for cuda:1. Shared, the barrier is on the GPU the process
    uses (torch.cuda.current_device, which Accelerate set to local rank % GPUs); unshared, Accelerate's own."""
    barriers = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda device_ids=None: barriers.append(device_ids))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_node(monkeypatch, 2, 2, nccl=OLD, rank=1)  # a GPU each: Accelerate's barrier untouched
    launch.set_gpu_sharing("auto")
    assert PartialState.wait_for_everyone is not launch._wait_on_own_gpu
    on_node(monkeypatch, 2, 1, nccl=OLD, rank=1)
    launch.set_gpu_sharing("auto")
    assert PartialState.wait_for_everyone is launch._wait_on_own_gpu
    PartialState.wait_for_everyone(SimpleNamespace(local_process_index=1))
    assert barriers == [[0]]


def test_shared_gpus_give_ddp_no_device_ids(monkeypatch):
    """Accelerate gives DDP device_ids=[local rank]: rank 1 of 2 on one GPU would ask for cuda:1, which
    does not exist. Sharing makes prepare() pass none, so DDP uses the device the model is on. Here
    on gloo CPU processes' terms: a 1-process Accelerator, its DDP wrap read after prepare()."""
    on_node(monkeypatch, 2, 1, nccl=OLD)
    launch.set_gpu_sharing("auto")
    assert os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] == "true"
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK"):  # the Accelerator below is one process alone
        monkeypatch.delenv(name)
    seen = {}

    class Recorded(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            seen.update(device_ids=device_ids, output_device=output_device)
            raise RuntimeError("recorded")  # no process group here: the arguments are what is checked

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Recorded)
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(type(accelerator), "multi_device", property(lambda self: True))
    with pytest.raises(RuntimeError, match="recorded"):
        accelerator.prepare_model(torch.nn.Linear(2, 2))
    assert seen == {"device_ids": None, "output_device": None}
    monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", "false")  # unshared: Accelerate's own choice
    with pytest.raises(RuntimeError, match="recorded"):
        accelerator.prepare_model(torch.nn.Linear(2, 2))
    assert seen == {"device_ids": [0], "output_device": 0}
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_flag_alone_means_auto():
    parser = Parser("")
    add_ddp_args(parser)
    assert parser.parse_args(["--share-gpus"]).share_gpus == "auto"
    assert parser.parse_args(["--share-gpus", "gloo"]).share_gpus == "gloo"
    assert parser.parse_args([]).share_gpus is None


CONFIG = {"args": {"model": "resnet20", "deterministic": False}, "global_batch_size": 64, "per_device_batch_size": 32,
          "grad_accum": 1, "fp32_precision": "tf32", "train_size": 512, "data": "synthetic", "steps_per_epoch": 8,
          "total_steps": 8, "lr": 0.1}


def test_a_shared_run_says_so_at_the_start_and_in_its_config(monkeypatch, tmp_path):
    on_node(monkeypatch, 2, 1, nccl=OLD)
    shared = SimpleNamespace(device=torch.device("cuda", 0), num_processes=2, state=SimpleNamespace(backend="gloo"))
    record = launch.launch_record(shared)
    note = ("warning: --share-gpus: 2 processes on 1 GPU(s) of this node, up to 2 a GPU, over gloo, its collectives "
            "copied through host memory (NCCL 2.28.9 cannot share a GPU: 2.30 can): a rehearsal that proves the "
            "launch, its collectives, checkpoints and resume; its speed and memory figures say nothing of 2 GPUs")
    assert record == {"world_size": 2, "device": "cuda:0", "backend": "gloo", "processes_per_gpu": 2,
                      "gpu_sharing": note}
    line = start_line("train_ddp", "2 x cuda:0", {**CONFIG, **record}, "device loader", tmp_path)
    assert line.startswith("train_ddp: resnet20 on 2 x cuda:0 (gloo), batch 64") and line.splitlines()[1].strip() == note
    on_node(monkeypatch, 2, 1, nccl=NEW)
    shared.state.backend = "nccl"
    assert launch.launch_record(shared)["gpu_sharing"].startswith(
        "warning: --share-gpus: 2 processes on 1 GPU(s) of this node, up to 2 a GPU, over NCCL 2.30.7 "
        "(NCCL_MULTI_RANK_GPU_ENABLE=1): a rehearsal")
    on_node(monkeypatch, 2, 2)  # a GPU each: said nowhere, the backend recorded
    shared.state.backend = "nccl"
    assert launch.launch_record(shared) == {"world_size": 2, "device": "cuda:0", "backend": "nccl",
                                            "processes_per_gpu": 1, "gpu_sharing": None}


def test_one_process_records_no_backend(tmp_path):
    record = launch.launch_record(Accelerator(cpu=True))
    assert record == {"world_size": 1, "device": "cpu", "backend": None, "processes_per_gpu": None,
                      "gpu_sharing": None}
    assert "(" not in start_line("train_single", "cpu", {**CONFIG, **record}, "x", tmp_path).split(",")[0]
