"""DistributedDataParallel with mixed precision: train_ddp.py + automatic mixed precision (AMP).

Matrix multiplies and convolutions run in 16-bit floats under autocast, everything numerically
delicate (losses, reductions, the weights and the optimizer) stays in fp32. Changes from
train_ddp.py, each tagged "# AMP:" (docs/diffs/train_amp.diff):

- --mixed-precision fp16|bf16, else the mixed_precision of the Accelerate config, else bf16 where
  the hardware has it (CPUs, GPUs of compute capability 8.0 and newer: Ampere, Hopper) and fp16 on
  older GPUs;
- Accelerate's autocast around the model's forward, and for fp16 its GradScaler: the loss is
  scaled so small gradients do not underflow, a step whose gradients overflowed is skipped (the
  schedule waits with it), --clip-grad clips after the gradients are unscaled, and the log line
  shows the loss scale and the skipped steps. A non-finite loss still stops the run: it comes from
  the forward pass, which the loss scale does not change;
- fp16 on a CPU is refused: Accelerate would train in fp32 without a word; bf16 on a CPU works.

The calls marked "# ALL" are train_ddp.py's: every process must make them, in the same order.

In the source articles fp16 gave 1.24x on top of DataParallel on 4 V100s (1.23 to 0.99 ms per
image at batch 512); DDP with AMP on 4 A100s took 6.5 s an epoch against 6.1 s without, at a batch
too small to gain. On the 2-core CPU of docs/benchmark a plain ResNet-18 loop ran 2.47x faster in
bf16 with channels_last than in fp32 with NCHW: precision and layout together (docs/benchmarks.md).

Launch:
    accelerate launch --config_file accelerate_configs/4gpu_bf16.yaml scripts/train_amp.py
    accelerate launch --config_file accelerate_configs/4gpu_fp16.yaml scripts/train_amp.py \
        --clip-grad 5
    torchrun --nproc_per_node 4 scripts/train_amp.py --mixed-precision bf16
    accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2 \
        scripts/train_amp.py --mixed-precision bf16 --dataset synthetic --model resnet20
                                                        # 2-process bf16 DDP on a CPU (gloo)
Resume: the same command plus --output-dir runs/train_amp-... --resume.
"""

import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm

from common.cli import RESUMABLE_FLAGS, add_ddp_args, build_parser, check_args
from common.data.inputs import load_data
from common.data.pretrained import fine_tune
from common.failures import refused_together
from common.observe.output import survive_closed_output
from common.observe.profiling import StepProfiler
from common.observe.tracking import (
    EpochMeter,
    StepLogger,
    installed_trackers,
    record_epoch,
    start_run,
)
from common.observe.utilisation import peak_memory
from common.parallel.launch import check_launch, launch_record, set_gpu_sharing
from common.parallel.amp import SkippedSteps, choose_mixed_precision
from common.parallel.step_guard import StepGuard, announce_stop
from common.recipe.compiling import set_up_compiling
from common.recipe.ema import WeightAverage
from common.recipe.evaluation import evaluate
from common.recipe.models import build_model
from common.recipe.numerics import set_numerics
from common.recipe.optim import optimizer_and_schedule, set_peak_lr
from common.run.checkpoints import Checkpointer, TrainProgress, resume_from
from common.run.folder import lock_run_and_find_resume
from common.run.record import done_line, run_config
from common.run.weights import save_final_weights

SCRIPT = Path(__file__).stem
RESUMABLE = RESUMABLE_FLAGS | {"dist_timeout", "share_gpus"}  # DDP: the wait, GPUs shared


