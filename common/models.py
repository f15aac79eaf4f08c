"""Image classifiers for 32x32 inputs, built by name: ``build_model(args.model, num_classes)``.

- ``resnet18``, ``resnet34``, ``resnet50``: torchvision's ResNets with the CIFAR stem (3x3 stride-1
  first convolution, no max pool), as in kuangliu/pytorch-cifar ``models/resnet.py``.
- ``resnet20``, ``resnet32``, ``resnet56``: the CIFAR ResNets of He et al., "Deep Residual Learning
  for Image Recognition" (arXiv:1512.03385), section 4.2: 0.27 M, 0.46 M, 0.85 M parameters.
- ``torchvision:NAME``: any torchvision classification model, unchanged (ImageNet stem), e.g.
  ``torchvision:resnet50``, the ResNet-50 that multi-GPU benchmarks on CIFAR-10 often train as is.
  Some accept only their ImageNet resolution (the ViTs fail on 32x32 at the first forward).

Weights are always random (``weights=None``): nothing is downloaded.
"""

import difflib

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from common.errors import UserError

TORCHVISION_PREFIX = "torchvision:"
_CIFAR_STEM = {"resnet18": torchvision.models.resnet18, "resnet34": torchvision.models.resnet34,
               "resnet50": torchvision.models.resnet50}
_BLOCKS_PER_STAGE = {"resnet20": 3, "resnet32": 5, "resnet56": 9}  # depth = 6n + 2 (He et al. 4.2)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus the option-A shortcut: identity, or on downsampling every second
    pixel with the new channels zero-filled, so the shortcut has no parameters (He et al. 3.3,
    4.2)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride, self.extra_channels = stride, out_channels - in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = x
        if self.stride > 1 or self.extra_channels:
            subsampled = x[:, :, :: self.stride, :: self.stride]
            # F.pad's pairs run from the last dimension back (W, H, C): zero channels go at the end.
            shortcut = F.pad(subsampled, (0, 0, 0, 0, 0, self.extra_channels))
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """3x3 conv (16 channels), three stages of n blocks at 16/32/64 channels on 32/16/8 pixel maps,
    global average pool, linear: 6n + 2 weighted layers."""

    def __init__(self, blocks_per_stage: int, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, in_channels = [], 16
        for out_channels, stride in [(16, 1), (32, 2), (64, 2)]:
            blocks = []
            for i in range(blocks_per_stage):
                blocks.append(BasicBlock(in_channels, out_channels, stride if i == 0 else 1))
                in_channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # He et al. use the init of their arXiv:1502.01852
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _with_cifar_stem(model: torchvision.models.ResNet) -> torchvision.models.ResNet:
    # The ImageNet stem (7x7 stride 2, then max pool) shrinks 32x32 to 8x8 before the first block,
    # leaving 1x1 maps in the last stage; the CIFAR stem keeps 32x32 (kuangliu/pytorch-cifar).
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    # The same init torchvision's ResNet gives every other convolution.
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def model_names() -> list[str]:
    """Our names; ``--model`` also takes ``torchvision:NAME``."""
    return [*_CIFAR_STEM, *_BLOCKS_PER_STAGE]


def build_model(name: str, num_classes: int) -> nn.Module:
    """A randomly initialised, unwrapped module: (B, 3, 32, 32) images to (B, num_classes)
    logits."""
    if name in _CIFAR_STEM:
        return _with_cifar_stem(_CIFAR_STEM[name](weights=None, num_classes=num_classes))
    if name in _BLOCKS_PER_STAGE:
        return CifarResNet(_BLOCKS_PER_STAGE[name], num_classes)
    rule = "NAME is any of torchvision.models.list_models(module=torchvision.models)"
    if name.startswith(TORCHVISION_PREFIX):
        tv_name = name.removeprefix(TORCHVISION_PREFIX)
        # module= keeps classification models only (no detection, segmentation, video).
        tv_names = torchvision.models.list_models(module=torchvision.models)
        if tv_name not in tv_names:
            close = difflib.get_close_matches(tv_name, tv_names, n=5)
            hint = f"closest: {', '.join(close)}" if close else "e.g. resnet50, mobilenet_v3_small"
            raise UserError(f"unknown torchvision model {tv_name!r} in --model {name!r} "
                            f"({hint}); {rule}")
        return torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes)
    raise UserError(f"unknown model {name!r}: choose one of {', '.join(model_names())}, "
                    f"or torchvision:NAME (e.g. torchvision:resnet50) where {rule}")
