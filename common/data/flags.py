"""The data flags: where the images come from (training and evaluate.py alike) and how training
batches are augmented; DataOptions made from them (data_options)."""

import argparse
import dataclasses
import math

from common.data.options import DataOptions
from common.data.sources import check_dataset_name
from common.data.synthetic import check_synthetic_size
from common.errors import UserError
from common.files import check_folder

AUTO_AUGMENT = ("none", "randaugment", "trivialaugment")


def add_data_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="cifar10", help="cifar10/cifar100 (uoft-cs/... on the "
                      "Hugging Face Hub), any Hub image classification dataset id (owner/name) "
                      "with an image and a label column, or synthetic: made on the spot, no "
                      "download, suits a CPU (default: %(default)s)")
    data.add_argument("--data-dir", default=None, help="read the data from this folder or archive "
                      "instead of the Hub: a Hub snapshot (*.parquet), a save_to_disk folder, "
                      "cifar-10-batches-py (or its .tar.gz), or an image folder train/<class>/* "
                      "with test/<class>/* (or val/, validation/)")
    data.add_argument("--val-fraction", type=float, default=None, metavar="F", help="evaluate on "
                      "this share of the training images, drawn per class with --seed, and train "
                      "on the rest, for data with no labelled test or validation split (default: "
                      "the data's own test split, else its validation split)")
    data.add_argument("--image-size", type=int, default=None, metavar="N",
                      help="training and evaluation resolution N x N: images are resized "
                           "(shorter side) and centre-cropped to N, training ones then cropped at "
                           "random (see --augment) (default: the images' own size when they share "
                           "one square size, as CIFAR's 32, else 224)")
    data.add_argument("--loader", default="auto", choices=("auto", "device", "workers"),
                      help="device: decode every image once and keep them on the training device "
                           "(fastest, if they fit); workers: DataLoader workers decode and augment "
                           "each batch (any size); auto: device when the decoded images fit "
                           "--loader-budget (default: %(default)s)")
    data.add_argument("--workers", type=int, default=None, metavar="N", help="DataLoader worker "
                      "processes per training process for --loader workers (default: the CPU cores "
                      "shared among the node's processes, less one, at most 16)")
    data.add_argument("--loader-budget", type=float, default=None, metavar="GB", help="the most "
                      "the decoded images may take for --loader device/auto (default: half the "
                      "free memory of the GPU and of the host, whichever is less)")
    data.add_argument("--bad-images", default="stop", choices=("stop", "skip"),
                      help="an image that cannot be decoded stops the run with its name (stop), "
                           "or is reported and left out (skip) (default: %(default)s)")
    data.add_argument("--cache-dir", default=None,
                      help="where decoded uint8 tensors (and parquet converted to Arrow) are "
                           "cached (default: $CIFAR_CACHE_DIR or ~/.cache/multigpu-cifar)")
    data.add_argument("--synthetic-train-size", type=int, default=5000,
                      help="images in the synthetic training split (default: %(default)s)")
    data.add_argument("--synthetic-test-size", type=int, default=1000,
                      help="images in the synthetic test split (default: %(default)s)")


def check_data_args(args: argparse.Namespace) -> None:
    """The data flags' values argparse cannot check, for training and evaluation alike."""
    check_dataset_name(args.dataset)
    if args.image_size is not None and not 8 <= args.image_size <= 4096:
        raise UserError(f"--image-size {args.image_size}: must be from 8 to 4096 pixels")
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers {args.workers}: must be 0 (load in the training process) or "
                        f"more")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction {args.val_fraction}: must be between 0 and 1, e.g. 0.1")
    if args.loader_budget is not None and not 0 <= args.loader_budget < math.inf:
        raise UserError(f"--loader-budget {args.loader_budget}: must be a number of GB, 0 or more")
    for dest, meant, refused in (("workers", "workers", "device"),
                                 ("loader_budget", "device or auto", "workers")):
        if (value := getattr(args, dest)) is not None and args.loader == refused:
            raise UserError(f"--{dest.replace('_', '-')} {value} is for --loader {meant}, not "
                            f"--loader {refused}: drop one of them")
    for flag in ("synthetic_train_size", "synthetic_test_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be 1 or more")
    if args.dataset == "synthetic":
        check_synthetic_size(args.synthetic_train_size, args.synthetic_test_size, args.image_size)
    check_folder("--cache-dir", args.cache_dir)


def add_augment_args(parser: argparse.ArgumentParser) -> None:
    """How training batches are augmented (training scripts only)."""
    augment = parser.add_argument_group("augmentation")
    augment.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True,
                         help="random crop and horizontal flip of training images: up to 64px "
                              "padded by 4 and cropped, above 64px random-resized crops, with "
                              "either --loader (default: on)")
    augment.add_argument("--auto-augment", default="none", choices=AUTO_AUGMENT, help="RandAugment "
                         "or TrivialAugmentWide (torchvision), one policy drawn per image in the "
                         "DataLoader workers: needs --loader workers (default: %(default)s)")
    augment.add_argument("--random-erase", type=float, default=0.0, metavar="P", help="erase a "
                         "random rectangle of each training image with probability P, as "
                         "torchvision's RandomErasing, after the normalisation (default: 0)")
    augment.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA", help="MixUp: each "
                         "batch blended with itself in another order, by a share drawn from "
                         "Beta(ALPHA, ALPHA), the labels likewise, e.g. 0.2 (default: 0, off)")
    augment.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA",
                         help="CutMix: a rectangle of another image of the batch pasted in, the "
                              "labels mixed by its area, e.g. 1.0; with --mixup, one of the two "
                              "per batch (default: 0, off)")


def check_augment_args(args: argparse.Namespace) -> None:
    """The augmentation flags' values and combinations argparse cannot check."""
    if not 0 <= args.random_erase <= 1:
        raise UserError(f"--random-erase {args.random_erase}: must be a probability from 0 to 1, "
                        f"e.g. 0.25")
    for flag in ("mixup", "cutmix"):
        if not 0 <= getattr(args, flag) < math.inf:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be 0 (off) or a positive alpha "
                            f"of the Beta distribution, e.g. {0.2 if flag == 'mixup' else 1.0}")
    if args.auto_augment != "none" and args.loader != "workers":
        raise UserError(f"--auto-augment {args.auto_augment} draws one policy per image, in the "
                        f"DataLoader workers: add --loader workers (on a batch tensor torchvision "
                        f"applies one operation to every image)")


def data_options(args: argparse.Namespace, weights=None) -> DataOptions:
    """What the input path needs of the parsed flags, each field of DataOptions that ``args`` has:
    common.data.inputs.load_inputs(data_options(args), accelerator). With pretrained ``weights``
    (common.data.pretrained.Weights), their mean and std, their interpolation
    (Weights.resize_interpolation), and their input size unless --image-size is given."""
    flags = {field.name: getattr(args, field.name) for field in dataclasses.fields(DataOptions)
             if hasattr(args, field.name)}
    if weights is None:
        return DataOptions(**flags)
    return DataOptions(**{**flags, "image_size": args.image_size or weights.input_size,
                          "normalization": weights.normalization,
                          "interpolation": weights.resize_interpolation})