def parse_args(argv=None):
    parser = build_parser(__doc__)
    add_ddp_args(parser)  # DDP: --sync-bn, --dist-timeout, --share-gpus
    parser.add_argument("--mixed-precision", choices=("fp16", "bf16"), default=None,  # AMP: format
                        help="16-bit format (default: the Accelerate config's, else bf16; fp16 on "
                             "pre-Ampere GPUs)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def set_up(args) -> Accelerator:
    """This process made ready to train: output that cannot stop it, the Accelerator, the seed."""
    survive_closed_output()  # a closed stdout (| head, a dead tee, a lost ssh) costs no training
    gc.freeze()  # what the imports built lives to the end: the collector skips it (1 s at exit)
    backend = set_gpu_sharing(args.share_gpus)  # DDP: a GPU each, or shared (--share-gpus)
    accelerator = Accelerator(  # ALL: where several processes make their process group
        log_with=installed_trackers(args.report_to),  # --report-to; main process only
        cpu=not torch.cuda.is_available(),  # DDP: else no GPU means N lone trainings, not gloo
        # AMP: prepare() autocasts the forward in fp16 or bf16 (refused where it cannot work)
        mixed_precision=choose_mixed_precision(args.mixed_precision),  # AMP: fp16: a GradScaler
        dynamo_plugin=set_up_compiling(args),  # prepare(): compile(); auto: CUDA graphs on GPUs
        gradient_accumulation_steps=args.grad_accum,  # --grad-accum: accumulate() counts them
        dataloader_config=DataLoaderConfiguration(
            # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
            use_seedable_sampler=True, data_seed=args.seed,
            non_blocking=True, split_batches=True),  # DDP: each process takes a slice
        # DDP: a process stalled in a collective for --dist-timeout seconds fails the job
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout),
                                                backend=backend)],  # None: NCCL on GPUs
    )
    # DDP: every process the launcher started, equal slices of the batch, --sync-bn on GPUs only
    check_launch(accelerator, args.batch_size, args.grad_accum, args.sync_bn)  # ALL
    set_seed(args.seed)  # the same on every process: the same initial weights
    return accelerator


def make_model(args, accelerator, data, weights):
    """--model for the data's classes and image size, with the pretrained ``weights`` if any: the
    model, and what fine-tuning records of them."""
    # refused if it cannot train at this size: one line, on every process at once
    model = refused_together(accelerator, build_model, args.model, data.num_classes,  # ALL
                             data.image_size)
    if args.sync_bn:  # DDP: one set of BatchNorm statistics over the global batch
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:  # tensor cores and oneDNN's convolutions are fastest in NHWC
        model = model.to(memory_format=torch.channels_last)
    # the pretrained weights loaded, their head swapped for the data's classes; --freeze backbone
    tuned = refused_together(accelerator, fine_tune, model, weights, args.model,  # ALL
                             data.num_classes, data.image_size, args.freeze)
    return model, tuned


