"""--compile and --compile-mode: torch.compile of the model through Accelerate's dynamo plugin, CUDA
graphs by default on a GPU, the compiler's cache kept beside the run folders.

    accelerator = Accelerator(dynamo_plugin=set_up_compiling(args), ...)

prepare() then wraps the model in torch.compile(model, backend=..., mode=...). --compile auto (the
default) replays each training step of a one-process run on a CUDA GPU as CUDA graphs
(Inductor's reduce-overhead; several processes: ``chosen``): a ResNet-18 step at batch 128 is bound
by the host launching its kernels there (an H200 busy 22-37 % of the time, eager; 7x the img/s
with CUDA graphs, docs/gpu/nvidia-h200.md). Elsewhere it trains eagerly, as --compile none always
does: on a CPU compiling costs 45-50 s and gains nothing over bf16 and channels_last
(docs/benchmarks.md). What the CUDA-graph modes (reduce-overhead, max-autotune) need, and how the
scripts give it:
- static shapes: training drops the last partial batch (every step has the batch's shape) and the
  graph is compiled for fixed shapes (dynamic=False); evaluation's last, smaller batch is one more
  graph, recorded once.
- no host sync inside the compiled region: the model alone is compiled; the loss is read a step
  late on a GPU (common.parallel.step_guard).
- the learning rate: the optimizer step is not compiled, so a schedule changes no graph and
  recompiles nothing.
- gradient accumulation is refused: CUDA graph trees replay into the same output buffers, and the
  gradients of one micro-batch can be overwritten by the next's before they are added up
  (pytorch#169545, #96693); auto then compiles without graphs.
On a CPU there are no CUDA graphs: Inductor compiles its CPU code as in the default mode (and
max-autotune also tunes its matrix kernels), and the start line says so.

The compile is paid once per machine and model: Inductor's caches (FX graphs, AOTAutograd, Triton
kernels) go to TORCHINDUCTOR_CACHE_DIR, by default beside the run folders (runs/.compile-cache),
where a resumed or restarted job and the next launch find them; torch's own default, a folder under
/tmp, is gone when a container or pod restarts. A model that fails to compile stops the run with
one line naming --compile none.
"""

import os
import sys
from contextlib import suppress
from pathlib import Path

import torch
from accelerate.utils import TorchDynamoPlugin
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from common.errors import UserError, first_line

# auto: CUDA graphs where they pay (above); none: eager; then torch._dynamo backends that Accelerate
# accepts (accelerate.utils.DynamoBackend) and that need nothing beyond torch on a CPU or a GPU:
# inductor compiles; aot_eager and eager only trace, to find graph breaks.
COMPILE_CHOICES = ("auto", "none", "inductor", "aot_eager", "eager")
# torch.compile's modes (TorchInductor's); those of CUDA_GRAPH_MODES also replay CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
CACHE_FOLDER = ".compile-cache"  # in the folder of the run folders
TORCH_DEFAULT = os.path.abspath(default_cache_dir())  # /tmp/torchinductor_<user>


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


def chosen(args, cuda: bool, model_is: str = "whole", processes: int = 1) -> tuple[str, str]:
    """The backend ("no": eager) and mode that --compile and --compile-mode give on a machine with
    (``cuda``) or without a GPU, for one of ``processes`` that trains the ``model_is`` "whole"
    model, its "replicas" (DataParallel) or its "shards" (FSDP2). Several processes stay eager:
    under DDP, BatchNorm's running statistics make Inductor skip the CUDA graphs and run slower
    (pytorch#139207, open); the GPU plan measures DDP with them (--compile inductor
    --compile-mode reduce-overhead). DataParallel's replicas are copied anew at every step; FSDP2
    shards a model for its size, whose step is not launch-bound, and CUDA graphs around FSDP2's
    hooks are not proven here."""
    if args.compile == "auto":
        if not cuda or args.deterministic or model_is != "whole" or processes > 1:
            return "no", "default"  # --deterministic: eager's kernels, bit for bit on --resume
        return "inductor", "reduce-overhead" if args.grad_accum == 1 else "default"
    return ("no" if args.compile == "none" else args.compile), args.compile_mode


def set_up_compiling(args, model_is: str = "whole") -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin for what --compile chooses on this machine (``chosen``); when it
    compiles, also the compiler's cache beside the run folders and a failure said in one line (an
    excepthook): the process changed. ``model_is`` as ``chosen`` takes it."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's
    backend, mode = chosen(args, torch.cuda.is_available(), model_is, processes)
    if backend == "no":  # no compiling, whatever the Accelerate config says
        return TorchDynamoPlugin(backend="no")
    # torch puts its default in the environment as torch._dynamo is imported: a folder under /tmp
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", TORCH_DEFAULT) == TORCH_DEFAULT:
        runs = Path(args.output_dir).parent if args.output_dir else Path("runs")
        cache = (runs / CACHE_FOLDER).absolute()
        with suppress(OSError):  # a folder of runs this job cannot write (a read-only mount)
            cache.mkdir(parents=True, exist_ok=True)  # leaves torch's, said by the start line
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
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


def compile_line(flags: dict, device: str, backend: str, mode: str) -> str | None:
    """What --compile does on ``device`` (``backend`` and ``mode`` as ``chosen`` gave them) and
    why, for the start line and config.json; None for an eager run that did not ask for auto."""
    given, cuda = flags.get("compile"), device.startswith("cuda")
    said = f"--compile {given}"
    if backend == "no":
        why = ("CUDA graphs only for one process training a whole model, without --deterministic"
               if cuda else "no GPU")
        return f"{said}: eager ({why}); --compile inductor compiles" if given == "auto" else None
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
