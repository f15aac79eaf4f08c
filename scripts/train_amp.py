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

In the source articles AMP gave 1.24x on 4 V100s at the same batch (0.99 vs 1.23 ms per image).
On the 2-core CPU of docs/benchmark, ResNet-18 trained at 34 img/s in fp32 and 85 img/s in bf16.

Launch:
    accelerate launch --config_file accelerate_configs/4gpu_bf16.yaml scripts/train_amp.py
    accelerate launch --config_file accelerate_configs/4gpu_fp16.yaml scripts/train_amp.py --clip-grad 5
    torchrun --nproc_per_node 4 scripts/train_amp.py --mixed-precision bf16
    accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2 scripts/train_amp.py \
        --mixed-precision bf16 --dataset synthetic --model resnet20     # 2-process bf16 DDP on a CPU
Resume: the same command plus --output-dir runs/train_amp-... --resume.
"""


import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm

from common.checkpoint import (
    TrainProgress,
    check_resume_config,
    load_checkpoint,
    resolve_run,
    run_config,
    save_checkpoint,
    save_weights,
    write_json,
    write_metrics,
)
from common.cli import RESUMABLE_FLAGS, build_parser, check_args
from common.errors import UserError
from common.evaluation import evaluate
from common.inputs import load_inputs
from common.models import build_model
from common.optim import build_optimizer, build_scheduler
from common.parallel import (
    SkippedSteps,
    StepGuard,
    check_batch_split,
    check_gpus_per_node,
    check_world_size,
    choose_mixed_precision,
    peak_memory,
    set_numerics,
)
from common.tracking import DataWait, StepLogger, log_line, start_tracking, track

SCRIPT = Path(__file__).stem
EVALUATION = ("classes", "image_size", "normalization", "mixed_precision", "eval_split")  # into model.safetensors
RESUMABLE = RESUMABLE_FLAGS | {"dist_timeout"}  # DDP: a resumed job may wait longer or shorter


def parse_args(argv=None):
    parser = build_parser(__doc__)
    parser.add_argument("--sync-bn", action="store_true",  # DDP: statistics of the global batch
                        help="SyncBatchNorm: BatchNorm statistics over the global batch (GPUs only)")
    parser.add_argument("--dist-timeout", type=float, default=600,  # DDP: a stalled process fails the job
                        help="seconds a process waits for the others in a collective before the job fails: a "
                             "stalled process ends the job instead of hanging it (default: %(default)s, as NCCL)")
    parser.add_argument("--mixed-precision", choices=("fp16", "bf16"), default=None,  # AMP: the 16-bit format
                        help="16-bit format (default: the Accelerate config's, else bf16; fp16 on pre-Ampere GPUs)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def main(args):
    # ----------------------------------------------------------------------------------- setup
    precision = choose_mixed_precision(args.mixed_precision)  # AMP: fp16 or bf16, refused where it cannot work
    check_gpus_per_node()  # DDP: one process per GPU, never more
    accelerator = Accelerator(
        log_with=None if args.report_to == "none" else args.report_to,  # wandb, main process only
        cpu=not torch.cuda.is_available(),  # DDP: without it, no GPU means N lone trainings, not gloo
        mixed_precision=precision,  # AMP: prepare() autocasts the forward; fp16 adds a GradScaler
        dynamo_backend=args.compile or "no",  # --compile: prepare() wraps the model in torch.compile
        gradient_accumulation_steps=args.grad_accum,  # --grad-accum: accumulate() counts the micro-batches
        # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed, non_blocking=True,
                                                  split_batches=True),  # DDP: each process takes a slice
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))],  # DDP: fail, not hang
    )
    # TF32 where the GPU has it (--tf32), cuDNN's algorithm search, or --deterministic
    fp32 = set_numerics(accelerator.device, args.tf32, args.deterministic)
    check_world_size(accelerator)  # DDP: Accelerate must see every process the launcher started
    check_batch_split(args.batch_size, accelerator.num_processes, "processes", args.grad_accum)  # DDP: equal slices
    per_device_batch = args.batch_size // accelerator.num_processes // args.grad_accum  # DDP: each process's slice
    if args.sync_bn and accelerator.device.type == "cpu":  # DDP: torch has no CPU SyncBatchNorm
        raise UserError("--sync-bn needs GPUs (SyncBatchNorm has no CPU implementation): drop --sync-bn")
    set_seed(args.seed)
    output_dir, checkpoint = resolve_run(accelerator, args.output_dir, args.resume, __file__)

    # ------------------------------------------------------------------------------------ data
    # --loader device: decoded once into one tensor on the device, augmented there a batch at a time;
    # workers: decoded and augmented per sample by DataLoader workers, for data of any size and count.
    data = load_inputs(args, accelerator)
    train_loader, test_loader, transform = data.train_loader, data.test_loader, data.transform
    device = accelerator.device

    # ------------------------------------------------------------- model, optimizer, schedule
    model = build_model(args.model, num_classes=len(data.classes))
    if args.sync_bn:  # DDP: one set of BatchNorm statistics over the global batch
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:  # tensor cores and oneDNN's convolutions are fastest in NHWC
        model = model.to(memory_format=torch.channels_last)
    # Linear scaling rule (Goyal et al. 2017, arXiv:1706.02677): k times the batch, k times the lr.
    peak_lr = args.lr * args.batch_size / args.reference_batch_size if args.scale_lr else args.lr
    optimizer = build_optimizer(model, peak_lr, args.momentum, args.weight_decay)
    steps_per_epoch = len(train_loader) // args.grad_accum  # optimizer steps; the loader yields micro-batches
    total_steps = steps_per_epoch * args.epochs
    scheduler = build_scheduler(optimizer, args.schedule, total_steps, steps_per_epoch,
                                args.warmup_epochs, args.milestones)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)

    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    config = run_config(vars(args), {
        "world_size": accelerator.num_processes, "device": str(device), "fp32_precision": fp32,
        "per_device_batch_size": per_device_batch, "grad_accum": args.grad_accum,
        "global_batch_size": args.batch_size, "lr": peak_lr,
        "mixed_precision": precision,  # AMP: the 16-bit format of this run
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
        **data.config})
    if checkpoint:
        check_resume_config(checkpoint, config, RESUMABLE)
        load_checkpoint(accelerator, checkpoint)
        progress.history = [m for m in progress.history if m["epoch_complete"]]
        accelerator.print(f"resumed from {checkpoint} at epoch {progress.epoch + 1}, step {progress.step}")
    if accelerator.is_main_process and not (output_dir / "config.json").exists():
        write_json(output_dir / "config.json", config)
    start_tracking(accelerator, config, output_dir, progress, project=args.wandb_project,  # one run per job
                   name=args.run_name, tags=args.wandb_tags, group=args.wandb_group)
    stop_step = min(total_steps, args.max_steps or total_steps)
    accelerator.print(f"{SCRIPT}: {precision} {args.model} on {accelerator.num_processes} x {device}, "  # AMP: format
                      f"batch {args.batch_size} ({per_device_batch} per device"
                      f"{f' x {args.grad_accum} micro-batches' * (args.grad_accum > 1)}), lr {peak_lr:g}, "
                      f"fp32 math {fp32}{' (deterministic)' * args.deterministic}, "
                      f"{data.train_size} training images ({data.source}), {data.line}, {steps_per_epoch} steps/epoch, "
                      f"{total_steps} steps in all, record in {output_dir}")

    # ----------------------------------------------------------------------------------- train
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    data_wait, guard = DataWait(device), StepGuard(accelerator, output_dir)  # NaN loss, SIGTERM, SIGUSR1
    skipped = SkippedSteps(accelerator, output_dir)  # AMP: fp16 stops after 100 skipped steps in a row
    for epoch in range(progress.epoch, args.epochs):
        if progress.step >= stop_step:
            break
        model.train()
        train_loader.set_epoch(epoch)  # a new order each epoch, a function of the seed and the epoch
        # After a mid-epoch resume, start at the first batch this epoch has not trained on.
        batches = accelerator.skip_first_batches(train_loader, progress.batch_in_epoch * args.grad_accum) \
            if progress.batch_in_epoch else train_loader  # a new loader: the workers would start again
        loss_sum, step_loss, trained = torch.zeros((), device=device), 0, 0
        skipped.in_epoch = 0  # AMP: fp16 steps skipped because the gradients overflowed
        start = time.perf_counter()
        data_wait.start()
        for micro_batch, (images, labels) in enumerate(tqdm(
                batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, disable=not accelerator.is_main_process),
                start=progress.step * args.grad_accum):  # counted over the run
            # Augmentation drawn from (seed, micro-batch): a resumed run draws what the first run drew.
            # DDP: and from the process index, so the processes do not flip and crop alike.
            images = transform.train(images, seed=(args.seed, micro_batch, accelerator.process_index))
            data_wait.stop()
            # --grad-accum N: backward adds up the gradients of N micro-batches (each loss divided by N);
            # the optimizer, the schedule and zero_grad act on the N-th only (accelerator.sync_gradients).
            with accelerator.accumulate(model):
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                if args.clip_grad and accelerator.sync_gradients:  # the norm of the summed gradients
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / args.grad_accum
            if not accelerator.sync_gradients:  # a micro-batch of a step still being accumulated
                data_wait.start()
                continue
            progress.step += 1
            progress.batch_in_epoch += 1
            loss_sum += step_loss
            trained += 1
            skipped.count(progress.step)  # AMP: fp16 skips a step that overflowed
            # NaN or inf: all processes stop, nothing of it saved; True: a stop signal, all stop here
            stop = guard.check(step_loss, progress.step)
            step_logger.log(progress.step, step_loss, lr)
            step_loss = 0
            if progress.step >= stop_step or progress.batch_in_epoch == steps_per_epoch:
                break  # the epoch's last whole optimizer step: micro-batches left over wait for the next
            if stop:  # saved at this step, then every process exits; at an epoch's end it saves below
                guard.stop(save_checkpoint(accelerator, output_dir, progress.step, args.keep_checkpoints),
                           progress.step)
            if args.checkpoint_every and progress.step % args.checkpoint_every == 0:
                guard.flush()  # this step's loss is known to be finite before the step is saved
                save_checkpoint(accelerator, output_dir, progress.step, args.keep_checkpoints)
            data_wait.start()
        guard.flush()  # the epoch's last loss, before anything of the epoch is recorded
        # .item() waits for the device, so the epoch time below is true.
        train_loss = accelerator.reduce(loss_sum, "mean").item() / trained  # DDP: the mean over processes
        epoch_time = time.perf_counter() - start
        epoch_complete = progress.batch_in_epoch == steps_per_epoch
        if epoch_complete:
            progress.epoch, progress.batch_in_epoch = epoch + 1, 0

        # ------------------------------------------------------- evaluate, record, checkpoint
        result = evaluate(model, test_loader, transform, accelerator, len(data.classes))
        metrics = {"epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                   "step": progress.step, "batch_size": args.batch_size, "lr": lr, "train_loss": train_loss,
                   "test_acc": result.accuracy, "test_images": result.total, "epoch_time_s": epoch_time,
                   "img_per_s": trained * args.batch_size / epoch_time,
                   "data_wait_frac": data_wait.seconds() / epoch_time}
        if accelerator.scaler is not None:  # AMP: fp16 only
            metrics.update(loss_scale=accelerator.scaler.get_scale(), skipped_steps=skipped.in_epoch)
        metrics.update(peak_memory(accelerator))  # GPUs: each process's peak this epoch
        progress.history.append(metrics)
        if accelerator.is_main_process:
            write_metrics(output_dir, progress.history)
        accelerator.print(log_line(metrics))
        track(accelerator, metrics, step=progress.step)
        saved = save_checkpoint(accelerator, output_dir, progress.step, args.keep_checkpoints)
        if guard.agree() and progress.step < stop_step:  # a stop signal in the last step or evaluation
            guard.stop(saved, progress.step)

    # ------------------------------------------------------------------------------- finish
    if accelerator.is_main_process:
        # unwrap_model strips DDP, save_weights the _orig_mod. of --compile: loads into a plain model,
        # and the metadata is all that scripts/evaluate.py needs besides the test images.
        save_weights(accelerator.unwrap_model(model), output_dir / "model.safetensors",
                     {"model": args.model, "step": progress.step, "channels_last": args.channels_last,
                      **{key: config[key] for key in EVALUATION if key in config}})
    final = progress.history[-1] if progress.history else None
    accelerator.print(f"done: step {progress.step}, test_acc {final['test_acc']:.4f}" if final else "done",
                      f"- weights in {output_dir / 'model.safetensors'}")
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