def main(args):
    # ----------------------------------------------------------------------------------- setup
    accelerator = set_up(args)  # ALL
    fp32 = set_numerics(accelerator.device, args.tf32, args.deterministic)  # TF32, cuDNN search
    per_device_batch = args.batch_size // accelerator.num_processes // args.grad_accum  # DDP: slice
    # The run folder, locked for this job; a restarted or requeued job resumes by itself here.
    output_dir, checkpoint = lock_run_and_find_resume(  # ALL
        accelerator, args.output_dir, args.resume, __file__)

    # ------------------------------------------------------------------------------------ data
    weights, data = load_data(args, accelerator, checkpoint)  # ALL: the weights' file, the loaders
    train_loader, test_loader, transform = data.train_loader, data.test_loader, data.transform

    # ------------------------------------------------------------- model, optimizer, schedule
    model, tuned = make_model(args, accelerator, data, weights)  # ALL
    optimizer, scheduler, peak_lr, steps_per_epoch, total_steps = optimizer_and_schedule(
        args, model, len(train_loader))
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # DDP: DistributedDataParallel wraps the model here, on this process's device, and copies the
    # main process's weights to the others; each process's loaders give it a slice of every batch
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(  # ALL
        model, optimizer, train_loader, test_loader, scheduler)

    progress = TrainProgress(accelerator)  # the run's place and record, saved in every checkpoint
    ema = WeightAverage(accelerator, model, args.ema_decay)  # --ema-decay (0: none)
    config = run_config(vars(args), {
        **launch_record(accelerator),  # the processes, their devices, the backend
        "mixed_precision": accelerator.mixed_precision,  # AMP: the 16-bit format of this run
        "fp32_precision": fp32, "per_device_batch_size": per_device_batch,
        "grad_accum": args.grad_accum, "global_batch_size": args.batch_size, "lr": peak_lr,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, **data.config,
        **tuned})
    resume_from(accelerator, checkpoint, progress, config, RESUMABLE)  # ALL: if there is one
    set_peak_lr(optimizer, scheduler, peak_lr, say=accelerator.print)  # a resume may lower --lr
    where = f"{accelerator.num_processes} x {accelerator.device}"  # DDP: all of them
    start_run(accelerator, SCRIPT, args, config, output_dir, progress, where, data.line)  # ALL

    # ----------------------------------------------------------------------------------- train
    stop_step = min(total_steps, args.max_steps or total_steps)
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    meter = EpochMeter(accelerator.device, args.batch_size)  # the epoch's loss, time, data wait
    guard = StepGuard(accelerator, output_dir)  # what every process decides after each step
    skipped = SkippedSteps(accelerator, output_dir)  # AMP: fp16 stops after 100 skipped in a row
    guard.install_signal_handlers()  # SIGTERM, SIGUSR1: finish the step, save it, exit 75
    checkpointer = Checkpointer(accelerator, output_dir, args.checkpoint_every,
                                args.keep_checkpoints)
    profiler = StepProfiler(accelerator, args.profile, output_dir)  # --profile: a trace of steps
    stop = None  # the stop every process agreed on: a stop signal, or a non-finite loss
    for epoch in range(progress.epoch, args.epochs):
        if progress.step >= stop_step or stop:
            break
        model.train()
        train_loader.set_epoch(epoch)  # a new order each epoch, a function of seed and epoch
        # A mid-epoch resume starts at the first batch not trained on (a new loader only then)
        skip = progress.batch_in_epoch * args.grad_accum
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        step_loss = 0
        meter.start()
        for micro_batch, (images, labels) in enumerate(tqdm(
                batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                disable=not accelerator.is_main_process), start=progress.step * args.grad_accum):
            # Augmentation drawn from (seed, micro-batch): a resumed run draws what the first drew.
            # DDP: and from the process index, so the processes do not flip and crop alike.
            images = transform.train(images, (args.seed, micro_batch, accelerator.process_index))
            images, labels = data.mix(images, labels, micro_batch)  # --mixup, --cutmix: soft labels
            meter.wait.stop()
            # --grad-accum N: backward adds up the gradients of N micro-batches (each loss divided
            # by N); the optimizer, schedule and zero_grad act on the N-th only (sync_gradients).
            # DDP: no_sync on the first N-1 micro-batches: the gradients are all-reduced at the N-th
            with accelerator.accumulate(model):  # ALL: the step, its forward and backward
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                if args.clip_grad and accelerator.sync_gradients:  # the summed gradients' norm
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / args.grad_accum
            if not accelerator.sync_gradients:  # a micro-batch of a step still being accumulated
                meter.wait.start()
                continue
            progress.step += 1
            progress.batch_in_epoch += 1
            ema.update()  # ALL: --ema-decay: the average follows every optimizer step
            profiler.step()  # --profile: the traced steps are chosen by number
            meter.add(step_loss)
            # The epoch's last whole optimizer step: micro-batches left over wait for the next.
            epoch_end = progress.step >= stop_step or progress.batch_in_epoch == steps_per_epoch
            # None, a stop signal or a non-finite loss; read a step late on a GPU unless it is saved
            stop = guard.check(step_loss, progress.step,  # ALL
                               checkpointer.due(progress.step, epoch_end))
            stop = skipped.count(progress.step) or stop  # AMP: fp16 skips steps that overflowed
            step_logger.log(progress.step, step_loss, lr)
            step_loss = 0
            # ------------------------------------- the epoch's end: evaluate, record the epoch
            if epoch_end and (stop is None or stop.saves):
                epoch_complete = progress.end_epoch(epoch, steps_per_epoch)
                figures = meter.figures(  # ALL: the loss, the time, img/s, the data wait
                    accelerator.reduce(meter.loss_sum, "mean"))  # DDP: averaged over processes
                result = evaluate(model, test_loader, transform, accelerator,  # ALL
                                  data.num_classes)
                averaged = ema.evaluate(model, test_loader, transform, accelerator,  # ALL
                                        data.num_classes)  # {} when off
                record_epoch(accelerator, output_dir, progress.history, {
                    "epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                    "step": progress.step, "batch_size": args.batch_size, "lr": lr, **figures,
                    "test_acc": result.accuracy, "test_images": result.total, **averaged,
                    **skipped.figures(),  # AMP: fp16's loss scale and skipped steps
                    **peak_memory(accelerator)})  # ALL: GPUs: each process's peak this epoch
                if progress.step < stop_step:  # a stop signal that came during the evaluation
                    stop = guard.signalled()  # ALL
            # ---------- the one checkpoint: every --checkpoint-every steps, the epoch's end, a stop
            checkpointer.save(progress.step, epoch_end, stop)  # ALL
            if stop or epoch_end:
                break
            meter.wait.start()

    # ------------------------------------------------------------------------------- finish
    profiler.finish()  # --profile: the table of the ops that cost most per step
    if stop:  # one line; exit 75 (saved: --resume continues) or 1 (diverged: nothing of it saved)
        return announce_stop(accelerator, stop, progress.step, checkpointer.last)  # ALL
    ema.apply()  # --ema-decay: model.safetensors holds the averaged weights
    weights = save_final_weights(accelerator, model, output_dir, config, progress.step)  # ALL
    accelerator.print(done_line(progress.step, progress.history, weights))  # what the file holds
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
