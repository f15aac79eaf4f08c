"""Image classifiers built by name: ``build_model(args.model, num_classes, data.image_size)``.

- ``resnet18``, ``resnet34``, ``resnet50``: torchvision's ResNets with the CIFAR stem (3x3 stride-1
  first convolution, no max pool), as in kuangliu/pytorch-cifar ``models/resnet.py``.
- ``resnet20``, ``resnet32``, ``resnet56``: the CIFAR ResNets of He et al., "Deep Residual Learning
  for Image Recognition" (arXiv:1512.03385), section 4.2: 0.27 M, 0.46 M, 0.85 M parameters.
- ``torchvision:NAME``: any torchvision classification model with its ImageNet stem, e.g.
  ``torchvision:resnet50``, the ResNet-50 that multi-GPU benchmarks on CIFAR-10 often train as is;
  googlenet and inception_v3 without their auxiliary classifiers. One that cannot take the data's
  image size (the ViTs take 224 px only, inception_v3 75 px and more) is refused when built, with
  the size it needs, before a run writes anything.
- ``timm:NAME``: any timm model (``timm.list_models()``), e.g. ``timm:resnet50`` or, with a
  pretrained tag, ``timm:resnet50.a1_in1k``: the ImageNet-stem models people fine-tune.

Our own models take any size from 8 px (global average pooling before the classifier). Weights are
always random here: pretrained ones are loaded by common.data.pretrained, from their file.
"""

import copy
import difflib
import itertools
import warnings

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from common.errors import UserError, first_line

TORCHVISION_PREFIX = "torchvision:"
TIMM_PREFIX = "timm:"
_CIFAR_STEM = ("resnet18", "resnet34", "resnet50")  # torchvision's, with another stem
_BLOCKS_PER_STAGE = {"resnet20": 3, "resnet32": 5, "resnet56": 9}  # depth = 6n + 2 (He et al. 4.2)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus the option-A shortcut: identity, or on downsampling every second
    pixel with the new channels zero-filled, so it has no parameters (He et al. 3.3, 4.2)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride, self.extra_channels = stride, out_channels - in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        if self.stride > 1 or self.extra_channels:  # the shortcut: x, subsampled and padded
            # F.pad's pairs run from the last dimension back (W, H, C): zero channels go at the end.
            x = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.extra_channels))
        return F.relu(out + x)


class CifarResNet(nn.Module):
    """3x3 conv (16 channels), three stages of n blocks at 16/32/64 channels on 32/16/8 pixel maps,
    global average pool, linear: 6n + 2 weighted layers."""

    def __init__(self, blocks_per_stage: int, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)

        def stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
            return nn.Sequential(BasicBlock(in_channels, out_channels, stride),
                                 *(BasicBlock(out_channels, out_channels, 1)
                                   for _ in range(blocks_per_stage - 1)))
        self.layer1, self.layer2, self.layer3 = stage(16, 16, 1), stage(16, 32, 2), stage(32, 64, 2)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # He et al. use the init of their arXiv:1502.01852
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def model_names() -> list[str]:
    """Our names; ``--model`` also takes ``torchvision:NAME`` and ``timm:NAME``."""
    return [*_CIFAR_STEM, *_BLOCKS_PER_STAGE]


def check_model_name(name: str) -> None:
    """An unknown --model stops now, not after the data is loaded: one line with the closest
    names, or the ones it takes."""
    if name in model_names():
        return
    rule = "NAME is any of torchvision.models.list_models(module=torchvision.models)"
    if name.startswith(TORCHVISION_PREFIX):
        tv_name = name.removeprefix(TORCHVISION_PREFIX)
        tv_names = torchvision.models.list_models(module=torchvision.models)  # classifiers only
        if tv_name not in tv_names:
            close = difflib.get_close_matches(tv_name, tv_names, n=5)
            hint = ("closest: " + ", ".join(TORCHVISION_PREFIX + match for match in close) if close
                    else "e.g. torchvision:resnet50, torchvision:mobilenet_v3_small")
            raise UserError(f"unknown torchvision model {tv_name!r} in --model {name!r} "
                            f"({hint}); {rule}")
    elif name.startswith(TIMM_PREFIX):
        check_timm_name(name, name.removeprefix(TIMM_PREFIX))
    else:
        raise UserError(f"unknown model {name!r}: choose one of {', '.join(model_names())}, "
                        f"torchvision:NAME (e.g. torchvision:resnet50) where {rule}, or timm:NAME "
                        f"(e.g. timm:resnet50) where NAME is any of timm.list_models()")


