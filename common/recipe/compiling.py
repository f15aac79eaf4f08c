"""--compile and --compile-mode: torch.compile of the model through Accelerate's dynamo plugin, CUDA
graphs by default on a GPU, the compiler's cache private to the process.

    accelerator = Accelerator(dynamo_plugin=set_up_compiling(args), ...)

prepare() then wraps the model in torch.compile(model, backend=..., mode=...). --compile auto (the
default) replays each training step of a one-process run on a CUDA GPU as CUDA graphs (Inductor's
reduce-overhead; several processes: ``chosen``): a ResNet-18 step at batch 128 is bound by the host
launching its kernels there (an H200 busy 22-37 % of the time, eager; 7x the img/s with CUDA graphs,
docs/gpu/nvidia-h200.md). It trains eagerly, as --compile none always does, on a CPU (compiling
costs 45-50 s there and gains nothing over bf16 and channels_last, docs/benchmarks.md), on a GPU
Inductor cannot compile for (``why_eager_here``) and under --profile (a trace of CUDA graphs shows
their launches, not layers: kineto#1165). A compile that fails under auto is one warning and the
model trains eagerly (Dynamo's suppress_errors); an explicit --compile stops in one line. What the
CUDA-graph modes (reduce-overhead, max-autotune) need, and how the scripts give it: static shapes
(training drops the last partial batch, the graph is compiled with dynamic=False, evaluation's last,
smaller batch is one more graph, recorded once); no host sync inside the compiled region (the model
alone is compiled, the loss is read a step late on a GPU: common.parallel.step_guard); a learning
rate that changes no graph (the optimizer step is not compiled); no gradient accumulation (graph
trees replay into the same output buffers, so one micro-batch's gradients can be overwritten by the
next's before they are added up: pytorch#169545, #96693; auto then compiles without graphs). On a
CPU there are no CUDA graphs: Inductor compiles its CPU code as in the default mode (max-autotune
also tunes its matrix kernels), as the start line says.

Inductor's caches hold code it loads (pickles, .so, .py): one others can write (runs/ on a shared
volume; torch's default under /tmp, which another user can make first) would run theirs. So each
process compiles into a new 0700 folder of its own in the temporary folder, gone with it; a restart
compiles again (resnet20, 2 CPU cores: 67 s). TORCHINDUCTOR_CACHE_DIR, set, is used as it is.
"""

import atexit
import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import torch
from accelerate.utils import TorchDynamoPlugin
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.utils._triton import has_triton_package

from common.errors import UserError, first_line

# auto: CUDA graphs where they pay (above); none: eager; then torch._dynamo backends that Accelerate
# accepts (accelerate.utils.DynamoBackend) and that need nothing beyond torch on a CPU or a GPU:
# inductor compiles; aot_eager and eager only trace, to find graph breaks.
COMPILE_CHOICES = ("auto", "none", "inductor", "aot_eager", "eager")
# torch.compile's modes (TorchInductor's); those of CUDA_GRAPH_MODES also replay CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# torch's default cache, /tmp/torchinductor_<user>: torch puts it in the environment as
# torch._dynamo is imported, and every process started from one inherits it
TORCH_DEFAULT = os.path.basename(default_cache_dir())


def check_compile(backend: str, mode: str, grad_accum: int) -> None:
    """--compile-mode goes with --compile inductor, and CUDA graphs without --grad-accum (a
    UserError otherwise, the same on every device, so a CPU run says what a GPU run would)."""
    if mode != "default" and backend != "inductor":
        raise UserError(f"--compile-mode {mode} with --compile {backend}: the modes are "
                        f"TorchInductor's; add --compile (inductor) or drop --compile-mode")
    if mode in CUDA_GRAPH_MODES and grad_accum > 1:
        raise UserError(f"--compile-mode {mode} with --grad-accum {grad_accum}: CUDA graphs replay "
                        f"into the same buffers, so one micro-batch's gradients can be overwritten "
                        f"by the next's before they are added up (pytorch#169545); use "
                        f"--compile-mode max-autotune-no-cudagraphs, or --grad-accum 1 with a "
                        f"smaller --batch-size")


@functools.cache
def why_eager_here() -> str | None:
    """Why --compile auto cannot compile on this machine (None: it can), asked once a process:
    Inductor's GPU kernels are Triton's, which need compute capability 7.0 or more."""
    if not torch.cuda.is_available():
        return "no GPU"
    if (capability := torch.cuda.get_device_capability()) < (7, 0):
        return f"compute capability {capability[0]}.{capability[1]}; Triton needs 7.0 or more"
    return triton_cannot_build()


def triton_cannot_build() -> str | None:
    """Why Triton cannot build its kernels' launcher here (None: it can): Triton must import, and
    the C compiler it takes at run time (CC, else gcc, else clang: triton/runtime/build.py) must
    compile against Python.h, which is tried."""
    if not has_triton_package():  # torch's own check: Triton imports (it comes with torch's wheels)
        return "Triton is not installed: torch's wheels for Linux bring it"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return "no C compiler for Triton's launcher: install gcc, or name one in CC"
    include = sysconfig.get_paths("posix_prefix")["include"]  # as Triton takes it on Linux
    try:
        done = subprocess.run([cc, "-fsyntax-only", f"-I{include}", "-x", "c", "-"], text=True,
                              input="#include <Python.h>", capture_output=True, timeout=60)
        failed = done.returncode and (done.stderr.strip() or f"exit {done.returncode}")
    except (OSError, subprocess.SubprocessError) as error:
        failed = first_line(error)
    return (f"the C compiler {cc} fails ({failed.splitlines()[0]}): install gcc, or name one in CC"
            if failed else None)


