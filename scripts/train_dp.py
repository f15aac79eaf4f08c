"""Train on every visible GPU from one process with torch.nn.DataParallel: train_single.py + DP.

At every forward DataParallel copies the model to each GPU, scatters the batch in one slice per
GPU, runs the copies in one thread each and gathers their outputs on the first GPU; backward sums
the gradients into the model there. One process and no launcher, but the threads share one Python
interpreter (the GIL) and GPU 0 does extra work: PyTorch recommends DistributedDataParallel
instead, "even if there is only a single node" (torch.nn.DataParallel docs); here that is
scripts/train_ddp.py. In the source articles an epoch of ResNet-50 took 13.2 s on one A100,
19.1 s with DataParallel on 4 (its input pipeline could not keep up) and 6.1 s with DDP on 4.

Accelerate has no DataParallel mode and is still used for what train_single.py uses it for: device
placement, the seeded loader, save_state/load_state and unwrap_model. The model is wrapped after
accelerator.prepare, so checkpoints and model.safetensors hold the plain model. Changes from
train_single.py, each tagged "# DP:" (docs/diffs/train_dp.diff):

- the GPUs are all that CUDA_VISIBLE_DEVICES leaves visible; with one DataParallel has nothing to
  split, and without any the script trains without it (on a CPU it is train_single.py, bit for bit);
- --batch-size stays the GLOBAL batch, scattered in equal slices: it must divide by the GPU count;
- a test copy between every pair of GPUs before training: broken peer-to-peer copies (IOMMU or
  PCIe ACS) gave the articles' NaN loss in the first epoch on two PCIe GPUs. On such a machine use
  train_ddp.py with NCCL_P2P_DISABLE=1;
- per-GPU memory (allocated, reserved, peak of the epoch) in the log line: GPU 0 holds more, as it
  keeps the model, its gradients and optimizer state, the gathered outputs and the loss;
- --loss-in-replicas: each GPU computes the loss of its own slice (the articles' "parallel
  criterion"), so GPU 0 gathers one number per GPU instead of every output.

No --share-gpus (train_ddp.py's rehearsal of a launch on fewer GPUs): DataParallel needs a
distinct GPU per replica. No --compile (the replicas are new copies of the model at every step;
--compile auto trains them eagerly) and no mixed precision: Accelerate's autocast is bound to the
model that prepare() saw, which every replica would call, so DataParallel needs autocast inside
each replica's thread and a hand-driven GradScaler, a second way to teach AMP; scripts/train_amp.py
teaches it once, on DDP.

The calls marked "# ALL" (train_single.py's docstring) are collectives with several processes; in
this one process they are plain calls, marked so that the script reads as the others do.

Pitfalls: BatchNorm normalises each GPU's slice on its own, and its running statistics come from
GPU 0's slice only (the other replicas are dropped after forward). A state_dict() taken from the
DataParallel wrapper has `module.` in front of every key and does not load into a plain model
(common.run.weights.load_weights strips it); this script saves the unwrapped model.

Launch:
    python scripts/train_dp.py                                  # every visible GPU
    CUDA_VISIBLE_DEVICES=0,1 python scripts/train_dp.py --batch-size 256 --loss-in-replicas
    python scripts/train_dp.py --dataset synthetic --model resnet20   # a CPU: one device, no split
It is one process: `accelerate launch --num_processes 1` works too, more processes are refused.
Resume: the same command plus --output-dir runs/train_dp-... --resume.
"""

import gc
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm

from common.cli import RESUMABLE_FLAGS, build_parser, check_args
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
from common.parallel.data_parallel import check_compile_flag, checked_gpus, memory_report
from common.parallel.launch import launch_record, require_single_process
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
RESUMABLE = RESUMABLE_FLAGS  # the flags that --resume lets change


def parse_args(argv=None):
    parser = build_parser(__doc__)
    parser.add_argument("--loss-in-replicas", action="store_true",  # DP: the parallel criterion
                        help="compute each GPU's loss on that GPU: GPU 0 gathers one loss per GPU, "
                             "not every output")
    args = parser.parse_args(argv)
    check_args(args)
    check_compile_flag(args.compile)  # DP: the replicas, new at every step, are never compiled
    return args


class Replica(torch.nn.Module):  # DP: what DataParallel copies to each GPU, run in a thread per GPU
    """The model and, given labels, the loss of this GPU's slice (--loss-in-replicas)."""

    def __init__(self, model, criterion):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, images, labels=None):
        outputs = self.model(images)  # DP: a 1-element loss: GPU 0 gathers one per GPU, not outputs
        return outputs if labels is None else self.criterion(outputs, labels).unsqueeze(0)


