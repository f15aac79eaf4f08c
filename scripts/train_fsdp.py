"""Sharded data parallelism (FSDP2) through Accelerate: train_ddp.py + FSDP2.

DDP keeps a whole copy of the weights, their gradients and the optimizer's state on every GPU.
FSDP2 (torch's fully_shard) cuts each of them into one slice per process: a process holds 1/N of
them, gathers a residual block's full weights just before the block runs (forward and backward)
and frees them after it, and reduce-scatters the gradients so that each process steps its own
slice. What does not fit one GPU under DDP then fits N. The price: an all-gather of the weights
in the forward and again in the backward, and a reduce-scatter, about 1.5x DDP's traffic, so on a
model that fits (ResNet-18 fits any GPU many times over) DDP is faster. Changes from train_ddp.py,
each tagged "# FSDP:" (docs/diffs/train_fsdp.diff):

- Accelerate's FSDP plugin (fsdp_version=2), one unit per residual block (BasicBlock, Bottleneck,
  ...: common/parallel/fsdp.py): the default, one unit for the whole model, gathers it whole
  and saves no memory. Sharded checkpoints: each process writes its slice (pytorch_model_fsdp_0/,
  optimizer_0/), --resume reads them back, their pickles (DCP's) read as data first;
- --compile auto trains eagerly: a model sharded for its size is not bound by kernel launches,
  and CUDA graphs around FSDP2's hooks are not proven;
- a refusal where it would not shard: without GPUs Accelerate drops the plugin without a word and
  runs DDP (and `accelerate launch --cpu --use_fsdp` is refused), so this script says so in one
  line instead. --sync-bn is refused too (train_ddp.py's), and --share-gpus over gloo on GPUs
  (processes sharing a GPU over NCCL only: over gloo FSDP2's CUDA collectives crashed);
- the optimizer built from the plain model and prepared with it in one call (Accelerate swaps its
  parameters for the shards); the same seed on every process before the model is built, since
  FSDP2 does not broadcast rank 0's initial weights (train_ddp.py seeds the same way);
- BatchNorm's running statistics averaged over the processes after every step: FSDP2 shards
  parameters only and, unlike DDP, never syncs buffers. --ema-decay averages each process's slice
  of the weights, gathered whole into the checkpoints;
- model.safetensors from the full weights, gathered from every process (a collective), so
  evaluate.py reads it as any other script's. Objects registered for checkpointing (the run's
  progress) are written by the main process only: they are the same on every process here;
- where sharding happens, said at the line: prepare() shards the model, accumulate() holds the
  gradients' reduce-scatter back on all but the last micro-batch of a step.

Every call marked "# ALL" is a collective or makes one, as in train_ddp.py; under FSDP2 the
forward (all-gathers) and backward (reduce-scatters) too: every process must make them in order.

fp32 only, like train_ddp.py. Mixed precision under FSDP2 needs fp32 parameters and reduction
(a bf16 parameter policy breaks BatchNorm) and an autocast around the forward and the loss, which
Accelerate's FSDP2 path does not add: docs/usage.md, "Sharded training (FSDP2)".

Launch (GPUs only; --num_processes overrides the config's count):
    accelerate launch --config_file accelerate_configs/4gpu_fsdp.yaml scripts/train_fsdp.py \
        --model resnet50
    torchrun --nproc_per_node 4 scripts/train_fsdp.py --model resnet50
Resume: the same command plus --output-dir runs/train_fsdp-... --resume.
"""

import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
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
from common.parallel.fsdp import average_buffers, check_sharding, gathered_model, wrap_each_block
from common.parallel.fsdp import ShardedWeightAverage, code_in_shards, refuse_gloo
from common.parallel.launch import check_launch, launch_record, set_gpu_sharing
from common.parallel.step_guard import StepGuard, announce_stop
from common.recipe.compiling import set_up_compiling
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
    args = parser.parse_args(argv)
    check_args(args)
    return args


