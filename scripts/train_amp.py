"""DistributedDataParallel with mixed precision: train_ddp.py + automatic mixed precision (AMP).

Matrix multiplies and convolutions run in 16-bit floats under autocast, everything numerically
delicate (losses, reductions, the weights and the optimizer) stays in fp32. Changes from
train_ddp.py, each tagged "# AMP:" (docs/diffs/train_amp.diff):

- --mixed-precision fp16|bf16, else the mixed_precision of the Accelerate config, else bf16 where
  the device has it (CPUs with AVX-512 bf16, Ampere and newer GPUs) and fp16 elsewhere;
- fp16 scales the loss so small gradients do not underflow (GradScaler); a step whose gradients
  overflowed is skipped, the schedule waits with it, and the log line shows the loss scale and the
  skipped steps; --clip-grad clips after the gradients are unscaled;
- fp16 on a CPU is refused: Accelerate would train in fp32 without a word; bf16 on a CPU works;
- channels_last memory format (on by default, --no-channels-last to turn it off): convolutions
  with tensor cores and oneDNN's bf16 kernels are fastest in NHWC (docs/benchmark: ResNet-18 on a
  2-core CPU, 34 img/s fp32 vs 85 img/s bf16 + channels_last).

In the source articles AMP gave 1.24x on 4 V100s at the same batch (0.99 vs 1.23 ms per image).

Launch:
    accelerate launch --config_file accelerate_configs/4gpu_bf16.yaml scripts/train_amp.py
    accelerate launch --config_file accelerate_configs/4gpu_fp16.yaml scripts/train_amp.py --clip-grad 5
    torchrun --nproc_per_node 4 scripts/train_amp.py --mixed-precision bf16
    accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2 scripts/train_amp.py \
        --mixed-precision bf16 --dataset synthetic --model resnet20     # 2-process bf16 DDP on a CPU
Resume: the same command plus --output-dir runs/train_amp-... --resume.
"""

import argparse
import json
import os
import time
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm

from common.augment import BatchTransform, channel_stats
from common.checkpoint import TrainProgress, resolve_run, save_checkpoint, save_weights
from common.cli import build_parser, check_args
from common.data import load_image_data
from common.errors import UserError
from common.evaluation import evaluate
from common.gpu import process_peak_memory
from common.guard import stop_if_not_finite
from common.launch import check_batch_split, check_gpus_per_node, check_world_size
from common.loader import tensor_loader
from common.models import build_model
from common.optim import build_optimizer, build_scheduler
from common.record import check_resume_config, log_line, run_config, write_json, write_metrics
from common.tracking import StepLogger, start_tracking, track