def set_up(args) -> Accelerator:
    """This process made ready to train: output that cannot stop it, the Accelerator, the seed."""
    survive_closed_output()  # a closed stdout (| head, a dead tee, a lost ssh) costs no training
    gc.freeze()  # what the imports built lives to the end: the collector skips it (1 s at exit)
    require_single_process(__file__)
    accelerator = Accelerator(  # ALL: where several processes make their process group
        log_with=installed_trackers(args.report_to),  # --report-to; main process only
        mixed_precision="no",  # the fp32 baseline, whatever the Accelerate config says
        # DP: the replicas, new copies at every step, are never compiled (--compile BACKEND refused)
        dynamo_plugin=set_up_compiling(args, model_is="replicas"),
        gradient_accumulation_steps=args.grad_accum,  # --grad-accum: accumulate() counts them
        dataloader_config=DataLoaderConfiguration(
            # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
            use_seedable_sampler=True, data_seed=args.seed,
            non_blocking=True),
    )
    set_seed(args.seed)  # the same on every process: the same initial weights
    return accelerator


def make_model(args, accelerator, data, weights):
    """--model for the data's classes and image size, with the pretrained ``weights`` if any: the
    model, and what fine-tuning records of them."""
    # refused if it cannot train at this size: one line, on every process at once
    model = refused_together(accelerator, build_model, args.model, data.num_classes,  # ALL
                             data.image_size)
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
    # DP: every GPU CUDA_VISIBLE_DEVICES shows, in equal slices, their copies arriving intact
    devices = checked_gpus(accelerator.device, args.batch_size, args.grad_accum)
    per_device_batch = args.batch_size // args.grad_accum // max(len(devices), 1)  # DP: each GPU's
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
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(  # ALL
        model, optimizer, train_loader, test_loader, scheduler)
    parallel_model = Replica(model, criterion)  # DP: after prepare: save_state keeps the plain one
    if devices:  # DP: gathers on devices[0]; on a CPU (or --cpu) there is nothing to split
        parallel_model = torch.nn.DataParallel(parallel_model, device_ids=devices)

    progress = TrainProgress(accelerator)  # the run's place and record, saved in every checkpoint
    ema = WeightAverage(accelerator, model, args.ema_decay)  # --ema-decay (0: none)
    config = run_config(vars(args), {
        **launch_record(accelerator),  # the processes, their devices, the backend
        "gpus": [str(d) for d in devices],  # DP: the GPUs DataParallel splits over
        "fp32_precision": fp32, "per_device_batch_size": per_device_batch,
        "grad_accum": args.grad_accum, "global_batch_size": args.batch_size, "lr": peak_lr,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, **data.config,
        **tuned})
    resume_from(accelerator, checkpoint, progress, config, RESUMABLE)  # ALL: if there is one
    set_peak_lr(optimizer, scheduler, peak_lr, say=accelerator.print)  # a resume may lower --lr
    where = ", ".join(map(str, devices)) or str(accelerator.device)  # DP: every GPU
    start_run(accelerator, SCRIPT, args, config, output_dir, progress, where, data.line)  # ALL

    # ----------------------------------------------------------------------------------- train
    stop_step = min(total_steps, args.max_steps or total_steps)
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    meter = EpochMeter(accelerator.device, args.batch_size, devices)  # DP: all GPUs' utilisation
    guard = StepGuard(accelerator, output_dir)  # what every process decides after each step
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
            images = transform.train(images, (args.seed, micro_batch))
            images, labels = data.mix(images, labels, micro_batch)  # --mixup, --cutmix: soft labels
            meter.wait.stop()
            # --grad-accum N: backward adds up the gradients of N micro-batches (each loss divided
            # by N); the optimizer, schedule and zero_grad act on the N-th only (sync_gradients).
            with accelerator.accumulate(model):  # ALL: the step, its forward and backward
                loss = (parallel_model(images, labels).mean() if args.loss_in_replicas  # DP: GPUs
                        else criterion(parallel_model(images), labels))  # DP: gathered on GPU 0
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
            step_logger.log(progress.step, step_loss, lr)
            step_loss = 0
            # ------------------------------------- the epoch's end: evaluate, record the epoch
            if epoch_end and (stop is None or stop.saves):
                epoch_complete = progress.end_epoch(epoch, steps_per_epoch)
                figures = meter.figures(  # ALL: the loss, the time, img/s, the data wait
                    meter.loss_sum)
                # DP: evaluated on all the GPUs
                result = evaluate(parallel_model, test_loader, transform, accelerator,  # ALL
                                  data.num_classes)
                # DP: the weight average too
                averaged = ema.evaluate(parallel_model, test_loader, transform, accelerator,  # ALL
                                        data.num_classes)  # {} when off
                record_epoch(accelerator, output_dir, progress.history, {
                    "epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                    "step": progress.step, "batch_size": args.batch_size, "lr": lr, **figures,
                    "test_acc": result.accuracy, "test_images": result.total, **averaged,
                    **memory_report(devices)})  # DP: one value per GPU; GPU 0 holds more
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
