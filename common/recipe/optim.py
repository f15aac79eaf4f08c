"""Optimizer and learning-rate schedule: SGD with Nesterov momentum or AdamW, one-cycle or step
decay; ``optimizer_and_schedule`` makes both from the scripts' flags (the recipe)."""

import bisect
import math

import torch

from common.recipe.models import classifier_name

# --lr's default by --optimizer: SGD's from scratch (the articles' 0.1), AdamW's usual fine-tuning
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}


def optimizer_and_schedule(args, model, batches: int):
    """The optimizer at its peak lr and the schedule over the run's optimizer steps, for an epoch
    of ``batches`` micro-batches: with the peak lr, the steps per epoch and in all. --batch-size is
    the global batch in every script, so the recipe does not change with the number of devices."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]  # --optimizer's default
    # Linear scaling rule (Goyal et al. 2017, arXiv:1706.02677): k times the batch, k times the lr.
    peak_lr = lr * args.batch_size / args.reference_batch_size if args.scale_lr else lr
    optimizer = build_optimizer(model, peak_lr, args.momentum, args.weight_decay, args.optimizer,
                                args.head_lr_scale)  # --head-lr-scale: the classifier's lr
    steps_per_epoch = batches // args.grad_accum  # optimizer steps, of micro-batches
    total_steps = steps_per_epoch * args.epochs
    scheduler = build_scheduler(optimizer, args.schedule, total_steps, steps_per_epoch,
                                args.warmup_epochs, args.milestones)
    return optimizer, scheduler, peak_lr, steps_per_epoch, total_steps


def build_optimizer(model: torch.nn.Module, lr: float, momentum: float, weight_decay: float,
                    kind: str = "sgd", head_lr_scale: float = 1.0):
    """SGD (Nesterov) or AdamW over the trainable parameters (a frozen backbone's are left out), in
    groups: weight decay for the weights only, none for norm and bias parameters (every tensor of
    one dimension, as timm and the ViT recipes do); the classifier at ``head_lr_scale`` x ``lr``.
    Each group keeps its scale as "lr_scale", which the schedule and set_peak_lr read."""
    head = f"{classifier_name(model)}." if head_lr_scale != 1 else None
    groups = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            scale = head_lr_scale if head and name.startswith(head) else 1.0
            decay = weight_decay if parameter.ndim > 1 else 0.0
            groups.setdefault((scale, decay), []).append(parameter)
    # The groups at the base lr first: the scripts log group 0's lr as the run's lr.
    param_groups = [{"params": params, "lr": lr * scale, "lr_scale": scale, "weight_decay": decay}
                    for (scale, decay), params in sorted(groups.items(),
                                                         key=lambda item: item[0][0] != 1.0)]
    return (torch.optim.AdamW(param_groups, lr=lr) if kind == "adamw"
            else torch.optim.SGD(param_groups, lr=lr, momentum=momentum, nesterov=True))


def build_scheduler(optimizer, schedule: str, total_steps: int, steps_per_epoch: int,
                    warmup_epochs: float, milestones=(), gamma: float = 0.1):
    """A schedule stepped once per optimizer step.

    onecycle: torch's OneCycleLR (Smith & Topin 2017) with anneal_strategy="cos", which anneals
    both phases along a cosine: up from lr/25 over the warm-up, then down to lr/250,000. Momentum
    is not cycled, so --momentum keeps its meaning.
    step: linear warm-up, then the lr times ``gamma`` after each milestone epoch (the articles'
    recipe: 0.1, divided by 10 after epochs 4, 9 and 14).
    """
    # A warm-up as long as the run leaves one step of decay: OneCycleLR needs both phases.
    warmup_steps = min(round(warmup_epochs * steps_per_epoch), total_steps - 1)
    if schedule == "onecycle":  # OneCycleLR divides by the warm-up's length - 1: none, not 1
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=total_steps, anneal_strategy="cos", cycle_momentum=False,
            pct_start=(0 if warmup_steps == 1 else warmup_steps) / total_steps)
    milestone_steps = sorted(m * steps_per_epoch for m in milestones)

    def factor(step: int) -> float:
        warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        return warmup * gamma ** bisect.bisect_right(milestone_steps, step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_peak_lr(optimizer, scheduler, peak_lr: float, say=print) -> None:
    """Give a schedule loaded from a checkpoint the peak ``peak_lr``: --resume may lower --lr, as
    the advice after a diverged run says. Every lr the schedule derives from its peak (the warm-up's
    start, the floor of the decay, the current one) scales with it, and the schedule goes on from
    the step it was at; ``say`` tells the change, in one line. Nothing changes for a new run."""
    group = optimizer.param_groups[0]
    # OneCycleLR's peak or LambdaLR's base lr, over the group's share of it (--head-lr-scale)
    old = group.get("max_lr", group["initial_lr"]) / group.get("lr_scale", 1.0)
    if math.isclose(old, peak_lr, rel_tol=1e-9):
        return
    factor = peak_lr / old
    for group in optimizer.param_groups:
        for key in group.keys() & {"lr", "initial_lr", "max_lr", "min_lr"}:
            group[key] *= factor
    inner = getattr(scheduler, "scheduler", scheduler)  # the one that Accelerate's wrapper steps
    inner.base_lrs = [lr * factor for lr in inner.base_lrs]
    inner._last_lr = [lr * factor for lr in inner.get_last_lr()]  # what get_last_lr() reads
    say(f"--lr changed on resume: the schedule's peak lr is {peak_lr:g} (it was {old:g}), every "
        f"lr of it scaled by {factor:g} from this step on")