def chosen(args, cannot: str | None, model_is="whole", processes=1) -> tuple[str, str]:
    """The backend ("no": eager) and mode that --compile and --compile-mode give on a machine where
    auto ``cannot`` compile (``why_eager_here``) or can (None), for one of ``processes`` that trains
    the ``model_is`` "whole" model, its "replicas" (DataParallel) or its "shards" (FSDP2); --profile
    keeps auto eager (the module's docstring). Several processes stay eager: under DDP, BatchNorm's
    running statistics make Inductor skip the CUDA graphs and run slower (pytorch#139207, open); the
    GPU plan measures DDP with them (--compile inductor --compile-mode reduce-overhead).
    DataParallel's replicas are copied anew at every step; FSDP2 shards a model for its size, whose
    step is not launch-bound, and CUDA graphs around FSDP2's hooks are not proven here."""
    if args.compile == "auto":
        if cannot or args.deterministic or args.profile or model_is != "whole" or processes > 1:
            return "no", "default"  # --deterministic: eager's kernels, bit for bit on --resume
        return "inductor", "reduce-overhead" if args.grad_accum == 1 else "default"
    return ("no" if args.compile == "none" else args.compile), args.compile_mode


def set_up_compiling(args, model_is: str = "whole") -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin for what --compile chooses on this machine (``chosen``); when it
    compiles, also the compiler's cache private to the process and a failure said in one line (an
    excepthook; under auto a warning, and the model trains eagerly): the process changed.
    ``model_is`` as ``chosen`` takes it."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's
    cannot = why_eager_here() if args.compile == "auto" else None  # tries a compiler on a GPU
    backend, mode = chosen(args, cannot, model_is, processes)
    if backend == "no":  # no compiling, whatever the Accelerate config says
        return TorchDynamoPlugin(backend="no")
    if os.path.basename(os.environ.get("TORCHINDUCTOR_CACHE_DIR", TORCH_DEFAULT)) == TORCH_DEFAULT:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="torchinductor-")
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))  # not ~/.triton
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    if args.compile == "auto":  # Dynamo runs a frame it failed to compile eagerly, and logs why
        torch._dynamo.config.suppress_errors = True
        logging.getLogger("torch._dynamo.convert_frame").addFilter(_warned_once())
    sys.excepthook = _said_in_one_line(sys.excepthook, args.compile)
    # fixed shapes for the CUDA-graph modes, which record one graph per shape
    return TorchDynamoPlugin(backend=backend, mode=mode,
                             dynamic=False if mode in CUDA_GRAPH_MODES else None)


def _said_in_one_line(previous, flag: str):
    """An excepthook: an error of torch.compile's (tracing, Inductor, the C++ or Triton compiler)
    as one line naming --compile none; any other exception as ``previous`` says it."""
    def hook(kind, error, traceback):
        if not isinstance(error, torch._dynamo.exc.TorchDynamoException):
            return previous(kind, error, traceback)
        print(UserError(f"--compile {flag} could not compile the model ({first_line(error)}): "
                        f"--compile none trains it without compiling").code, file=sys.stderr)
    return hook


def _warned_once():
    """A logging filter: Dynamo's report of a compile error it suppressed (--compile auto) as one
    warning for the run, whose graphs each report their own, and no traceback."""
    said = []

    def warned(record: logging.LogRecord) -> bool:
        if record.exc_info and not said:
            said.append(print(f"warning: --compile auto could not compile the model "
                              f"({first_line(record.exc_info[1])}): it trains eagerly; "
                              f"--compile none skips the attempt", file=sys.stderr))
        return not record.exc_info
    return warned


def compile_line(flags: dict, device: str, backend: str, mode: str) -> str | None:
    """What --compile does on ``device`` (``backend`` and ``mode`` as ``chosen`` gave them) and
    why, for the start line and config.json; None for an eager run that did not ask for auto."""
    given, cuda = flags.get("compile"), device.startswith("cuda")
    said = f"--compile {given}"
    if backend == "no" and given != "auto":
        return None
    if backend == "no":
        why = (why_eager_here() or "CUDA graphs only for one process training a whole model, "
               "without --deterministic or --profile") if cuda else "no GPU"
        return f"{said}: eager ({why}); --compile inductor compiles"
    if given != "auto" and mode != "default":
        said += f" --compile-mode {mode}"
    cache = f"cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR', TORCH_DEFAULT)}"
    if mode in CUDA_GRAPH_MODES and not cuda:
        instead = "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
        return (f"{said}: no CUDA graphs on {device}: Inductor compiles its {device} code as in "
                f"--compile-mode {instead}; {cache}")
    graphs = ", its steps replayed as CUDA graphs" if mode in CUDA_GRAPH_MODES else ""
    why = ("; auto: a small model's step waits on kernel launches; --compile none for eager"
           if given == "auto" else "")
    return (f"{said}: the model compiled at its first step and first evaluation{graphs}; "
            f"{cache}{why}")
