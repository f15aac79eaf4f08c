"""Train an image classifier on one device: the baseline every other script builds on.

One process, one device (the GPU if there is one, else the CPU), through Hugging Face Accelerate.
The other scripts are this file plus only what their strategy needs; read them as diffs
(docs/diffs/). What this one shows:

- data decoded once into uint8 tensors and augmented on the device, a whole batch at a time;
- SGD with Nesterov momentum and a one-cycle (default) or step learning-rate schedule, its peak
  scaled with the global batch (--scale-lr); optional gradient clipping (--clip-grad);
- channels_last memory format (--no-channels-last to turn it off);
- evaluation on the test split, one log line and one metrics.jsonl record per epoch;
- gradient accumulation (--grad-accum N) through accelerator.accumulate: N micro-batches per step;
- full training state saved every epoch with save_state, and --resume that continues bit for bit;
- SIGTERM or SIGUSR1 (SLURM, Kubernetes, the launcher) finishes the step, saves it and exits 75;
- final weights in model.safetensors, with what evaluation needs (model, classes, normalisation).

Launch:
    python scripts/train_single.py                       # CIFAR-10 from the Hub, ResNet-18, 15 epochs
    accelerate launch --num_processes 1 scripts/train_single.py --model resnet50
    python scripts/train_single.py --dataset synthetic --model resnet20 --epochs 4   # no download, CPU
    python scripts/train_single.py --schedule step --warmup-epochs 0  # the articles' recipe: lr 0.1, /10
                                                                      # after epochs 4, 9, 14
Resume a stopped run (same flags, plus):
    python scripts/train_single.py ... --output-dir runs/train_single-20260101-120000 --resume
"""

import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
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
from common.evaluation import evaluate
from common.inputs import load_inputs
from common.models import build_model
from common.optim import build_optimizer, build_scheduler
from common.parallel import (
    StepGuard,
    peak_memory,
    require_single_process,
    set_numerics,
)
from common.tracking import DataWait, StepLogger, log_line, start_tracking, track

SCRIPT = Path(__file__).stem
EVALUATION = ("classes", "image_size", "normalization", "mixed_precision", "eval_split")  # into model.safetensors
RESUMABLE = RESUMABLE_FLAGS  # the flags that --resume lets change


def parse_args(argv=None):
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def main(args):
    # ----------------------------------------------------------------------------------- setup
    require_single_process(__file__)
    accelerator = Accelerator(
        log_with=None if args.report_to == "none" else args.report_to,  # wandb, main process only
        mixed_precision="no",  # the fp32 baseline, whatever the Accelerate config says
        dynamo_backend=args.compile or "no",  # --compile: prepare() wraps the model in torch.compile
        gradient_accumulation_steps=args.grad_accum,  # --grad-accum: accumulate() counts the micro-batches
        # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed, non_blocking=True),
    )
    # TF32 where the GPU has it (--tf32), cuDNN's algorithm search, or --deterministic
    fp32 = set_numerics(accelerator.device, args.tf32, args.deterministic)
    per_device_batch = args.batch_size // args.grad_accum  # one device takes each whole micro-batch
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
    accelerator.print(f"{SCRIPT}: {args.model} on {device}, "
                      f"batch {args.batch_size} ({per_device_batch} per device"
                      f"{f' x {args.grad_accum} micro-batches' * (args.grad_accum > 1)}), lr {peak_lr:g}, "
                      f"fp32 math {fp32}{' (deterministic)' * args.deterministic}, "
                      f"{data.train_size} training images ({data.source}), {data.line}, {steps_per_epoch} steps/epoch, "
                      f"{total_steps} steps in all, record in {output_dir}")

    # ----------------------------------------------------------------------------------- train
    step_logger = StepLogger(accelerator, args.log_every, args.batch_size)
    data_wait, guard = DataWait(device), StepGuard(accelerator, output_dir)  # NaN loss, SIGTERM, SIGUSR1
    for epoch in range(progress.epoch, args.epochs):
        if progress.step >= stop_step:
            break
        model.train()
        train_loader.set_epoch(epoch)  # a new order each epoch, a function of the seed and the epoch
        # After a mid-epoch resume, start at the first batch this epoch has not trained on.
        batches = accelerator.skip_first_batches(train_loader, progress.batch_in_epoch * args.grad_accum) \
            if progress.batch_in_epoch else train_loader  # a new loader: the workers would start again
        loss_sum, step_loss, trained = torch.zeros((), device=device), 0, 0
        start = time.perf_counter()
        data_wait.start()
        for micro_batch, (images, labels) in enumerate(tqdm(
                batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, disable=not accelerator.is_main_process),
                start=progress.step * args.grad_accum):  # counted over the run
            # Augmentation drawn from (seed, micro-batch): a resumed run draws what the first run drew.
            images = transform.train(images, seed=(args.seed, micro_batch))
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
        train_loss = loss_sum.item() / trained
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
