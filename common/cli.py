"""The flags every training script shares, so that the same flag means the same thing everywhere."""

import argparse
import math

import torch

from common.data.flags import add_augment_args, add_data_args, check_augment_args, check_data_args
from common.data.pretrained import check_fine_tuning
from common.errors import UserError
from common.files import check_folder
from common.observe.profiling import profile_steps
from common.parallel.launch import SHARE_GPUS
from common.recipe.compiling import COMPILE_CHOICES, COMPILE_MODES, check_compile
from common.recipe.models import TIMM_PREFIX, check_model_name, model_names
from common.recipe.optim import DEFAULT_LR

# The largest --seed: accelerate.utils.set_seed seeds numpy too, whose seeds are 32-bit.
MAX_SEED = 2**32 - 1
# The longest --dist-timeout in seconds: gloo keeps a timeout in int64 nanoseconds (~292 years) and
# refuses a longer one as negative; 1e9 s (~31 years) stays well inside. The shortest is 10 s: the
# timeout bounds every wait in a collective, also the others' wait while the main process alone
# starts the tracker (wandb.init, about 1 s offline here) or writes a checkpoint. Measured on 2
# gloo CPU processes: 1 s ends the job at the first step (gloo's "Application timeout caused pair
# closure" while rank 0 starts wandb), 2 s passes on an idle machine; 10 s leaves room for a
# loaded one. An online tracker or a large model's checkpoint on a slow disk needs more (600).
MIN_DIST_TIMEOUT, MAX_DIST_TIMEOUT = 10, 10**9
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the optimizer's arithmetic (--lr, ...)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # below: an lr of 0 in float32
# --report-to: the trackers of Accelerate's that the scripts set up (common.observe.tracking)
TRACKERS = ("wandb", "tensorboard", "mlflow")

