"""Check a machine before a long run: versions, GPUs, topology, copies between GPUs, all-reduce.

A multi-GPU job that fails after an hour, or trains on silently corrupted data, usually had a
machine problem that a minute of checks shows. In order:

- versions: torch, CUDA, cuDNN, NCCL, accelerate, the NVIDIA driver, and the NCCL_* and
  CUDA_VISIBLE_DEVICES settings in effect;
- devices: the GPUs torch sees; nvidia-smi listing GPUs that torch does not see is a failure;
- topology: `nvidia-smi topo -m` (NV# = NVLink; PIX, PXB, PHB, NODE, SYS = PCIe paths, each
  longer than the one before) and the GPU pairs torch reports peer-to-peer access for;
- copies and NCCL transfers: what DataParallel moves between GPUs, compared on arrival, in a child
  process that is killed when a step hangs (--timeout): a known pattern copied between every ordered
  pair of GPUs, as its scatter and gather copy, and broadcast from the first GPU and summed onto it
  with the NCCL calls of its weight broadcast and gradient sum. Broken peer-to-peer (an IOMMU or
  PCIe ACS in the way) returns wrong data without an error, or hangs: the source articles'
  DataParallel loss turned NaN in the first epoch on two PCIe GPUs;
- all-reduce: one process per GPU sums a known pattern over NCCL, the way DDP averages gradients;
  the sum is verified exactly on every process and timed. Bus bandwidth = 2 (n - 1) / n x bytes /
  time, the figure nccl-tests reports, comparable across GPU counts.
On 2 or more GPUs a verdict follows, one line per strategy. NCCL_P2P_DISABLE=1 moves NCCL's traffic
off peer-to-peer (DDP's all-reduce, DataParallel's broadcast and gradient sum), not DataParallel's
scatter and gather copies: with broken copies and NCCL_P2P_DISABLE=1 set, DataParallel stays
unusable and DDP is fine when its all-reduce passes.
Without GPUs it says so and runs the all-reduce on the CPU instead: 2 processes on gloo, the
path that DDP (scripts/train_ddp.py) takes on a CPU-only machine.

Launch:
    python scripts/check_gpus.py
    CUDA_VISIBLE_DEVICES=0,1 python scripts/check_gpus.py    # the GPUs the run will use
    NCCL_P2P_DISABLE=1 python scripts/check_gpus.py          # try a setting the advice names
    python scripts/check_gpus.py --size-mb 256 --iters 50    # a longer bandwidth measurement
Exit status 0 when every check passed, 1 when one failed; what to try is printed under it.
"""

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.tools import synchronize
from common.errors import UserError
from common.parallel.data_parallel import (
    PeerCheckFailed,
    data_parallel_transfers,
    run_transfer_check,
)

P2P_ADVICE = ("do not use DataParallel (scripts/train_dp.py) here: its scatter and gather copy "
              "directly between GPUs even with NCCL_P2P_DISABLE=1; train with NCCL_P2P_DISABLE=1 "
              "accelerate launch ... scripts/train_ddp.py, and ask for the IOMMU "
              "(intel_iommu=off / amd_iommu=off, or iommu=pt) or PCIe ACS to be turned off; see "
              "`nvidia-smi topo -m`")
COPIES, NCCL_TRANSFERS = ("copies between GPUs",
                          "NCCL broadcast and reduce_add (DataParallel's weights and gradients)")
NCCL_ADVICE = ("run again with NCCL_DEBUG=INFO to see the transport NCCL picked; try "
               "NCCL_P2P_DISABLE=1 (broken peer-to-peer), NCCL_SHM_DISABLE=1, NCCL_IB_DISABLE=1 "
               "(no InfiniBand), NCCL_SOCKET_IFNAME=<interface> (several network interfaces)")
GLOO_ADVICE = ("check that localhost resolves and local TCP ports are open; with several network "
               "interfaces set GLOO_SOCKET_IFNAME=lo")
