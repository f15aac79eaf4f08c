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

No --compile (the replicas are new copies of the model at every step) and no mixed precision:
Accelerate's autocast is bound to the model that prepare() saw, which every replica would call, so
DataParallel needs autocast inside each replica's thread and a hand-driven GradScaler, a second way
to teach AMP; scripts/train_amp.py teaches it once, on DDP.

Pitfalls: BatchNorm normalises each GPU's slice on its own, and its running statistics come from
GPU 0's slice only (the other replicas are dropped after forward). A state_dict() taken from the
DataParallel wrapper has `module.` in front of every key and does not load into a plain model
(common.checkpoint.load_weights strips it); this script saves the unwrapped model.

Launch:
    python scripts/train_dp.py                                  # every visible GPU
    CUDA_VISIBLE_DEVICES=0,1 python scripts/train_dp.py --batch-size 256 --loss-in-replicas
    python scripts/train_dp.py --dataset synthetic --model resnet20   # a CPU: one device, no split
It is one process: `accelerate launch --num_processes 1` works too, more processes are refused.
Resume: the same command plus --output-dir runs/train_dp-... --resume.
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
from common.errors import UserError
from common.evaluation import evaluate
from common.inputs import load_inputs
from common.models import build_model
from common.optim import build_optimizer, build_scheduler
from common.parallel import (
    StepGuard,
    check_batch_split,
    check_peer_copies,
    data_parallel_devices,
    memory_report,
    require_single_process,
    set_numerics,
)
from common.tracking import DataWait, StepLogger, log_line, start_tracking, track

SCRIPT = Path(__file__).stem
EVALUATION = ("classes", "image_size", "normalization", "mixed_precision", "eval_split")  # into model.safetensors
RESUMABLE = RESUMABLE_FLAGS  # the flags that --resume lets change


def parse_args(argv=None):
    parser = build_parser(__doc__)
    parser.add_argument("--loss-in-replicas", action="store_true",  # DP: the articles' parallel criterion
                        help="compute each GPU's loss on that GPU: GPU 0 gathers one loss per GPU, not every output")
    args = parser.parse_args(argv)
    check_args(args)
    return args


class Replica(torch.nn.Module):  # DP: what DataParallel copies to each GPU and runs in a thread per GPU
    """The model and, given labels, the loss of this GPU's slice of the batch (--loss-in-replicas)."""

    def __init__(self, model, criterion):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, images, labels=None):
        outputs = self.model(images)  # DP: a 1-element loss: GPU 0 gathers one per GPU, not every output
        return outputs if labels is None else self.criterion(outputs, labels).unsqueeze(0)


def main(args):
    # ----------------------------------------------------------------------------------- setup
    require_single_process(__file__)
    if args.compile:  # DP: the replicas are new copies of the model at every step, outside any compiled graph
        raise UserError(f"--compile {args.compile}: not offered with DataParallel: use train_ddp.py --compile")
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
    devices = data_parallel_devices(accelerator.device)  # DP: every visible GPU (CUDA_VISIBLE_DEVICES)
    if len(devices) > 1:  # DP: equal slices, and copies between GPUs that arrive intact
        check_batch_split(args.batch_size, len(devices), "visible GPUs", args.grad_accum)
        check_peer_copies(devices)
    per_device_batch = args.batch_size // args.grad_accum // max(len(devices), 1)  # DP: the slice of each GPU
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
    parallel_model = Replica(model, criterion)  # DP: after prepare: save_state keeps the model, no module. prefix
    if devices:  # DP: gathers on devices[0]; on a CPU (or --cpu) there is nothing to split
        parallel_model = torch.nn.DataParallel(parallel_model, device_ids=devices)

    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    config = run_config(vars(args), {
        "world_size": accelerator.num_processes, "device": str(device), "fp32_precision": fp32,
        "gpus": [str(d) for d in devices],  # DP: the GPUs DataParallel splits over
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
    accelerator.print(f"{SCRIPT}: {args.model} on {', '.join(map(str, devices)) or device}, "  # DP: every GPU
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
                loss = (parallel_model(images, labels).mean() if args.loss_in_replicas  # DP: one loss per GPU
                        else criterion(parallel_model(images), labels))  # DP: from the outputs gathered on GPU 0
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
        result = evaluate(parallel_model, test_loader, transform, accelerator, len(data.classes))  # DP: all GPUs
        metrics = {"epoch": epoch + 1, "epochs": args.epochs, "epoch_complete": epoch_complete,
                   "step": progress.step, "batch_size": args.batch_size, "lr": lr, "train_loss": train_loss,
                   "test_acc": result.accuracy, "test_images": result.total, "epoch_time_s": epoch_time,
                   "img_per_s": trained * args.batch_size / epoch_time,
                   "data_wait_frac": data_wait.seconds() / epoch_time}
        metrics.update(memory_report(devices))  # DP: one value per GPU; GPU 0 holds more
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