# Flags (their dest) that may change when a run is resumed (lr and clip_grad: after a diverged run);
# any other change makes the resumed run another experiment. A script adds those of its strategy.
RESUMABLE_FLAGS = frozenset({"resume", "max_steps", "output_dir", "cache_dir", "data_dir",
                             "keep_checkpoints", "report_to", "wandb_project", "run_name",
                             "wandb_tags", "wandb_group", "log_every", "checkpoint_every",
                             "compile", "compile_mode", "loader", "workers", "loader_budget",
                             "bad_images", "profile", "lr", "clip_grad"})


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line (not the whole usage) like every other error here."""

    def __init__(self, doc: str):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        self.exit(2, f"error: {message}; see --help\n")


def build_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the shared flags; a script adds only the flags of its own strategy."""
    parser = Parser(doc)
    add_data_args(parser)
    add_augment_args(parser)

    train = parser.add_argument_group("training")
    train.add_argument("--model", default="resnet18", help=f"one of {', '.join(model_names())}, "
                       "torchvision:NAME for any torchvision classifier with its ImageNet stem, or "
                       "timm:NAME for any timm model (default: %(default)s)")
    train.add_argument("--pretrained", action="store_true",
                       help="start from the library's ImageNet weights of --model (timm:NAME from "
                            "the Hugging Face cache, torchvision:NAME from $TORCH_HOME; downloaded "
                            "when reachable, else one line says where the file must be), the head "
                            "swapped for the data's classes, the images sized and normalised as "
                            "the weights expect (default: random weights)")
    train.add_argument("--pretrained-path", default=None, metavar="FILE",
                       help="start from the weights in FILE (safetensors or a torch state dict: "
                            "timm's, torchvision's or an earlier run's model.safetensors), as "
                            "--pretrained does (default: none)")
    train.add_argument("--freeze", default="none", choices=("none", "backbone"),
                       help="backbone: train the classifier only; every other parameter frozen "
                            "and BatchNorm's running statistics too (default: %(default)s)")
    train.add_argument("--head-lr-scale", type=float, default=1.0, metavar="X",
                       help="the classifier's lr is X times the rest's, e.g. 10 when fine-tuning "
                            "(default: %(default)s)")
    train.add_argument("--optimizer", default="sgd", choices=tuple(DEFAULT_LR),
                       help="sgd: SGD with Nesterov momentum; adamw: AdamW. Neither decays norm "
                            "or bias parameters (default: %(default)s)")
    train.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                       help="NHWC memory format for the model and its batches: faster convolutions "
                            "on tensor cores and in oneDNN on CPUs (default: on)")
    train.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True, help="fp32 "
                       "matmuls and convolutions in TF32 on GPUs of compute capability 8.0 and "
                       "newer (Ampere, Hopper): tensor-core speed with fp32's range; --no-tf32 for "
                       "strict fp32. No effect on CPUs and older GPUs (default: on)")
    train.add_argument("--deterministic", action="store_true", help="deterministic GPU kernels "
                       "only, so a run and its --resume repeat bit for bit on a GPU as they do on "
                       "a CPU; slower, and an op without a deterministic kernel stops the run "
                       "(default: off, cuDNN picks the fastest kernels)")
    train.add_argument("--epochs", type=int, default=15,
                       help="passes over the training split (default: %(default)s)")
    train.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch: images per "
                       "optimizer step summed over all devices and processes; each device gets "
                       "batch-size / devices (default: %(default)s)")
    train.add_argument("--grad-accum", type=int, default=1, metavar="N",
                       help="gradient accumulation: each optimizer step sums the gradients of N "
                            "micro-batches of --batch-size / N images (each process a slice of "
                            "them), with one gradient all-reduce per step, for a batch that does "
                            "not fit in memory at once (default: %(default)s)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate of the schedule "
                       "for a global batch of --reference-batch-size; other batch sizes scale it "
                       "(--scale-lr) (default: 0.1 with --optimizer sgd, 0.001 with adamw)")
    train.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,
                       help="linear scaling rule: peak lr = --lr x --batch-size / "
                            "--reference-batch-size, so a larger global batch keeps its accuracy; "
                            "--no-scale-lr uses --lr as given (default: on)")
    train.add_argument("--reference-batch-size", type=int, default=128,
                       help="the global batch that --lr is tuned for (default: %(default)s)")
    train.add_argument("--momentum", type=float, default=0.9,
                       help="SGD momentum, Nesterov (default: %(default)s)")
    train.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay of the "
                       "weights (not of norm and bias parameters): SGD's L2, AdamW's decoupled "
                       "decay, for which 0.05 is usual (default: %(default)s)")
    train.add_argument("--clip-grad", type=float, default=None, metavar="MAX_NORM",
                       help="clip the global gradient norm (all parameters, all processes) to "
                            "MAX_NORM before each step (default: no clipping)")
    train.add_argument("--ema-decay", type=float, default=0.0, metavar="DECAY",
                       help="keep an exponential moving average of the weights (and BatchNorm "
                            "buffers) with this decay, e.g. 0.999, after a warm-up; evaluated each "
                            "epoch next to the live weights and saved as model.safetensors; 0 for "
                            "none (default: %(default)s)")
    train.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing of the "
                       "cross-entropy, 0 for none (default: %(default)s)")
    train.add_argument("--schedule", default="onecycle", choices=("onecycle", "step"),
                       help="onecycle: cosine warm-up then cosine decay to ~0; step: linear "
                            "warm-up, then lr divided by 10 at each of --milestones "
                            "(default: %(default)s)")
    train.add_argument("--milestones", type=int, nargs="+", default=[4, 9, 14],
                       help="epochs after which the step schedule divides the lr by 10; the "
                            "articles' recipe is 4 9 14 with 15 epochs (default: %(default)s)")
    train.add_argument("--warmup-epochs", type=float, default=1.0, help="warm-up length in epochs, "
                       "for both schedules: onecycle rises from lr/25 along a cosine, step rises "
                       "linearly; 0 for none (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0, help="seed of initialisation, shuffling and "
                       "augmentation (default: %(default)s)")
    train.add_argument("--compile", nargs="?", const="inductor", default="auto", metavar="BACKEND",
                       choices=COMPILE_CHOICES, help="torch.compile the model, through "
                       "Accelerate's dynamo plugin: auto replays each step as CUDA graphs in a "
                       "one-process run on a CUDA GPU (TorchInductor's reduce-overhead; without "
                       "graphs with --grad-accum; eager with --deterministic, several processes, "
                       "DataParallel or FSDP2) and trains eagerly on a CPU; none: eager; inductor "
                       "(the value with no BACKEND) compiles; aot_eager checks that the model "
                       "traces. Each launch compiles (about a minute) into a cache of its own, "
                       "never one others can write (TORCHINDUCTOR_CACHE_DIR, set, is used) "
                       "(default: %(default)s)")
    train.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                       help="TorchInductor's mode, with --compile inductor: reduce-overhead "
                            "replays each step as CUDA graphs, for GPUs waiting on the host's "
                            "kernel launches (small models and batches); max-autotune also tunes "
                            "the kernels. On a CPU no CUDA graphs (default: %(default)s; "
                            "--compile auto picks its own)")
    train.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer "
                       "steps in all (counted from the start of the run, resumes included), with a "
                       "checkpoint; for tests and benchmarks")
    train.add_argument("--profile", default=None, metavar="[SKIP:]STEPS", help="trace STEPS "
                       "optimizer steps with torch.profiler, after the first 5 of this launch (or "
                       "SKIP), into --output-dir/profile/ (Perfetto, chrome://tracing), and print "
                       "the ops that cost most per step at the end, e.g. 5 or 20:5 (default: off)")

    run = parser.add_argument_group("run record")
    run.add_argument("--output-dir", default=None, help="folder of the run record and checkpoints "
                     "(default: a new runs/<script>-<time>)")
    run.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                     help="continue the run in --output-dir from its newest complete checkpoint, "
                          "or from CHECKPOINT (runs/NAME/checkpoints/step_NNNNNNNN)")
    run.add_argument("--checkpoint-every", type=int, default=None,
                     help="also save the training state every this many optimizer steps "
                          "(default: at the end of each epoch only)")
    run.add_argument("--keep-checkpoints", type=int, default=2,
                     help="how many of the newest checkpoints to keep (default: %(default)s)")

    tracking = parser.add_argument_group("tracking (wandb, TensorBoard, MLflow: Accelerate's)")
    tracking.add_argument("--report-to", nargs="+", default=["wandb"], metavar="TRACKER",
                          choices=(*TRACKERS, "none"), help="one or more of: wandb (one run per "
                          "job, offline under --output-dir when no API key is configured); "
                          "tensorboard (events in --output-dir/tensorboard); mlflow (one run per "
                          "job, in --output-dir/mlflow.db unless MLFLOW_TRACKING_URI is set); or "
                          "none: no tracking. --resume continues the same runs; see docs/usage.md "
                          "(default: wandb)")
    tracking.add_argument("--wandb-project", default=None,
                          help="wandb project, also the MLflow experiment and the TensorBoard "
                               "run's folder (default: $WANDB_PROJECT or multigpu-cifar)")
    tracking.add_argument("--run-name", default=None,
                          help="wandb and MLflow run name (default: $WANDB_NAME or the tracker's)")
    tracking.add_argument("--wandb-tags", nargs="+", default=None,
                          help="wandb tags (default: $WANDB_TAGS)")
    tracking.add_argument("--wandb-group", default=None,
                          help="wandb group, e.g. one per sweep (default: $WANDB_RUN_GROUP)")
    tracking.add_argument("--log-every", type=int, default=20, help="log the loss, lr and img/s to "
                          "the trackers every this many optimizer steps (default: %(default)s)")
    return parser