WRONG_SUM_ADVICE = {  # a wrong sum, unlike a failure to connect, means data changed on the way
    "nccl": "data is corrupted between GPUs: DDP would average wrong gradients. Try "
            "NCCL_P2P_DISABLE=1 and run this check again; if that fixes it, peer-to-peer copies "
            "are broken: " + P2P_ADVICE,
    "gloo": "on one machine's CPU no link can corrupt data: suspect the installation; try a fresh "
            "virtual environment with the same torch version"}


@dataclass
class Check:
    name: str
    ok: bool | None  # None: information only
    detail: str
    advice: str = ""

    def __str__(self):
        status = {True: "PASS", False: "FAIL", None: "INFO"}[self.ok]
        text = f"{status}  {self.name}: {self.detail}"
        return text + (f"\n      try: {self.advice}" if self.advice else "")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64,
                        help="size of the all-reduced tensor in MB of 10^6 bytes "
                             "(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed all-reduces (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds before a stalled transfer between GPUs (one step of the copy "
                             "check, or the all-reduce) counts as a hang (default: %(default)s)")
    parser.add_argument("--cpu-processes", type=int, default=2,
                        help="processes of the gloo all-reduce on a machine without GPUs "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    for flag in ("size_mb", "timeout"):  # written so that NaN fails too
        if not 0 < getattr(args, flag) < math.inf:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: "
                            f"must be a positive number, e.g. {parser.get_default(flag):g}")
    if args.iters < 1:
        raise UserError(f"--iters {args.iters}: must be 1 or more")
    if args.cpu_processes < 2:  # one process sums with no one: nothing would go between processes
        raise UserError(f"--cpu-processes {args.cpu_processes}: must be 2 or more")
    return args


# ----------------------------------------------------------------------------------------- checks

def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", *args], check=False, capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def check_versions() -> Check:
    def installed(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    found = {"torch": torch.__version__,
             "CUDA (torch built with)": torch.version.cuda or "none (CPU build)",
             "accelerate": installed("accelerate")}
    if torch.cuda.is_available():
        found["cuDNN"] = str(torch.backends.cudnn.version())
        found["NCCL"] = ".".join(map(str, torch.cuda.nccl.version()))
    driver = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    if driver:
        found["driver"] = driver.splitlines()[0]
    settings = {k: v for k, v in os.environ.items()
                if k.startswith(("NCCL_", "GLOO_")) or k == "CUDA_VISIBLE_DEVICES"}
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    return Check("versions", None,
                 detail + "; settings: " + (" ".join(f"{k}={v}" for k, v in settings.items())
                                            or "none of NCCL_*, GLOO_*, CUDA_VISIBLE_DEVICES"))


def check_devices() -> Check:
    count = torch.cuda.device_count()
    listed = nvidia_smi("--query-gpu=index,name", "--format=csv,noheader")
    if count == 0:
        if listed:
            why = ("this torch is a CPU build: install a CUDA build (pytorch.org, 'Get started')"
                   if torch.version.cuda is None else
                   f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides them"
                   if "CUDA_VISIBLE_DEVICES" in os.environ else
                   f"the driver may be older than torch's CUDA {torch.version.cuda}: see "
                   f"nvidia-smi's CUDA Version")
            return Check("devices", False,
                         f"nvidia-smi lists {len(listed.splitlines())} GPU(s) but torch sees none",
                         why)
        return Check("devices", None, "no GPU: torch.cuda.is_available() is False and there is no "
                                      "nvidia-smi; checking the CPU path instead (DDP on gloo)")
    lines = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {p.name}, {p.total_memory / 1e9:.1f} GB, "
                     f"compute capability {p.major}.{p.minor}")
    return Check("devices", True, f"{count} GPU(s): " + "; ".join(lines))


def check_topology(count: int) -> Check:
    matrix = nvidia_smi("topo", "-m")
    peers = [f"{i}->{j}" for i in range(count) for j in range(count)
             if i != j and torch.cuda.can_device_access_peer(i, j)]
    detail = f"peer access reported for {', '.join(peers) if peers else 'no pair'}"
    if count > 1 and len(peers) < count * (count - 1):
        detail += " (copies between the other pairs go through host memory, slower but not broken)"
    return Check("topology", None,
                 detail + ("\n" + matrix if matrix else "; `nvidia-smi topo -m` not available"))


