"""The GPU check's plan: every check and measurement of `make gpu-check`, in order of value, with what
it proves and its estimated time on one H100, cut to the time a lent GPU is there.

A lent GPU is one GPU for minutes, so the plan leads with what a user of the defaults waits for
(time to accuracy, the defaults against the fastest configuration, what a step costs beyond the
model), then what no CPU can show: the multi-process paths on CUDA tensors (CUDA graphs under DDP
first, never run on a GPU yet), two processes sharing the GPU (--share-gpus) where there is one.
Then the single-process speed rows whose targets are unmeasured. What was proven on a GPU before (every
script on one GPU, 2026-11-23) comes last and runs when the budget allows (--budget).

Estimates come from the H100 check of 2026-11-23 (a 1-process tiny run about 11 s, evaluate.py
about 9 s, TorchInductor's compile about 50 s, a benchmark run at batch 128 with 2 strategies 71 s)
and the H200 check of 2026-11-28, the first to run 2 processes sharing a GPU (over gloo: a 2-process
launch 25-45 s); rows no GPU has run yet are guesses. The report puts each row's measured time
beside its estimate: update the estimates here from it.

FSDP2's processes share a GPU over NCCL only (NCCL 2.30 and newer): over gloo they crashed
(docs/gpu/nvidia-h200.md), and train_fsdp.py refuses it. Where the one GPU's NCCL is older, the
FSDP2 rows are not run and the refusal row checks that refusal instead.
"""

from dataclasses import dataclass

BUDGET_S = 540  # 9 minutes: a lent GPU's command runs at most 10
START_S = 20  # gpu_check's own start, the machine's figures, pytest's imports
CHECKS = "tests/test_gpu.py"


@dataclass(frozen=True)
class Row:
    """One step of the plan: a check of tests/test_gpu.py (``name`` is its pytest name), a
    benchmark run (``bench``: scripts/benchmark.py's flags) or the ResNet-50 plain loop."""
    name: str
    proves: str
    seconds: int  # estimated on one H100
    kind: str = "check"  # check, benchmark, resnet50
    bench: tuple[str, ...] = ()
    gpus: int = 1  # the GPUs it needs (DataParallel: 2)
    bf16: bool = False  # needs native bf16 (compute capability 8.0 and newer)
    extra: bool = False  # proven on a GPU before: runs after the rest, if the budget allows
    fsdp: bool = False  # FSDP2 in several processes: on one GPU, only where NCCL shares it


def check(name, proves, seconds, **kwargs) -> Row:
    return Row(name, proves, seconds, **kwargs)


def bench(name, proves, seconds, *flags, **kwargs) -> Row:
    return Row(name, proves, seconds, kind="benchmark", bench=flags, **kwargs)


LEARNS = "test_every_script_learns_and_evaluate_reproduces_it"
RESUMES = "test_stop_and_resume_is_bit_for_bit"
AGREES = "test_all_gpus_match_one_gpu"

