"""The check of transfers between GPUs (common.parallel.data_parallel, train_dp.py's and check_gpus.py's), on a CPU.

Broken peer-to-peer can corrupt a copy or hang it, so the check runs in a spawned child that is
killed when a step hangs. The child's function is injected: module-level functions below that pass,
return a broken pair, hang, raise or die, each run in a real child. The default function's own logic
(every ordered pair copied, a wrong NCCL broadcast or sum found) runs in-process on CPU devices with
torch's comm calls faked, and check_gpus.py's verdict under NCCL_P2P_DISABLE=1 runs in-process with
faked GPUs.
"""

import importlib.util
import multiprocessing
import os
import time

import pytest
import torch
from helpers import ROOT

import common.parallel.data_parallel
from common.errors import UserError
from common.parallel.data_parallel import (
    PEER_ADVICE,
    broken_nccl_transfers,
    broken_peer_copies,
    check_peer_copies,
    data_parallel_transfers,
)

GPUS = [torch.device("cuda", i) for i in range(3)]  # only names: the injected checks never touch a GPU
CPUS = [torch.device("cpu", i) for i in range(3)]  # devices a CPU can really copy between


def load_check_gpus():
    spec = importlib.util.spec_from_file_location("check_gpus", ROOT / "scripts" / "check_gpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------- injected checks: run in the child, so at module level

def copies_on_the_cpu(devices, started):
    return broken_peer_copies(devices, started), []


def one_broken_pair(devices, started):
    return [(devices[1], devices[2])], []


def hangs_on_the_second_copy(devices, started):
    started(f"the copy {devices[0]} -> {devices[1]}")
    started(f"the copy {devices[0]} -> {devices[2]}")
    time.sleep(600)


def raises(devices, started):
    started(f"the copy {devices[0]} -> {devices[1]}")
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")


def dies_in_the_broadcast(devices, started):
    started(f"NCCL's broadcast {devices[0]} -> {devices[1]}")
    os._exit(3)  # as a segfault in a driver would: no exception, no message


# ------------------------------------------------------------------------ in a child process

def test_intact_copies_pass_in_a_child():
    check_peer_copies(CPUS, check=copies_on_the_cpu)  # the real copy loop, spawned


def test_a_broken_pair_stops_train_dp_with_one_line_naming_it():
    with pytest.raises(UserError) as error:
        check_peer_copies(GPUS, check=one_broken_pair)
    message = error.value.message
    assert message.startswith("the GPU-to-GPU copy cuda:1 -> cuda:2 returned wrong data: peer-to-peer copies are "
                              "broken on this machine; ")
    assert message.endswith(PEER_ADVICE) and "\n" not in message
    assert "scatter and gather copy directly between GPUs even with NCCL_P2P_DISABLE=1" in message
    assert "NCCL_P2P_DISABLE=1 accelerate launch ... scripts/train_ddp.py" in message


def test_a_hung_copy_is_killed_and_named():
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        check_peer_copies(GPUS, timeout=1, check=hangs_on_the_second_copy)
    # the child's start (spawned: importing torch and this file, 34 s once on 2 cores shared with 3 pytest
    # workers) plus 1 s, not its 600 s sleep
    assert time.monotonic() - start < 120
    assert error.value.message == ("the copy cuda:0 -> cuda:2 got no answer in 1 s: it hangs, as broken peer-to-peer "
                                   f"can; {PEER_ADVICE}")
    assert not multiprocessing.active_children()  # killed, not left behind


def test_an_error_in_the_child_is_one_line():
    with pytest.raises(UserError) as error:
        check_peer_copies(GPUS, timeout=2, check=raises)
    assert error.value.message == ("the copy cuda:0 -> cuda:1 failed: RuntimeError: CUDA error: an illegal memory "
                                   f"access was encountered; {PEER_ADVICE}")


def test_check_gpus_fails_the_check_when_the_child_dies():
    check_gpus = load_check_gpus()
    (result,) = check_gpus.check_transfers(GPUS, 2, check=dies_in_the_broadcast)
    assert result.ok is False and result.name == check_gpus.NCCL_TRANSFERS
    assert result.detail == ("the process checking transfers between GPUs died (exit code 3) during NCCL's "
                             "broadcast cuda:0 -> cuda:1")
    assert result.advice == check_gpus.P2P_ADVICE and "\n" not in result.detail


# -------------------------------------------------------------- the default check, in-process

def test_every_ordered_pair_is_copied_and_a_wrong_one_named(monkeypatch):
    steps = []

    def zeros_into_cpu_2(values, source, target):  # what an IOMMU in the way delivers: right size, wrong data
        return torch.zeros_like(values) if target.index == 2 else values.clone()

    monkeypatch.setattr(common.parallel.data_parallel, "peer_copy", zeros_into_cpu_2)
    assert broken_peer_copies(CPUS, steps.append) == [(CPUS[0], CPUS[2]), (CPUS[1], CPUS[2])]
    assert steps == [f"the copy cpu:{a} -> cpu:{b}" for a in range(3) for b in range(3) if a != b]


def test_a_wrong_nccl_broadcast_or_sum_is_named(monkeypatch):
    comm = torch.nn.parallel.comm
    # What DataParallel's calls return, made on the CPU: one list of tensors per device, and the sums.
    monkeypatch.setattr(comm, "broadcast_coalesced", lambda tensors, devices: [[t.clone() for t in tensors]
                                                                               for _ in devices])
    monkeypatch.setattr(comm, "reduce_add_coalesced", lambda inputs, destination: tuple(map(sum, zip(*inputs))))
    steps = []
    assert broken_nccl_transfers(CPUS, steps.append) == []
    assert steps == ["NCCL's broadcast cpu:0 -> cpu:1, cpu:2", "NCCL's reduce_add cpu:1, cpu:2 -> cpu:0"]

    def stale_on_cpu_1(tensors, devices):
        return [[t.clone() if device.index != 1 else torch.zeros_like(t) for t in tensors] for device in devices]

    def one_share_twice(inputs, destination):  # GPU 2's share lost, GPU 1's added in its place
        return tuple(map(sum, zip(*inputs[:2], inputs[1])))

    monkeypatch.setattr(comm, "broadcast_coalesced", stale_on_cpu_1)
    monkeypatch.setattr(comm, "reduce_add_coalesced", one_share_twice)
    assert broken_nccl_transfers(CPUS) == ["NCCL's broadcast cpu:0 -> cpu:1, cpu:2 (wrong on cpu:1)",
                                           "NCCL's reduce_add cpu:1, cpu:2 -> cpu:0"]


def test_a_wrong_nccl_transfer_stops_train_dp_with_the_p2p_advice(monkeypatch):
    monkeypatch.setattr(common.parallel.data_parallel, "run_transfer_check",
                        lambda devices, timeout, check: ([], ["NCCL's reduce_add cuda:1, cuda:2 -> cuda:0"]))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    with pytest.raises(UserError, match="^error: NCCL's reduce_add cuda:1, cuda:2 -> cuda:0 returned wrong data, "
                                        "though direct copies arrived intact: .* run with NCCL_P2P_DISABLE=1"):
        check_peer_copies(GPUS)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    with pytest.raises(UserError, match="even with NCCL_P2P_DISABLE=1: NCCL is broken on this machine beyond"):
        check_peer_copies(GPUS)


def test_the_default_check_is_all_of_data_parallels_transfers(monkeypatch):
    monkeypatch.setattr(common.parallel.data_parallel, "broken_peer_copies", lambda devices, started: ["copies"])
    monkeypatch.setattr(common.parallel.data_parallel, "broken_nccl_transfers", lambda devices, started: ["nccl"])
    assert data_parallel_transfers(GPUS, print) == (["copies"], ["nccl"])


# ------------------------------------------------------------- check_gpus.py's verdict, in-process

@pytest.mark.parametrize("p2p_disabled", [True, False])
def test_check_gpus_verdict_with_broken_copies(monkeypatch, capsys, p2p_disabled):
    """Broken direct copies, NCCL's transfers and all-reduce intact: with NCCL_P2P_DISABLE=1 set,
    DataParallel stays broken (its scatter and gather do not go through NCCL) and DDP is fine."""
    check_gpus = load_check_gpus()
    if p2p_disabled:
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    else:
        monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(check_gpus, "check_devices", lambda: check_gpus.Check("devices", True, "2 GPU(s)"))
    monkeypatch.setattr(check_gpus, "check_topology", lambda count: check_gpus.Check("topology", None, "PIX"))
    monkeypatch.setattr(check_gpus, "run_transfer_check",
                        lambda devices, timeout, check: ([(devices[0], devices[1]), (devices[1], devices[0])], []))
    monkeypatch.setattr(check_gpus, "check_allreduce", lambda world_size, backend, *args: check_gpus.Check(
        f"all-reduce, {world_size} processes on {backend}", True, "sum verified on every process"))
    assert check_gpus.main(check_gpus.parse_args([])) == 1
    out = capsys.readouterr().out
    assert "FAIL  copies between GPUs: 2 of 2 copies returned wrong data: cuda:0 -> cuda:1, cuda:1 -> cuda:0" in out
    assert f"PASS  {check_gpus.NCCL_TRANSFERS}: 4 MiB broadcast from cuda:0" in out
    assert "check_gpus: 1 check(s) failed: copies between GPUs" in out
    if p2p_disabled:
        assert "settings: NCCL_P2P_DISABLE=1" in out
        assert ("verdict: DataParallel (train_dp.py): do not use: its scatter and gather copy directly between GPUs, "
                "and those copies fail; NCCL_P2P_DISABLE=1 (set now) does not change them\n") in out
        assert "verdict: DDP (train_ddp.py, train_amp.py): OK with NCCL_P2P_DISABLE=1, as set now\n" in out
    else:
        assert "verdict: DataParallel (train_dp.py): do not use: copies between GPUs failed\n" in out
        assert ("verdict: DDP (train_ddp.py, train_amp.py): the all-reduce passed, but copies between GPUs fail: "
                "train with NCCL_P2P_DISABLE=1 and run this check again with it set\n") in out


def test_check_gpus_verdict_when_everything_passes_or_the_all_reduce_fails(monkeypatch):
    check_gpus = load_check_gpus()
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    good = [check_gpus.Check(check_gpus.COPIES, True, ""), check_gpus.Check(check_gpus.NCCL_TRANSFERS, True, "")]
    assert check_gpus.verdict(good, check_gpus.Check("all-reduce", True, "")) == [
        "verdict: DataParallel (train_dp.py): OK",
        "verdict: DDP (train_ddp.py, train_amp.py): OK with NCCL_P2P_DISABLE=1, as set now"]
    assert check_gpus.verdict(good, check_gpus.Check("all-reduce", False, ""))[1] == (
        "verdict: DDP (train_ddp.py, train_amp.py): do not use: the all-reduce failed even with NCCL_P2P_DISABLE=1")