def check_transfers(devices: list[torch.device], timeout: float,
                    check=data_parallel_transfers) -> list[Check]:
    """What DataParallel moves between GPUs (common.parallel.data_parallel.data_parallel_transfers,
    or ``check``), in a child process killed when one step takes over ``timeout`` seconds: its
    scatter and gather copies, then its NCCL broadcast and reduce_add."""
    try:
        copies, nccl = run_transfer_check(devices, timeout, check)
    except PeerCheckFailed as failure:
        # named by the step it stopped in: the steps say "NCCL's ..."
        return [Check(NCCL_TRANSFERS if "NCCL" in (failure.step or "") else COPIES, False,
                      str(failure), P2P_ADVICE)]
    bad = [f"{source} -> {target}" for source, target in copies]
    pairs = len(devices) * (len(devices) - 1)
    checks = [Check(COPIES, False, f"{len(bad)} of {pairs} copies returned wrong data: "
                                   f"{', '.join(bad)}", P2P_ADVICE)
              if bad else Check(COPIES, True, f"all {pairs} ordered pairs copied 4 MiB intact")]
    if nccl:
        advice = (NCCL_ADVICE if os.environ.get("NCCL_P2P_DISABLE") == "1" else
                  "try NCCL_P2P_DISABLE=1 and run this check again; if that fixes it, NCCL's "
                  "peer-to-peer path is broken: set it for every run")
        return checks + [Check(NCCL_TRANSFERS, False, "wrong data from " + ", ".join(nccl), advice)]
    return checks + [Check(NCCL_TRANSFERS, True, f"4 MiB broadcast from {devices[0]} to every GPU "
                                                 f"and summed onto it, exact")]