def add_ddp_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the scripts that run one process per GPU (DDP, AMP, FSDP2)."""
    processes = parser.add_argument_group("processes")
    processes.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm: BatchNorm "
                           "statistics of the global batch (GPUs only)")
    processes.add_argument("--dist-timeout", type=float, default=600, help="seconds (10 or more) a "
                           "process waits for the others in a collective: a stalled one fails the "
                           "job, not hangs it (default: %(default)s)")
    processes.add_argument("--share-gpus", nargs="?", const="auto", default=None,
                           choices=SHARE_GPUS, metavar="BACKEND", help="let several processes "
                           "share each GPU, to rehearse a launch for more GPUs than this machine "
                           "has (e.g. accelerate_configs/8gpu_rehearsal.yaml on 1 GPU): it proves "
                           "the launch, checkpoints and resume, not speed. BACKEND: auto (NCCL "
                           "where it can share a GPU, 2.30 and newer; else gloo; FSDP2: NCCL "
                           "only), nccl or gloo; with a GPU each it changes nothing (default: off, "
                           "one process per GPU; more processes than GPUs is refused)")


def check_args(args: argparse.Namespace) -> None:
    """Reject values argparse cannot: one line naming the flag, the value and what to do."""
    check_data_args(args)
    check_augment_args(args)
    for dest in ("epochs", "batch_size", "keep_checkpoints", "log_every", "reference_batch_size",
                 "grad_accum", "checkpoint_every", "max_steps"):  # the last two: None, not given
        if (value := getattr(args, dest)) is not None and value < 1:
            raise UserError(f"--{dest.replace('_', '-')} {value}: must be 1 or more")
    profile_steps(args.profile)  # "N" or "S:N"
    check_compile(args.compile, args.compile_mode, args.grad_accum)
    if "none" in args.report_to and len(args.report_to) > 1:
        raise UserError(f"--report-to {' '.join(args.report_to)}: none means no tracking; pass "
                        f"--report-to none alone, or only trackers ({', '.join(TRACKERS)})")
    if args.batch_size % args.grad_accum:  # the processes' share is checked once they are known
        below = args.batch_size - args.batch_size % args.grad_accum
        raise UserError(f"--batch-size {args.batch_size} does not divide into --grad-accum "
                        f"{args.grad_accum} micro-batches: use "
                        f"{f'{below} or ' if below else ''}{below + args.grad_accum}")
    # Written so that NaN fails each test (every comparison with NaN is False). The optimizer
    # computes in float32: a larger lr or weight decay (the peak lr, after --scale-lr) stops its
    # first step with "value cannot be converted to type float without overflow".
    scale = args.batch_size / args.reference_batch_size if args.scale_lr else 1
    ranges = [  # (dest, whether its value is in range, the range)
        ("seed", 0 <= args.seed <= MAX_SEED, f"from 0 to {MAX_SEED} (numpy's seeds are 32-bit)"),
        ("lr", args.lr is None or 0 < args.lr * max(scale, 1) <= FLOAT32_MAX,
         f"a positive number, e.g. {DEFAULT_LR[args.optimizer]}, at most {FLOAT32_MAX:.3g} "
         f"(float32's largest) once scaled by --scale-lr"),
        ("clip_grad", args.clip_grad is None or 0 < args.clip_grad < math.inf,
         "a positive number, e.g. 1.0"),
        # torch's SGD refuses Nesterov without momentum; 1 or more diverges
        ("momentum", 0 < args.momentum < 1, "above 0 (Nesterov needs some) and below 1, e.g. 0.9"),
        ("weight_decay", 0 <= args.weight_decay <= FLOAT32_MAX,
         f"a number, 0 (none) or more, at most {FLOAT32_MAX:.3g} (float32's largest)"),
        ("label_smoothing", 0 <= args.label_smoothing < 1,
         "0 (none) or more and below 1"),  # 1 would train towards uniform targets
        ("ema_decay", 0 <= args.ema_decay < 1, "0 (none) or more and below 1, e.g. 0.999"),
        ("warmup_epochs", 0 <= args.warmup_epochs <= args.epochs,
         f"a number of epochs from 0 to --epochs {args.epochs}")]
    for dest, in_range, what in ranges:
        if not in_range:
            raise UserError(f"--{dest.replace('_', '-')} {getattr(args, dest)}: must be {what}")
    if args.schedule == "step":
        check_milestones(args.milestones, args.epochs)
    timeout = getattr(args, "dist_timeout", None)  # DDP's and AMP's flag
    if timeout is not None and not MIN_DIST_TIMEOUT <= timeout <= MAX_DIST_TIMEOUT:
        raise UserError(f"--dist-timeout {timeout}: must be a number of seconds from "
                        f"{MIN_DIST_TIMEOUT} to {MAX_DIST_TIMEOUT}, e.g. 600 (below "
                        f"{MIN_DIST_TIMEOUT} the others time out while the main process starts "
                        f"the tracker or writes a checkpoint)")
    check_fine_tuning(args.pretrained, args.pretrained_path, args.freeze, args.head_lr_scale)
    # The classifier's lr, --lr x --head-lr-scale, is float32 too: 1e300 overflows in its first step
    head_lr = (args.lr or DEFAULT_LR[args.optimizer]) * scale * args.head_lr_scale
    if not FLOAT32_TINY <= head_lr <= FLOAT32_MAX:
        raise UserError(f"--head-lr-scale {args.head_lr_scale:g}: the classifier's lr would be "
                        f"{head_lr:.3g}, outside what float32 holds ({FLOAT32_TINY:.3g} to "
                        f"{FLOAT32_MAX:.3g}); use a scale such as 10")
    if getattr(args, "sync_bn", False) and args.model.startswith(TIMM_PREFIX):  # DDP's, AMP's flag
        raise UserError(f"--sync-bn with --model {args.model}: torch's SyncBatchNorm conversion "
                        f"drops the activation timm keeps inside its norm layers; drop --sync-bn")
    check_model_name(args.model)
    check_folder("--output-dir", args.output_dir)


def check_milestones(milestones: list[int], epochs: int) -> None:
    """--schedule step divides the lr after each milestone epoch: one outside the run never acts,
    and one at 0 divides --lr before the first step."""
    given = " ".join(map(str, milestones))
    if epochs == 1:
        raise UserError(f"--milestones {given}: --schedule step with --epochs 1 has no epoch to "
                        f"divide the lr after; use --schedule onecycle, or 2 or more --epochs")
    if any(not 1 <= m < epochs for m in milestones) or milestones != sorted(set(milestones)):
        raise UserError(f"--milestones {given}: must be increasing epochs from 1 to {epochs - 1} "
                        f"for --schedule step with --epochs {epochs}")