PLAN = [
    # ---- what a user of the defaults waits for, against the fastest configuration
    bench("benchmark-tta", "time to accuracy, launch to done line: the defaults (--compile auto: "
          "CUDA graphs), the eager defaults, the fastest (bf16, batch 512, CUDA graphs), each "
          "compiled one launched again from the cache; operators and CUDA runtime calls per step "
          "against the plain loop, eager and with the defaults", 200, "--strategies", "single",
          "--checks", "tta", "ops", bf16=True),
    check("test_auto_decides_from_this_gpu_and_a_weight_average_resumes_across_compile_settings",
          "--compile auto on the GPU's own properties (compute capability, Triton, the C compiler "
          "Triton finds); a weight average checkpointed under CUDA graphs resumes eager, bit for bit",
          70),
    bench("benchmark-defaults", "img/s at batch 128: the defaults against eager and the fastest "
          "configuration; data wait; the plain-loop ratio", 90, "--steps", "30", "--strategies",
          "single", "defaults", "bf16-graphs", "--checks", "overhead", bf16=True),
    bench("benchmark-b32", "a 4-GPU launch's per-device batch (32) in one process: eager against "
          "the defaults' CUDA graphs", 60, "--steps", "30", "--per-device-batch-size", "32",
          "--strategies", "single", "defaults", "--checks", "none"),
    # ---- several processes on CUDA tensors: two share the GPU where there is one
    check(f"{AGREES}[train_ddp.py]", "DDP's all-reduce on CUDA tensors: 2 processes end 5 steps "
          "within 1e-4 of one (BatchNorm frozen, --deterministic)", 50),
    check(f"{LEARNS}[train_ddp-all-cuda-graphs]", "--compile --compile-mode reduce-overhead "
          "under DDP: TorchInductor and CUDA graphs in training and evaluation", 80),
    check(f"{AGREES}[train_fsdp.py]", "FSDP2: each process holds about 1/N of the parameter and "
          "optimizer bytes (its shards); the weights within 1e-4 of one process and of DDP's", 40,
          fsdp=True),
    check("test_more_processes_than_gpus_is_refused_without_share_gpus", "without --share-gpus "
          "a launch of more processes than GPUs is refused in one line (and FSDP2 sharing a GPU "
          "over gloo)", 80),
    check("test_a_failure_in_one_process_ends_every_process", "a bad image in one process's slice "
          "ends every process within seconds over NCCL, whose collectives fail by nothing but "
          "their timeout: the failure watch; one line, none aborted or killed", 45),
    check(f"{RESUMES}[train_fsdp-all-ema]", "FSDP2 sharded checkpoints, per-process RNG and the "
          "sharded weight average: stop + --resume bit for bit (--deterministic, --ema-decay)", 60,
          fsdp=True),
    check("test_sync_bn_matches_one_gpu_and_plain_ddp_does_not", "SyncBatchNorm's collectives: "
          "DDP --sync-bn ends within 1e-4 of one process, plain DDP does not", 75),
    check(f"{LEARNS}[train_amp-all-bf16-sync-bn]", "AMP bf16 under DDP learns; evaluate.py "
          "reproduces its accuracy", 46, bf16=True),
    check(f"{LEARNS}[train_amp-all-fp16-sync-bn]", "AMP fp16 under DDP, GradScaler and all, "
          "learns; evaluate.py reproduces its accuracy", 46),
    check("test_profile_traces_cuda_and_utilisation_is_read_per_process", "--profile traces CUDA "
          "kernels in every process; NVML's utilisation read by each process", 32),
    check("test_fine_tunes_a_timm_model_at_224_px_through_the_workers", "fine-tuning timm's "
          "ResNet-18 from a weights file at 224 px, JPEGs through DataLoader workers, under DDP", 40),
    # ---- one process: the speed targets not yet measured (docs/benchmarks.md)
    bench("benchmark-b128", "the plain-loop ratio and data wait at batch 128 (train_single fp32, "
          "train_amp bf16)", 55, "--steps", "30", "--strategies", "single", "bf16", "--checks",
          "overhead", "precision"),
    bench("benchmark-b512", "the plain-loop ratio and data wait at batch 512; the bf16 epoch "
          "with and without CUDA graphs; train_single's defaults at 512", 100, "--steps", "30",
          "--per-device-batch-size", "512", "--strategies", "single", "defaults", "bf16",
          "bf16-graphs", "--checks", "overhead", "precision", bf16=True),
    # ---- the rest: proven on one GPU before, or needing several GPUs
    check(f"{LEARNS}[train_ddp-all-compile]", "--compile (default mode) under DDP learns", 75,
          extra=True),
    check(f"{LEARNS}[train_fsdp-all-ema]", "FSDP2 with --ema-decay learns; evaluate.py "
          "reproduces the average's accuracy", 10, extra=True, fsdp=True),
    check(f"{RESUMES}[train_ddp-all-sync-bn]", "DDP --sync-bn: stop + --resume bit for bit", 45,
          extra=True),
    check(f"{RESUMES}[train_amp-all-bf16-sync-bn]", "AMP bf16 under DDP: stop + --resume bit "
          "for bit", 45, extra=True, bf16=True),
    check(f"{AGREES}[train_dp.py]", "DataParallel on N GPUs within 1e-4 of one GPU", 25, gpus=2,
          extra=True),
    check(f"{LEARNS}[train_dp-all]", "DataParallel learns", 25, gpus=2, extra=True),
    check(f"{LEARNS}[train_dp-all-ema]", "DataParallel with --ema-decay learns", 25, gpus=2,
          extra=True),
    check(f"{RESUMES}[train_dp-all]", "DataParallel: stop + --resume bit for bit", 25, gpus=2,
          extra=True),
    check(f"{LEARNS}[train_ddp-all-sync-bn]", "DDP --sync-bn learns", 10, extra=True),
    check(f"{LEARNS}[train_fsdp-all]", "FSDP2 learns", 30, extra=True, fsdp=True),
    check("test_check_gpus_passes", "check_gpus.py: devices, topology, copies, NCCL", 9,
          extra=True),
    check("test_a_training_step_never_makes_the_host_wait_for_the_gpu", "no host-device sync in "
          "a training step", 5, extra=True),
    check("test_compile_trains_the_eager_weights", "--compile trains eager's weights", 66,
          extra=True),
    *(check(f"{LEARNS}[{name}]", f"{name} learns on one GPU", seconds, extra=True,
            bf16="bf16" in name)
      for name, seconds in (("train_single-tf32", 28), ("train_single-fp32", 30),
                            ("train_dp-1gpu", 25), ("train_ddp-1gpu", 22), ("train_amp-fp16", 25),
                            ("train_amp-bf16", 24), ("train_amp-bf16-compile", 72),
                            ("train_amp-bf16-ema", 25), ("train_single-cuda-graphs", 70),
                            ("train_amp-bf16-cuda-graphs-ema", 75))),
    check("test_tf32_changes_fp32_math_and_no_tf32_turns_it_off", "TF32 changes fp32 math (its "
          "two runs, if the rows before did not make them)", 60, extra=True),
    *(check(f"{RESUMES}[{name}]", f"{name}: stop + --resume bit for bit", 24, extra=True,
            bf16="bf16" in name)
      for name in ("train_single-tf32", "train_dp-1gpu", "train_amp-fp16", "train_amp-bf16",
                   "train_amp-bf16-ema")),
    bench("benchmark-all-gpus", "every strategy on every GPU: DDP's scaling, DataParallel, "
          "FSDP2 beside DDP", 240, "--steps", "30", "--checks", "none", gpus=2, extra=True),
    Row("resnet50", "ResNet-50 at 224 px, the plain loop in fp32 (TF32) and bf16", 40,
        kind="resnet50", extra=True),
]


