"""--compile and --compile-mode: torch.compile of the model through Accelerate's dynamo plugin, and
CUDA graphs for steps whose GPU waits on the host that launches its kernels.

    accelerator = Accelerator(dynamo_plugin=compile_plugin(args.compile, args.compile_mode), ...)

prepare() then wraps the model in torch.compile(model, backend=..., mode=...). What the CUDA-graph
modes (Inductor's reduce-overhead, max-autotune) need, and how the scripts give it:
- static shapes: training drops the last partial batch (every step has the batch's shape) and the
  graph is compiled for fixed shapes (dynamic=False); evaluation's last, smaller batch is one more
  graph, recorded once.
- no host sync inside the compiled region: the model alone is compiled; the loss is read a step
  late on a GPU (common.parallel.step_guard).
- the learning rate: the optimizer step is not compiled, so a schedule changes no graph and
  recompiles nothing.
- gradient accumulation is refused: CUDA graph trees replay into the same output buffers, and the
  gradients of one micro-batch can be overwritten by the next's before they are added up
  (pytorch#169545, #96693).
On a CPU there are no CUDA graphs: Inductor compiles its CPU code as in the default mode (and
max-autotune also tunes its matrix kernels), and the start line says so.
"""

from accelerate.utils import TorchDynamoPlugin

from common.errors import UserError

# torch._dynamo backends that Accelerate accepts (accelerate.utils.DynamoBackend) and that need
# nothing beyond torch on a CPU or a GPU: inductor compiles; aot_eager and eager only trace, to find
# graph breaks.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# torch.compile's modes (TorchInductor's); those of CUDA_GRAPH_MODES also replay CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile(backend: str | None, mode: str, grad_accum: int) -> None:
    """--compile-mode goes with --compile inductor, and CUDA graphs without --grad-accum (a
    UserError otherwise, the same on every device, so a CPU run says what a GPU run would)."""
    if mode != "default" and backend != "inductor":
        given = f"--compile {backend}" if backend else "no --compile"
        raise UserError(f"--compile-mode {mode} with {given}: the modes are TorchInductor's; add "
                        f"--compile (inductor) or drop --compile-mode")
    if mode in CUDA_GRAPH_MODES and grad_accum > 1:
        raise UserError(f"--compile-mode {mode} with --grad-accum {grad_accum}: CUDA graphs replay "
                        f"into the same buffers, so one micro-batch's gradients can be overwritten "
                        f"by the next's before they are added up (pytorch#169545); use "
                        f"--compile-mode max-autotune-no-cudagraphs, or --grad-accum 1 with a "
                        f"smaller --batch-size")


def compile_plugin(backend: str | None, mode: str = "default") -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin for --compile ``backend`` (None: no compiling, whatever the
    Accelerate config says) in ``mode``: fixed shapes for the CUDA-graph modes, which record one
    graph per shape (a dynamic one would not be replayed)."""
    if backend is None:
        return TorchDynamoPlugin(backend="no")
    return TorchDynamoPlugin(backend=backend, mode=mode,
                             dynamic=False if mode in CUDA_GRAPH_MODES else None)


def compile_line(backend: str | None, mode: str, device: str) -> str | None:
    """What --compile does on ``device``, for the start line and config.json; None without it."""
    if backend is None:
        return None
    said = f"--compile {backend}" + (f" --compile-mode {mode}" if mode != "default" else "")
    if mode in CUDA_GRAPH_MODES and not device.startswith("cuda"):
        instead = "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
        return (f"{said}: no CUDA graphs on {device}: Inductor compiles its {device} code as in "
                f"--compile-mode {instead}")
    graphs = ", its steps replayed as CUDA graphs" if mode in CUDA_GRAPH_MODES else ""
    return f"{said}: the model compiled at its first step and first evaluation{graphs}"
