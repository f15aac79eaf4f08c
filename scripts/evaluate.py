"""Evaluate saved weights on the test split: overall and per-class accuracy.

Reads our model.safetensors (the model name is stored in it) and state dicts saved by other
scripts with torch.save, including the ``module.`` prefix that a DataParallel/DDP-wrapped model
leaves on every key. Use the same data flags as the training run, so the test split and the
normalisation (computed from the training split) are the same.

    python scripts/evaluate.py --weights runs/train_single-20260101-120000/model.safetensors
    python scripts/evaluate.py --weights ddp_checkpoint.pt --model resnet18 --data-dir ~/data/cifar10
"""

from accelerate import Accelerator
from safetensors import safe_open

from common.augment import BatchTransform, channel_stats
from common.checkpoint import load_weights
from common.cli import Parser, add_data_args
from common.data import load_image_data
from common.errors import UserError
from common.evaluation import evaluate
from common.loader import tensor_loader
from common.models import build_model


def parse_args(argv=None):
    parser = Parser(__doc__)
    parser.add_argument("--weights", required=True,
                        help="model.safetensors of a run, or a torch.save'd state dict (.pt/.pth/.bin)")
    parser.add_argument("--model", default=None,
                        help="architecture of the weights, as --model of the training scripts (default: "
                             "the name stored in a model.safetensors)")
    parser.add_argument("--batch-size", type=int, default=500,
                        help="images per evaluation batch (default: %(default)s)")
    add_data_args(parser)
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be 1 or more")
    return args


def stored_metadata(path: str) -> dict:
    """The metadata our training scripts write into model.safetensors (empty for other files)."""
    if not path.endswith(".safetensors"):
        return {}
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 - an unreadable file is reported by load_weights
        return {}


def main(args):
    state_dict = load_weights(args.weights)
    model_name = args.model or stored_metadata(args.weights).get("model")
    if model_name is None:
        raise UserError(f"--weights {args.weights} does not say which model it holds: add --model NAME")

    accelerator = Accelerator(mixed_precision="no")
    data = load_image_data(args.dataset, args.data_dir, args.cache_dir, args.synthetic_train_size,
                           args.synthetic_test_size)
    model = build_model(model_name, num_classes=len(data.classes))
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        raise UserError(f"--weights {args.weights} do not fit --model {model_name} with "
                        f"{len(data.classes)} classes ({first}); check --model and the data flags") from None

    transform = BatchTransform(*channel_stats(data.train_images))
    device = accelerator.device
    loader = tensor_loader(data.test_images.to(device), data.test_labels.to(device), args.batch_size,
                           shuffle=False)
    model, loader = accelerator.prepare(model, loader)
    result = evaluate(model, loader, transform, accelerator, len(data.classes))

    accelerator.print(f"test_acc={result.accuracy:.4f} ({result.correct}/{result.total}) "
                      f"model={model_name} data={data.source}")
    width = max(len(name) for name in data.classes)
    for name, correct, total in zip(data.classes, result.class_correct, result.class_total):
        accuracy = correct / total if total else float("nan")
        accelerator.print(f"  {name:<{width}}  {accuracy:.4f}  ({correct}/{total})")
    return result


if __name__ == "__main__":
    main(parse_args())