def build_model(name: str, num_classes: int, image_size: int | None = None) -> nn.Module:
    """A randomly initialised, unwrapped module: (B, 3, N, N) images to (B, num_classes) logits.
    An unknown ``name`` (check_model_name), and a torchvision or timm model that cannot take
    ``image_size`` (N; None: not checked), is a UserError naming what it takes."""
    check_model_name(name)
    if name in _CIFAR_STEM:
        model = _torchvision_model(name, num_classes)
        # The ImageNet stem (7x7 stride 2, then max pool) shrinks 32x32 to 8x8 before the first
        # block, 1x1 maps in the last stage; the CIFAR stem keeps 32x32 (kuangliu/pytorch-cifar).
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        # The same init torchvision's ResNet gives every other convolution.
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
        return model
    if name in _BLOCKS_PER_STAGE:
        return CifarResNet(_BLOCKS_PER_STAGE[name], num_classes)
    if name.startswith(TORCHVISION_PREFIX):
        model = _torchvision_model(name.removeprefix(TORCHVISION_PREFIX), num_classes)
    else:
        import timm  # imported by the runs that use it only: it takes a second

        model = timm.create_model(name.removeprefix(TIMM_PREFIX), pretrained=False,
                                  num_classes=num_classes)
    if image_size is not None:
        _check_image_size(_shapes_only(model), name, num_classes, image_size)
    return model


def check_timm_name(name: str, timm_name: str) -> None:
    """A timm model timm knows, and its pretrained tag (NAME.TAG) one of that model's: an unknown
    tag passes timm.is_model and fails only in create_model (a RuntimeError)."""
    import timm

    if not timm.is_model(timm_name):
        close = difflib.get_close_matches(timm_name, timm.list_models(), n=5)
        hint = (f"closest: {', '.join(TIMM_PREFIX + match for match in close)}" if close
                else f"e.g. {TIMM_PREFIX}resnet50, {TIMM_PREFIX}convnext_tiny")
        raise UserError(f"unknown timm model {timm_name!r} in --model {name!r} ({hint}); NAME "
                        f"is any of timm.list_models(), with or without a pretrained tag")
    arch, _, tag = timm_name.partition(".")
    tags = [known.partition(".")[2] for known in timm.list_pretrained(f"{arch}.*")]
    if tag and tag not in tags:
        raise UserError(f"--model {name!r}: timm has no pretrained tag {tag!r} for {arch} "
                        f"({'its tags: ' + ', '.join(tags[:8]) if tags else 'it has none'}); "
                        f"pass --model {TIMM_PREFIX}{arch}" + (f".{tags[0]}" if tags else ""))


def classifier_name(model: nn.Module, num_classes: int | None = None) -> str:
    """The qualified name of ``model``'s classifier (its head): timm's own (get_classifier), else
    the last Linear or convolution module with ``num_classes`` outputs, any number when None (our
    ResNets' and torchvision's ResNets' ``fc``, ``classifier.1``, ``heads.head`` ...; the last
    convolution of a model without a Linear layer)."""
    names = {id(module): name for name, module in model.named_modules()}
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier) and id(get_classifier()) in names:
        return names[id(get_classifier())]
    heads = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and num_classes in (None, module.out_features)
             or isinstance(module, nn.Conv2d) and num_classes == module.out_channels]
    if not heads and num_classes is None:  # a convolution head (squeezenet's classifier.1)
        heads = [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)]
    if not heads:
        raise UserError(f"found no classifier with {num_classes} outputs in the model: it cannot "
                        f"be fine-tuned here")
    return heads[-1]


