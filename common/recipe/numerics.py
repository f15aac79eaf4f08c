"""Numerics: how fp32 math runs (TF32, cuDNN's search, determinism), and where a CPU's tensors
get their memory. AMP's 16-bit format is train_amp.py's own (common.parallel.amp)."""

import ctypes
import os
import platform

import torch


def set_numerics(device: torch.device, tf32: bool, deterministic: bool) -> str:
    """Set how fp32 math runs in this process, for every script; returns what fp32 matmuls and
    convolutions run in on ``device``, "tf32" or "ieee", for the start line and config.json.

    - TF32 (--tf32, on by default) keeps fp32's range with a 10-bit mantissa, on the tensor cores of
      GPUs of compute capability 8.0 and newer: several times the speed of strict fp32 matmuls, and
      ImageNet-style training reaches the same accuracy (NVIDIA's Ampere results). torch's defaults
      mix the two (TF32 for cuDNN convolutions, strict fp32 for matmuls); here both follow the flag.
      CPUs and older GPUs have no TF32: "ieee" there, whatever the flag.
    - cudnn.benchmark times cuDNN's convolution algorithms once per input shape and keeps the
      fastest; the shapes here are fixed, so it pays from the first epoch.
    - --deterministic: deterministic algorithms only (an op that has none raises), no algorithm
      search, and cuBLAS with a fixed workspace, so a run and its resume repeat bit for bit on a GPU
      too, at some cost in speed. Call this before the first matmul: cuBLAS reads
      CUBLAS_WORKSPACE_CONFIG when it starts.
    - On a CPU, the tensors' memory stays in the process (keep_freed_memory).
    """
    keep_freed_memory(device)
    if deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS takes it or :16:8
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    has_tf32 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    return "tf32" if tf32 and has_tf32 else "ieee"


# glibc's mallopt parameters: the size from which an allocation gets pages of its own (mmap), and
# how much freed memory at the heap's top is kept rather than handed back to the kernel
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 1 << 30


def keep_freed_memory(device: torch.device) -> bool:
    """On a CPU, serve allocations under 1 GB from malloc's heap and keep up to 1 GB of freed memory
    there, so the next step reuses it: True where set (a CPU, on Linux with glibc).

    By default glibc gives every block over a threshold its own pages from the kernel and hands
    them back when freed (the threshold moves with what the process freed before, up to 32 MB),
    and it returns freed memory at the heap's top too. A CPU training step frees and allocates
    the same activations every step (ResNet-18's first ones are 33.5 MB at batch 128), so the
    kernel maps and zeroes them again each step: 1.5 million page faults in 12 steps of the
    benchmark's plain loop, 0.4 million with this. train_single at batch 128 on 2 cores ran 11 %
    faster (peak resident memory 2.04 GB instead of 1.76), and how many blocks glibc maps no
    longer hangs on what the process did before training (docs/benchmarks.md). The benchmark's
    plain loop gets the same. Call it before the large allocations.
    """
    if device.type != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return all(libc.mallopt(parameter, KEEP_BYTES) == 1
               for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