def set_up(args) -> Accelerator:
    """This process made ready to train: output that cannot stop it, the Accelerator, the seed."""
    survive_closed_output()  # a closed stdout (| head, a dead tee, a lost ssh) costs no training
    gc.freeze()  # what the imports built lives to the end: the collector skips it (1 s at exit)
    backend = set_gpu_sharing(args.share_gpus, refuse_gloo)  # FSDP: GPUs shared over NCCL only
    accelerator = Accelerator(  # ALL: where several processes make their process group
        log_with=installed_trackers(args.report_to),  # --report-to; main process only
        cpu=not torch.cuda.is_available(),  # DDP: else no GPU means N lone trainings, not gloo
        mixed_precision="no",  # the fp32 baseline, whatever the Accelerate config says
        dynamo_plugin=set_up_compiling(args, model_is="shards"),  # FSDP: auto keeps it eager
        gradient_accumulation_steps=args.grad_accum,  # --grad-accum: accumulate() counts them
        dataloader_config=DataLoaderConfiguration(
            # A seeded sampler reshuffles by epoch number, so a resumed run sees the same order.
            use_seedable_sampler=True, data_seed=args.seed,
            non_blocking=True, split_batches=True),  # DDP: each process takes a slice
        # DDP: a process stalled in a collective for --dist-timeout seconds fails the job
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout),
                                                backend=backend)],  # None: NCCL on GPUs
        # FSDP: torch's fully_shard, per block (named below), a checkpoint as a slice per process
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            state_dict_type="SHARDED_STATE_DICT"),
    )
    # FSDP: every process the launcher started, equal slices of the batch (--sync-bn: refused)
    check_launch(accelerator, args.batch_size, args.grad_accum)  # ALL
    # FSDP: without GPUs Accelerate drops the plugin and runs DDP: one line instead
    refused_together(accelerator, check_sharding, accelerator, args.sync_bn)  # ALL
    set_seed(args.seed)  # the same on every process: the same initial weights
    return accelerator


def make_model(args, accelerator, data, weights):
    """--model for the data's classes and image size, with the pretrained ``weights`` if any: the
    model, and what fine-tuning records of them."""
    # refused if it cannot train at this size: one line, on every process at once
    model = refused_together(accelerator, build_model, args.model, data.num_classes,  # ALL
                             data.image_size)
    # FSDP: one unit per residual block (the default, one for the whole model, saves nothing)
    refused_together(accelerator, wrap_each_block, accelerator, model, args.model)  # ALL
    # FSDP: no channels_last weights (fully_shard refuses them): NHWC batches alone run NHWC convs
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
    # FSDP: fully_shard cuts the model here, each block a unit, a slice per process; the optimizer,
    # built from the plain model, in the same call: its parameters become the slices
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(  # ALL
        model, optimizer, train_loader, test_loader, scheduler)

    progress = TrainProgress(accelerator)  # the run's place and record, saved in every checkpoint
    ema = ShardedWeightAverage(accelerator, model, args.ema_decay)  # FSDP: of the slices (0: none)
    config = run_config(vars(args), {
        **launch_record(accelerator),  # the processes, their devices, the backend
        "fp32_precision": fp32, "per_device_batch_size": per_device_batch,
        "grad_accum": args.grad_accum, "global_batch_size": args.batch_size, "lr": peak_lr,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, **data.config,
        **tuned})
    # FSDP: a sharded checkpoint's pickles (DCP's) read as data before torch reads them
    resume_from(accelerator, checkpoint, progress, config, RESUMABLE, code_in_shards)  # ALL
    set_peak_lr(optimizer, scheduler, peak_lr, say=accelerator.print)  # a resume may lower --lr
    where = f"{accelerator.num_processes} x {accelerator.device}, sharded"  # FSDP: checked above
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
            # DDP: and from the process index, so the processes do not flip and crop alike.
            images = transform.train(images, (args.seed, micro_batch, accelerator.process_index))
            images, labels = data.mix(images, labels, micro_batch)  # --mixup, --cutmix: soft labels
            meter.wait.stop()
            # --grad-accum N: backward adds up the gradients of N micro-batches (each loss divided
            # by N); the optimizer, schedule and zero_grad act on the N-th only (sync_gradients).
            # FSDP: no reduce-scatter on the first N-1 micro-batches: whole gradients until the N-th
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
            # FSDP: BatchNorm's running statistics, which FSDP2 never syncs, averaged
            average_buffers(accelerator, model)  # ALL
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
                    accelerator.reduce(meter.loss_sum, "mean"))  # DDP: averaged over processes
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
    # FSDP: the full weights, gathered from every process's slices
    full = gathered_model(accelerator, model, args.model, data.num_classes)  # ALL
    weights = save_final_weights(accelerator, full, output_dir, config, progress.step)  # ALL
    accelerator.print(done_line(progress.step, progress.history, weights))  # what the file holds
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