def _torchvision_model(tv_name: str, num_classes: int) -> nn.Module:
    with warnings.catch_warnings():
        # googlenet and inception_v3 warn that their default init will change; it is the one
        # they are trained with, and init_weights=True, which silences it, is theirs only.
        warnings.filterwarnings("ignore", message="The default weight initialization")
        model = torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes)
        if getattr(model, "aux_logits", False):
            # googlenet and inception_v3 return (logits, auxiliary logits) in training mode: the
            # extra heads helped their ImageNet training from scratch (Szegedy et al. 2015, 2016),
            # but a training loop takes logits. Without pretrained weights they can be left out.
            model = torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes,
                                                 aux_logits=False)
    return model


def _shapes_only(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device: its modules, no data. A forward there computes
    shapes only, in milliseconds at any size, and leaves the model and the random number generator
    alone (a 1-image forward on the CPU takes seconds at 224 px for the larger models)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        is_parameter = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if is_parameter else meta
    return copy.deepcopy(model, memo)


# torchvision's classifiers are made for ImageNet's 224 px: every one takes it (inception_v3, made
# for 299, too), so the sizes a model needs are looked for below it.
REFERENCE_SIZE = 224


def _check_image_size(probe: nn.Module, name: str, num_classes: int, size: int) -> None:
    """Refuse ``size`` x ``size`` images if ``probe`` (on the meta device) cannot train on them,
    naming the size it needs: found by trying sizes, not from a table of models, so that a model
    torchvision adds is covered too."""
    if (why := _cannot_train(probe, num_classes, size)) is None:
        return
    if _cannot_train(probe, num_classes, REFERENCE_SIZE) is not None:
        raise UserError(f"--model {name} cannot take {size}x{size} images ({why}); try "
                        f"another --image-size or --model")
    # By bisection around the reference size: models of a range of sizes (inception_v3, alexnet,
    # convnext ...) fail on too small an input, those made for one (the ViTs, maxvit) on any other.
    smallest = _bisect(probe, num_classes, 7, REFERENCE_SIZE)
    largest = (_bisect(probe, num_classes, REFERENCE_SIZE, 2 * REFERENCE_SIZE) - 1
               if _cannot_train(probe, num_classes, 2 * REFERENCE_SIZE) else None)
    what, fix = f"takes {REFERENCE_SIZE}x{REFERENCE_SIZE} images", f"{REFERENCE_SIZE}"
    if smallest == largest:
        what, fix = f"takes {smallest}x{smallest} images only", f"{smallest}"
    elif largest is not None:  # the reference size is among them
        what = f"takes images from {smallest}x{smallest} to {largest}x{largest} only"
    elif size < smallest:
        what, fix = f"needs images of at least {smallest}x{smallest}", f"{smallest} or more"
    raise UserError(f"--model {name} {what}, not {size}x{size} ({why}); pass --image-size {fix}")


def _bisect(probe: nn.Module, num_classes: int, low: int, high: int) -> int:
    """The size between ``low`` and ``high`` where the model's verdict changes: the first taken
    after refused ones, or the first refused after taken ones."""
    taken_high = _cannot_train(probe, num_classes, high) is None
    while high - low > 1:
        middle = (low + high) // 2
        same = (_cannot_train(probe, num_classes, middle) is None) == taken_high
        low, high = (low, middle) if same else (middle, high)
    return high


def _cannot_train(probe: nn.Module, num_classes: int, size: int) -> str | None:
    """Why a training forward of two size x size images fails, in a few words, or None. On the
    meta device only shapes are computed: the same errors as on a real device, for free."""
    try:
        with torch.no_grad():
            out = probe.train()(torch.zeros(2, 3, size, size, device="meta"))
    except NotImplementedError:  # an operator with no meta kernel: nothing known, let it train
        return None
    except Exception as e:  # whatever the model raises: a size check, a convolution, a reshape
        why = first_line(e)
        return why if len(why) <= 90 else f"{why[:87]}..."
    if not isinstance(out, torch.Tensor):
        return f"it returns {type(out).__name__}, not logits, in training mode"
    if out.shape != (2, num_classes):
        return f"its output has the shape {tuple(out.shape)}, not (2, {num_classes})"
    return None
