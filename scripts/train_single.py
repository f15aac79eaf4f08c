"""Train an image classifier on one device: the baseline every other script builds on.

One process, one device (the GPU if there is one, else the CPU), through Hugging Face Accelerate.
The other scripts are this file plus only what their strategy needs; read them as diffs
(docs/diffs/). What this one shows:

- data decoded once into uint8 tensors and augmented on the device, a whole batch at a time;
- SGD with Nesterov momentum and a one-cycle (default) or step learning-rate schedule, its peak
  scaled with the global batch (--scale-lr); optional gradient clipping (--clip-grad);
- channels_last memory format (--no-channels-last to turn it off);
- on a CUDA GPU each step replayed as CUDA graphs (--compile auto: the step is launch-bound there),
  compiled into a cache private to the process (no one else's code); --compile none for eager;
- evaluation on the test split, one log line and one metrics.jsonl record per epoch;
- gradient accumulation (--grad-accum N) through accelerator.accumulate: N micro-batches per step;
- full training state saved every epoch with save_state, and --resume that continues bit for bit;
- SIGTERM or SIGUSR1 (SLURM, Kubernetes, the launcher), Ctrl-C or a lost terminal finishes the
  step, saves it and exits 75; one checkpoint call in the loop, where the cadence is decided;
- final weights in model.safetensors, with what evaluation needs (model, classes, normalisation).

A call marked "# ALL" is a collective or makes one: with several processes (train_ddp.py and the
scripts built on it) every process must make it, in the same order, or the others wait in it until
the job times out. The first one a newcomer breaks is put under `if accelerator.is_main_process:`.
The step in accelerator.accumulate is one too: DDP all-reduces the gradients in backward.

Launch:
    python scripts/train_single.py               # CIFAR-10 from the Hub, ResNet-18, 15 epochs
    accelerate launch --num_processes 1 scripts/train_single.py --model resnet50
    python scripts/train_single.py --dataset synthetic --model resnet20 --epochs 4  # on a CPU
    python scripts/train_single.py --schedule step --warmup-epochs 0  # the articles' recipe:
                                                  # lr 0.1, divided by 10 after epochs 4, 9, 14
Resume a stopped run (same flags, plus):
    python scripts/train_single.py ... --output-dir runs/train_single-20260101-120000 --resume
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
from common.observe.utilisation import peak_memory
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
    args = parser.parse_args(argv)
    check_args(args)
    return args


def set_up(args) -> Accelerator:
    """This process made ready to train: output that cannot stop it, the Accelerator, the seed."""
    survive_closed_output()  # a closed stdout (| head, a dead tee, a lost ssh) costs no training
    gc.freeze()  # what the imports built lives to the end: the collector skips it (1 s at exit)
    require_single_process(__file__)
    accelerator = Accelerator(  # ALL: where several processes make their process group
        log_with=installed_trackers(args.report_to),  # --report-to; main process only
        mixed_precision="no",  # the fp32 baseline, whatever the Accelerate config says
        dynamo_plugin=set_up_compiling(args),  # prepare(): compile(); auto: CUDA graphs on GPUs
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
    per_device_batch = args.batch_size // args.grad_accum  # one device takes each whole micro-batch
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

    progress = TrainProgress(accelerator)  # the run's place and record, saved in every checkpoint
    ema = WeightAverage(accelerator, model, args.ema_decay)  # --ema-decay (0: none)
    config = run_config(vars(args), {
        **launch_record(accelerator),  # the processes, their devices, the backend
        "fp32_precision": fp32, "per_device_batch_size": per_device_batch,
        "grad_accum": args.grad_accum, "global_batch_size": args.batch_size, "lr": peak_lr,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, **data.config,
        **tuned})
    resume_from(accelerator, checkpoint, progress, config, RESUMABLE)  # ALL: if there is one
    set_peak_lr(optimizer, scheduler, peak_lr, say=accelerator.print)  # a resume may lower --lr
    where = str(accelerator.device)  # the devices it trains on, for the start line
    start_run(accelerator, SCRIPT, args, config, output_dir, progress, where, data.line)  # ALL

    # ----------------------------------------------------------------------------------- train
    stop_step = min(total_steps, args.max_steps or total_steps)
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    meter = EpochMeter(accelerator.device, args.batch_size)  # the epoch's loss, time, data wait
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
            step_logger.log(progress.step, step_loss, lr)
            step_loss = 0
            # ------------------------------------- the epoch's end: evaluate, record the epoch
            if epoch_end and (stop is None or stop.saves):
                epoch_complete = progress.end_epoch(epoch, steps_per_epoch)
                figures = meter.figures(  # ALL: the loss, the time, img/s, the data wait
                    meter.loss_sum)
                result = evaluate(model, test_loader, transform, accelerator,  # ALL
                                  data.num_classes)
                averaged = ema.evaluate(model, test_loader, transform, accelerator,  # ALL
                                        data.num_classes)  # {} when off
                record_epoch(accelerator, output_dir, progress.history, {
                    "epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                    "step": progress.step, "batch_size": args.batch_size, "lr": lr, **figures,
                    "test_acc": result.accuracy, "test_images": result.total, **averaged,
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
