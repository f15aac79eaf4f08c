"""Evaluate saved weights on the test split: overall and per-class accuracy.

A model.safetensors of our training scripts carries what evaluation needs besides the test images:
the model name, the class names, the normalisation of the training run, the input size and the
interpolation it resized with. So the weights and the data source are all it takes to reproduce the
accuracy the run logged:

    python scripts/evaluate.py --weights runs/train_single-20260101-120000/model.safetensors
    python scripts/evaluate.py --weights runs/.../model.safetensors --data-dir ~/data/cifar10

It also reads state dicts saved by other scripts with torch.save, including the ``module.`` prefix
that a DataParallel/DDP-wrapped model leaves on every key. They carry none of that, so name the
model; the normalisation is then computed from the training split of the data, and images are
resized bilinear:

    python scripts/evaluate.py --weights ddp_checkpoint.pt --model resnet18 \
        --data-dir ~/data/cifar10
"""

import dataclasses
import gc

from accelerate import Accelerator

from common.cli import Parser
from common.data.flags import add_data_args, check_data_args, data_options
from common.data.images import INTERPOLATIONS
from common.data.inputs import Inputs, loaders
from common.data.options import DataOptions
from common.errors import UserError
from common.recipe.evaluation import evaluate
from common.recipe.models import build_model, check_model_name
from common.run.weights import load_weights, non_finite, read_metadata


def parse_args(argv=None):
    parser = Parser(__doc__)
    parser.add_argument("--weights", required=True,
                        help="model.safetensors of a run, or a torch.save'd state dict "
                             "(.pt/.pth/.bin)")
    parser.add_argument("--model", default=None,
                        help="architecture of the weights, as --model of the training scripts "
                             "(default: the name stored in a model.safetensors)")
    parser.add_argument("--eval-batch-size", type=int, default=500,
                        help="images per evaluation batch (default: %(default)s)")
    add_data_args(parser)
    args = parser.parse_args(argv)
    check_data_args(args)
    if args.eval_batch_size < 1:
        raise UserError(f"--eval-batch-size {args.eval_batch_size}: must be 1 or more")
    if args.model is not None:
        check_model_name(args.model)
    return args


def load_test_inputs(options: DataOptions, accelerator, image_size: int | None, batch_size: int,
                     eval_split: dict | None, normalization: dict | None) -> Inputs:
    """The evaluation loader alone (train_loader None), for weights trained at ``image_size`` with
    ``normalization`` (None: the statistics of the training images) on the split ``eval_split``
    names (a training run's --val-fraction and --seed) or the data's own test split."""
    eval_split = eval_split or {}
    options = dataclasses.replace(
        options, image_size=image_size, batch_size=batch_size, grad_accum=1,
        normalization=normalization, seed=eval_split.get("seed", 0),
        val_fraction=options.val_fraction or eval_split.get("val_fraction"))
    return loaders(options, accelerator, train=False)


def main(args):
    gc.freeze()  # what the imports built lives to the end: the collector skips it (1 s at exit)
    state_dict = load_weights(args.weights)
    if bad := non_finite(state_dict):  # an accuracy of such weights would mean nothing
        raise UserError(f"--weights {args.weights}: the weights are not finite ({bad} NaN or "
                        f"infinite): not evaluated; use weights of a run that stayed finite")
    stored = read_metadata(args.weights)  # empty for files other than our model.safetensors
    model_name = args.model or stored.get("model")
    if model_name is None:
        raise UserError(f"--weights {args.weights} does not say which model it holds: add "
                        f"--model NAME")

    # The precision and memory format the run evaluated in (fp32 and NCHW for weights from
    # elsewhere): the same arithmetic, the same accuracy.
    accelerator = Accelerator(mixed_precision=stored.get("mixed_precision", "no"))
    image_size = stored.get("image_size")
    if image_size and args.image_size and args.image_size != image_size[0]:
        raise UserError(f"--weights {args.weights} were trained on {image_size[0]}px images, not "
                        f"--image-size {args.image_size}: drop --image-size")
    # The training run's resolution, interpolation, evaluation split, normalisation and memory
    # format; for weights from elsewhere (and runs that did not record the interpolation, which all
    # resized bilinear) the flags', bilinear, the statistics of the training images and NCHW.
    channels_last = stored.get("channels_last", False)
    interpolation = stored.get("interpolation", "bilinear")
    if interpolation not in INTERPOLATIONS:
        raise UserError(f"--weights {args.weights}: its metadata says interpolation "
                        f"{interpolation!r}, which evaluation does not have; use a "
                        f"model.safetensors written by the training scripts")
    options = dataclasses.replace(data_options(args), channels_last=channels_last,
                                  interpolation=interpolation)
    data = load_test_inputs(options, accelerator,
                            image_size[0] if image_size else args.image_size, args.eval_batch_size,
                            stored.get("eval_split"), stored.get("normalization"))
    classes = stored.get("classes", data.classes)
    if list(classes) != data.classes:
        raise UserError(f"--weights {args.weights} were trained on the classes "
                        f"{', '.join(classes[:5])}... but the data has "
                        f"{', '.join(data.classes[:5])}...: pass the data flags of the training "
                        f"run")
    model = build_model(model_name, len(data.classes), data.image_size)  # refused if it cannot
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        raise UserError(f"--weights {args.weights} do not fit --model {model_name} with "
                        f"{len(data.classes)} classes ({first}); check --model and the data "
                        f"flags") from None

    transform, loader = data.transform, data.test_loader
    model = model.to(memory_format=transform.memory_format)
    model, loader = accelerator.prepare(model, loader)
    result = evaluate(model, loader, transform, accelerator, len(data.classes))

    accelerator.print(f"test_acc={result.accuracy:.4f} ({result.correct}/{result.total}) "
                      f"model={model_name} precision={accelerator.mixed_precision} "
                      f"interpolation={interpolation} data={data.source}")
    width = max(len(name) for name in data.classes)
    for name, correct, total in zip(data.classes, result.class_correct, result.class_total):
        accuracy = correct / total if total else float("nan")
        accelerator.print(f"  {name:<{width}}  {accuracy:.4f}  ({correct}/{total})")
    return result


if __name__ == "__main__":
    main(parse_args())