def verdict(transfers: list[Check], allreduce: Check) -> list[str]:
    """Which multi-GPU strategy to train with on this machine, one line each, from the checks of
    DataParallel's transfers (check_transfers) and of DDP's all-reduce, under the NCCL_P2P_DISABLE
    in effect: it moves NCCL's traffic off peer-to-peer, not DataParallel's scatter and gather
    copies."""
    p2p_off = os.environ.get("NCCL_P2P_DISABLE") == "1"
    failed = [check.name for check in transfers if check.ok is False]
    copies_broken = COPIES in failed
    if not failed:
        dp = "OK"
    elif copies_broken and p2p_off:
        dp = ("do not use: its scatter and gather copy directly between GPUs, and those copies "
              "fail; NCCL_P2P_DISABLE=1 (set now) does not change them")
    else:
        dp = f"do not use: {' and '.join(failed)} failed"
    if not allreduce.ok:
        ddp = ("do not use: the all-reduce failed"
               + (" even with NCCL_P2P_DISABLE=1" if p2p_off else ""))
    elif p2p_off:
        ddp = "OK with NCCL_P2P_DISABLE=1, as set now"
    elif copies_broken:
        ddp = ("the all-reduce passed, but copies between GPUs fail: train with NCCL_P2P_DISABLE=1 "
               "and run this check again with it set")
    else:
        ddp = "OK"
    return [f"verdict: DataParallel (train_dp.py): {dp}",
            f"verdict: DDP (train_ddp.py, train_amp.py): {ddp}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def known_pattern(numel: int, device) -> torch.Tensor:
    """Small whole numbers: their sums over up to 64 processes are exact in float32."""
    return (torch.arange(numel, device=device) % 251 + 1).float()


def allreduce_worker(rank: int, world_size: int, backend: str, port: int, numel: int, iters: int,
                     timeout: float, results) -> None:
    """One process of the all-reduce: sum (rank + 1) x pattern, verify, then time ``iters`` more."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pattern = known_pattern(numel, device)
    result = pattern * (rank + 1)
    dist.all_reduce(result)  # the sum of (r + 1) over the ranks: world_size (world_size + 1) / 2
    wrong = int((result != pattern * (world_size * (world_size + 1) // 2)).sum())
    buffer = pattern.clone()
    for _ in range(2):  # warm-up: connections and buffers are set up on the first calls
        dist.all_reduce(buffer)
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    synchronize(device)
    results.put((rank, wrong, (time.perf_counter() - start) / iters))
    dist.destroy_process_group()


def check_allreduce(world_size: int, backend: str, size_mb: float, iters: int,
                    timeout: float) -> Check:
    name = f"all-reduce, {world_size} processes on {backend}"
    advice = NCCL_ADVICE if backend == "nccl" else GLOO_ADVICE
    numel = max(1, int(size_mb * 1e6) // 4)
    # CUDA cannot be used in a forked child, nor can macOS's system libraries: gloo's processes on
    # a Linux CPU fork, torch imported (spawned, each imports it again: 12 s of CPU on 2 cores).
    method = "fork" if backend == "gloo" and sys.platform == "linux" else "spawn"
    results = mp.get_context(method).SimpleQueue()
    workers = mp.start_processes(allreduce_worker, args=(world_size, backend, free_port(), numel,
                                                         iters, timeout, results),
                                 nprocs=world_size, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while not workers.join(timeout=1):
            if time.monotonic() > deadline:
                for process in workers.processes:
                    process.kill()
                return Check(name, False, f"no result after {timeout:g} s: the all-reduce hangs",
                             advice)
    except Exception as error:  # noqa: BLE001 - a worker raised or died: the last line of its error
        return Check(name, False, f"a process failed: {str(error).strip().splitlines()[-1]}",
                     advice)
    reports = sorted(results.get() for _ in range(world_size))
    wrong = {rank: count for rank, count, _ in reports if count}
    seconds = max(s for _, _, s in reports)
    size = numel * 4
    bus = 2 * (world_size - 1) / world_size * size / seconds
    if wrong:
        ranks = ", ".join(f"process {rank}: {count} of {numel}" for rank, count in wrong.items())
        return Check(name, False, f"wrong sums ({ranks} values differ from the known answer)",
                     WRONG_SUM_ADVICE[backend])
    detail = (f"sum verified on every process; {size / 1e6:.0f} MB in {1000 * seconds:.2f} ms: "
              f"bus bandwidth {bus / 1e9:.2f} GB/s, algorithm bandwidth "
              f"{size / seconds / 1e9:.2f} GB/s")
    if backend == "nccl" and bus < 5e9:
        return Check(name, True, detail, "bus bandwidth is below 5 GB/s, slow even for PCIe: look "
                                         "for SYS links in the topology, NCCL_P2P_DISABLE set, or "
                                         + NCCL_ADVICE)
    return Check(name, True, detail)


def main(args) -> int:
    print(check_versions(), flush=True)
    devices_check = check_devices()
    print(devices_check, flush=True)
    checks = [devices_check]
    count = torch.cuda.device_count()
    if count:
        checks.append(check_topology(count))
        print(checks[-1], flush=True)
    if count > 1:
        transfers = check_transfers([torch.device("cuda", i) for i in range(count)], args.timeout)
        print(*transfers, sep="\n", flush=True)
        checks += transfers
        checks.append(check_allreduce(count, "nccl", args.size_mb, args.iters, args.timeout))
    elif count == 1:
        checks.append(Check("all-reduce", None, "one GPU: nothing to copy or reduce between GPUs"))
    else:
        checks.append(check_allreduce(args.cpu_processes, "gloo", args.size_mb, args.iters,
                                      args.timeout))
    print(checks[-1], flush=True)
    if count > 1:
        print(*verdict(transfers, checks[-1]), sep="\n", flush=True)
    failed = [c.name for c in checks if c.ok is False]
    print(f"check_gpus: {len(failed)} check(s) failed: {', '.join(failed)}" if failed else
          "check_gpus: every check passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