def parse_args(argv=None):
    parser = build_parser(__doc__)
    parser.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,  # DDP
                        help="scale --lr by global batch / --reference-batch-size (default: on)")
    parser.add_argument("--reference-batch-size", type=int, default=128,  # DDP
                        help="the global batch that --lr is tuned for (default: %(default)s)")
    parser.add_argument("--sync-bn", action="store_true",  # DDP
                        help="SyncBatchNorm: BatchNorm statistics over the global batch (GPUs only)")
    parser.add_argument("--dist-timeout", type=float, default=60,  # DDP
                        help="seconds a process waits for the others in a collective before the job fails; "
                             "a stalled process ends the job instead of hanging it (default: %(default)s)")
    parser.add_argument("--mixed-precision", choices=("fp16", "bf16"), default=None,  # AMP
                        help="16-bit format under autocast (default: the Accelerate config's, else bf16 "
                             "where the device has it, else fp16)")
    parser.add_argument("--clip-grad", type=float, default=None,  # AMP
                        help="clip the gradient norm to this value, after unscaling (default: no clipping)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,  # AMP
                        help="NHWC memory format for the model and batches (default: on)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def main(args):
    # ----------------------------------------------------------------------------------- setup
    # AMP: the flag, else the Accelerate config's (accelerate launch exports it), else a default.
    precision = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "no":
        precision = "bf16" if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not torch.cuda.is_available():  # AMP: Accelerate would ignore it silently
        raise UserError("--mixed-precision fp16 needs a GPU (on a CPU Accelerate would train in fp32 without "
                        "a word): use --mixed-precision bf16")
    check_gpus_per_node()  # DDP: one process per GPU, never more
    accelerator = Accelerator(
        log_with=None if args.report_to == "none" else args.report_to,  # wandb, main process only
        cpu=not torch.cuda.is_available(),  # DDP: without it, no GPU means N lone trainings, not gloo
        mixed_precision=precision,  # AMP: autocast in forward, and a GradScaler for fp16
        dynamo_backend=args.compile or "no",  # --compile: prepare() wraps the model in torch.compile
        # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
        # DDP: split_batches: --batch-size is global, each process takes its slice of every batch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed,
                                                  split_batches=True),
        # DDP: a process that stalls fails the job after --dist-timeout instead of hanging it.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))],
    )
    check_world_size(accelerator)  # DDP: Accelerate must see every process the launcher started
    # DDP: every process gets an equal slice of the global batch.
    check_batch_split(args.batch_size, accelerator.num_processes, f"{accelerator.num_processes} processes")
    per_device_batch = args.batch_size // accelerator.num_processes  # DDP
    if args.sync_bn and accelerator.device.type == "cpu":  # DDP: torch has no CPU SyncBatchNorm
        raise UserError("--sync-bn needs GPUs (SyncBatchNorm has no CPU implementation): drop --sync-bn")
    set_seed(args.seed)
    output_dir, checkpoint = resolve_run(accelerator, args.output_dir, args.resume, __file__)

    # ------------------------------------------------------------------------------------ data
    # The first process to get there downloads and decodes; the others wait, then read its cache.
    data = load_image_data(args.dataset, args.data_dir, args.cache_dir, args.synthetic_train_size,
                           args.synthetic_test_size)
    if len(data.train_labels) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size} is larger than the {len(data.train_labels)} "
                        f"training images: use a smaller --batch-size")
    transform = BatchTransform(*channel_stats(data.train_images), augment=args.augment,
                               channels_last=args.channels_last)  # AMP: NHWC batches
    device = accelerator.device  # the whole dataset lives on the device: no copy per batch
    train_loader = tensor_loader(data.train_images.to(device), data.train_labels.to(device),
                                 args.batch_size, shuffle=True, seed=args.seed)
    test_loader = tensor_loader(data.test_images.to(device), data.test_labels.to(device),
                                args.batch_size, shuffle=False)

    # ------------------------------------------------------------- model, optimizer, schedule
    model = build_model(args.model, num_classes=len(data.classes))
    if args.sync_bn:  # DDP: one set of BatchNorm statistics over the global batch
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:  # AMP: tensor cores and oneDNN bf16 kernels prefer NHWC
        model = model.to(memory_format=torch.channels_last)
    # DDP: a larger global batch takes a proportionally larger lr (Goyal et al. 2017, linear rule).
    lr = args.lr * args.batch_size / args.reference_batch_size if args.scale_lr else args.lr
    optimizer = build_optimizer(model, lr, args.momentum, args.weight_decay)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    scheduler = build_scheduler(optimizer, args.schedule, total_steps, steps_per_epoch,
                                args.warmup_epochs, args.milestones)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)

    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    config = run_config(args, {
        "world_size": accelerator.num_processes, "device": str(device),
        "per_device_batch_size": per_device_batch,  # DDP
        "global_batch_size": args.batch_size, "lr": lr, "mixed_precision": precision,  # AMP
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
        "data": data.source, "classes": data.classes, "train_size": len(data.train_labels),
        "test_size": len(data.test_labels),
        "normalization": {"mean": transform.mean.flatten().tolist(), "std": transform.std.flatten().tolist()}})
    if checkpoint:
        check_resume_config(checkpoint, args)
        accelerator.load_state(str(checkpoint))
        progress.history = [m for m in progress.history if m["epoch_complete"]]
        accelerator.print(f"resumed from {checkpoint} at epoch {progress.epoch + 1}, step {progress.step}")
    if accelerator.is_main_process and not (output_dir / "config.json").exists():
        write_json(output_dir / "config.json", config)
    start_tracking(accelerator, args, config, output_dir, progress)  # one wandb run per job
    stop_step = min(total_steps, args.max_steps or total_steps)
    accelerator.print(f"train_amp: {precision} {args.model} on {accelerator.num_processes} x {device}, "  # AMP
                      f"channels_last {args.channels_last}, global batch "
                      f"{args.batch_size} = {accelerator.num_processes} x {per_device_batch}, lr {lr:g}, "
                      f"{len(data.train_labels)} training images ({data.source}), {steps_per_epoch} steps/epoch, "
                      f"{total_steps} steps in all, record in {output_dir}")

    # ----------------------------------------------------------------------------------- train
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    for epoch in range(progress.epoch, args.epochs):
        if progress.step >= stop_step:
            break
        model.train()
        train_loader.set_epoch(epoch)  # a new order each epoch, a function of the seed and the epoch
        # After a mid-epoch resume, start at the first batch this epoch has not trained on.
        batches = accelerator.skip_first_batches(train_loader, progress.batch_in_epoch)
        loss_sum, trained, data_wait = torch.zeros((), device=device), 0, 0.0
        skipped = 0  # AMP: fp16 steps skipped because the gradients overflowed
        start = tick = time.perf_counter()
        for images, labels in tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                                   disable=not accelerator.is_main_process):
            # Augmentation drawn from (seed, step): a resumed run draws what the first run drew.
            # DDP: and from the process index, so the processes do not flip and crop alike.
            images = transform.train(images, seed=(args.seed, progress.step, accelerator.process_index))
            data_wait += time.perf_counter() - tick
            with accelerator.autocast():  # AMP: the forward and the loss in 16 bits where it is safe
                loss = criterion(model(images), labels)
            if precision != "fp16":  # AMP: fp16 skips a step with inf/nan gradients instead of stopping
                stop_if_not_finite(accelerator, loss, progress.step + 1, output_dir)  # all processes alike
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)  # AMP: fp16 multiplies the loss by the scale first
            if args.clip_grad:  # AMP: Accelerate unscales the gradients before it clips them
                accelerator.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()  # AMP: fp16 skips the step on inf/nan gradients; the schedule then waits
            skipped += accelerator.optimizer_step_was_skipped  # AMP
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            progress.step += 1
            progress.batch_in_epoch += 1
            loss_sum += loss.detach()
            trained += 1
            step_logger.log(progress.step, loss, lr)
            if progress.step >= stop_step:
                break
            if args.checkpoint_every and progress.step % args.checkpoint_every == 0 \
                    and progress.batch_in_epoch < steps_per_epoch:  # the end of an epoch saves its own
                save_checkpoint(accelerator, output_dir, progress.step, args.keep_checkpoints)
            tick = time.perf_counter()
        # DDP: the mean over processes; .item() waits for the device, so the time is true.
        train_loss = accelerator.reduce(loss_sum, "mean").item() / trained
        epoch_time = time.perf_counter() - start
        epoch_complete = progress.batch_in_epoch == steps_per_epoch
        if epoch_complete:
            progress.epoch, progress.batch_in_epoch = epoch + 1, 0

        # ------------------------------------------------------- evaluate, record, checkpoint
        result = evaluate(model, test_loader, transform, accelerator, len(data.classes))
        metrics = {"epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                   "step": progress.step, "batch_size": args.batch_size, "lr": lr, "train_loss": train_loss,
                   "test_acc": result.accuracy, "test_images": result.total, "epoch_time_s": epoch_time,
                   "img_per_s": trained * args.batch_size / epoch_time, "data_wait_frac": data_wait / epoch_time}
        if accelerator.scaler is not None:  # AMP: fp16 only
            metrics.update(loss_scale=accelerator.scaler.get_scale(), skipped_steps=skipped)
        metrics.update(process_peak_memory(accelerator))  # GPUs: each process's peak this epoch
        progress.history.append(metrics)
        if accelerator.is_main_process:
            write_metrics(output_dir, progress.history)
        accelerator.print(log_line(metrics))
        track(accelerator, metrics, step=progress.step)
        save_checkpoint(accelerator, output_dir, progress.step, args.keep_checkpoints)

    # ------------------------------------------------------------------------------- finish
    if accelerator.is_main_process:
        # unwrap_model strips DDP, save_weights the _orig_mod. of --compile: loads into a plain model.
        save_weights(accelerator.unwrap_model(model), output_dir / "model.safetensors",
                     {"model": args.model, "classes": json.dumps(data.classes), "step": str(progress.step)})
    final = progress.history[-1] if progress.history else None
    accelerator.print(f"done: step {progress.step}, test_acc {final['test_acc']:.4f}" if final else "done",
                      f"- weights in {output_dir / 'model.safetensors'}")
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