@dataclass(frozen=True)
class Planned:
    row: Row
    start_s: float  # estimated, from the check's start
    why_not: str | None  # None: it runs


def plan(rows: list[Row], budget_s: float, gpus: int, native_bf16: bool,
         extras: bool = True, nccl_shares: bool = True) -> list[Planned]:
    """``rows`` in order, each either run (while the estimates fit in ``budget_s``) or given the
    reason it is not: too few GPUs, no bf16, FSDP2 on one GPU whose NCCL cannot share it
    (``nccl_shares`` False), past the budget. The first row past the budget ends
    the plan: a later, smaller row is of less value and may need what a skipped one would make."""
    planned, clock, full = [], START_S, False
    for row in rows:
        if row.gpus > gpus:
            why = f"needs {row.gpus} GPUs, {gpus} visible"
        elif row.bf16 and not native_bf16:
            why = "needs native bf16 (compute capability 8.0 and newer)"
        elif row.fsdp and gpus == 1 and not nccl_shares:
            why = "FSDP2's processes share a GPU over NCCL 2.30 and newer only (gloo crashes)"
        elif row.extra and not extras:
            why = "not asked for"
        elif full or clock + row.seconds > budget_s:
            full, why = True, f"over the {budget_s:.0f} s budget (--budget to run it)"
        else:
            why = None
        planned.append(Planned(row, clock, why))
        if why is None:
            clock += row.seconds
    return planned


def estimated_end(planned: list[Planned]) -> float:
    """Seconds from the start to the end of the last row that runs."""
    last = [p for p in planned if p.why_not is None]
    return last[-1].start_s + last[-1].row.seconds if last else START_S


def render(planned: list[Planned], budget_s: float, gpus: int) -> str:
    """The plan as `--dry-run` prints it: each row, its estimate and when it would end."""
    lines = [f"gpu-check plan for {gpus} GPU(s), budget {budget_s:.0f} s "
             f"({'2 processes share the GPU' if gpus == 1 else 'a process per GPU'}; "
             f"estimates from one H100 and one H200, {START_S} s of start first):", "",
             f"{'#':>3}  {'est s':>5}  {'ends':>5}  row: what it proves"]
    for number, p in enumerate(planned, start=1):
        ends = "-" if p.why_not else f"{p.start_s + p.row.seconds:.0f}"
        lines.append(f"{number:>3}  {p.row.seconds:>5}  {ends:>5}  {p.row.name}: {p.row.proves}"
                     + (f"  [not run: {p.why_not}]" if p.why_not else ""))
    runs = [p for p in planned if p.why_not is None]
    lines += ["", f"{len(runs)} of {len(planned)} rows run, ending at about "
                  f"{estimated_end(planned):.0f} s of the {budget_s:.0f} s budget."]
    return "\n".join(lines)
