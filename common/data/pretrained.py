"""Pretrained weights for fine-tuning: found offline, loaded with the head swapped, their inputs.

    weights = find_weights(args.model, args.pretrained, args.pretrained_path)  # None: random init
    data = load_inputs(data_options(args, weights), accelerator)  # their size, mean and std
    model = build_model(args.model, data.num_classes, data.image_size)
    tuned = fine_tune(model, weights, args.model, data.num_classes, data.image_size, args.freeze)

Where the weights come from:
- ``timm:NAME --pretrained``: the Hugging Face cache (HF_HUB_CACHE, ~/.cache/huggingface/hub), the
  file timm itself would load (``hf_hub_id`` of the model's pretrained config); downloaded into it
  when the Hub can be reached.
- ``torchvision:NAME --pretrained``: $TORCH_HOME/hub/checkpoints/<the file name of the weights'
  URL>, where torchvision itself keeps them; downloaded there when the URL can be reached.
- ``--pretrained-path FILE``: a safetensors file or a torch state dict (also one nested under
  "state_dict" or "model", or saved with DDP's "module." or torch.compile's "_orig_mod."). timm's
  and torchvision's ResNets share their keys, so either library's file loads into either.
Without the file or a network, one line says where it must be: never a hang or a silent random init.

The inputs: mean, std, input size and interpolation come from the weights' config (timm's pretrained
config, torchvision's weight transforms, or our runs' model.safetensors' metadata): a run normalises
and resizes as the weights were trained, not with its folder's statistics. Every resize of the data
path (the decode cache, the evaluation view, both loaders' random-resized crops) is antialiased with
their interpolation, bilinear (torchvision's weights) or bicubic (timm's ResNets); any other (timm's
"random", "nearest") is bilinear (Weights.resize_interpolation), warned in fine_tune's line.
config.json records what the weights say (fine_tune) and what the run used (interpolation),
model.safetensors the latter, read by scripts/evaluate.py and a later --pretrained-path of it.
"""

import dataclasses
import functools
import json
import math
import socket
from pathlib import Path

import torch

from common.data.images import INTERPOLATIONS
from common.errors import UserError, first_line
from common.files import check_file
from common.recipe.models import TIMM_PREFIX, TORCHVISION_PREFIX, classifier_name
from common.run.weights import load_weights, non_finite, read_metadata

# Seconds a download of torchvision's weights may wait for the network at each step (connect,
# read) before --pretrained gives up with its line; the Hub has its own (HF_HUB_ETAG_TIMEOUT).
DOWNLOAD_TIMEOUT = 20


@dataclasses.dataclass(frozen=True)
class Weights:
    """A state dict file to start from, and the inputs it was trained on (None: not known)."""

    file: Path
    source: str  # where it was found, for the start line and config.json
    # per channel, in the 0..255 scale of our data path (the libraries give them in 0..1)
    normalization: dict | None = None  # {"mean": [...], "std": [...]}, as DataOptions takes it
    input_size: int | None = None
    interpolation: str | None = None
    recorded_only: bool = False  # resuming: what the run recorded of them, not read (find_weights)

    @property
    def resize_interpolation(self) -> str:
        """The data path's interpolation for them: theirs if among INTERPOLATIONS, else bilinear."""
        return self.interpolation if self.interpolation in INTERPOLATIONS else "bilinear"


def check_fine_tuning(pretrained: bool, path: str | None, freeze: str, head_lr_scale: float):
    """The fine-tuning flags: weights from one place, a frozen backbone only of pretrained weights,
    a head lr scale that is a positive number (a UserError otherwise)."""
    if pretrained and path:
        raise UserError(f"--pretrained and --pretrained-path {path}: both name the weights to "
                        f"start from; pass one")
    if freeze == "backbone" and not (pretrained or path):
        raise UserError("--freeze backbone: a backbone of random weights, frozen, learns nothing; "
                        "add --pretrained or --pretrained-path FILE, or drop --freeze")
    if not 0 < head_lr_scale < math.inf:
        raise UserError(f"--head-lr-scale {head_lr_scale}: must be a positive number, e.g. 10 "
                        f"(the classifier's lr 10 times the rest's)")


def find_weights(model: str, pretrained: bool, path: str | None,
                 checkpoint: Path | None = None) -> Weights | None:
    """The weights --pretrained or --pretrained-path name for --model ``model``, found or
    downloaded now, so that a run without them stops before it loads any data (a UserError). A run
    resuming ``checkpoint`` does not read them: the checkpoint holds the trained weights, and its
    config.json what the run recorded of them (the file may be gone by then, a cleaned cache or
    another machine, or damaged: no other file would be accepted on resume)."""
    if checkpoint and (pretrained or path) and (recorded := _recorded_weights(checkpoint)):
        return recorded
    if path is not None:
        file = Path(path).expanduser()
        check_file("--pretrained-path", file, "pass a safetensors file or a torch state dict")
        return Weights(file, "--pretrained-path", **_inputs_of_file(file, model))
    if not pretrained:
        return None
    if model.startswith(TIMM_PREFIX):
        return _timm_weights(model.removeprefix(TIMM_PREFIX))
    if model.startswith(TORCHVISION_PREFIX):
        return _torchvision_weights(model.removeprefix(TORCHVISION_PREFIX))
    raise UserError(f"--pretrained: --model {model} has no published weights (a CIFAR-stem "
                    f"ResNet of this project); pass --pretrained-path FILE (an earlier run's "
                    f"model.safetensors), or a timm:NAME or torchvision:NAME model")


def _recorded_weights(checkpoint: Path) -> Weights | None:
    """The weights config.json of ``checkpoint``'s run records (None: none)."""
    try:
        config = json.loads((Path(checkpoint).parent.parent / "config.json").read_text())
        tuned, normalization = config["fine_tune"], config["fine_tune"]["normalization"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Weights(Path(tuned["file"]), tuned["source"], normalization or None,
                   tuned.get("input_size"), tuned.get("interpolation"), recorded_only=True)


def _timm_weights(name: str) -> Weights:
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError as error:  # an unknown pretrained tag
        raise UserError(f"--pretrained: timm:{name}: {first_line(error)}; pick a tag of "
                        f"timm.list_pretrained('{name.split('.')[0]}*')") from None
    if cfg is None or not cfg.hf_hub_id:
        raise UserError(f"--pretrained: timm has no weights on the Hugging Face Hub for {name}; "
                        f"pick a model of timm.list_models(pretrained=True), or pass "
                        f"--pretrained-path FILE")
    repo, names = cfg.hf_hub_id, [cfg.hf_hub_filename or "model.safetensors", "pytorch_model.bin"]
    cached = [try_to_load_from_cache(repo, n) for n in names]
    if (file := next((Path(c) for c in cached if isinstance(c, str)), None)) is None:
        try:  # the Hub's own timeouts (HF_HUB_ETAG_TIMEOUT, 10 s) bound the wait
            file = Path(hf_hub_download(repo, names[0]))
        except Exception as error:  # noqa: BLE001 - offline, unreachable, unknown file: one line
            raise UserError(
                f"--pretrained: the weights of timm:{name} are not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and cannot be downloaded ({first_line(error)}): "
                f"put {names[0]} of https://huggingface.co/{repo} there (on a machine with a "
                f"network: python -c \"import timm; timm.create_model('{name}', "
                f"pretrained=True)\", then copy the cache), or pass --pretrained-path FILE"
            ) from None
    return Weights(file, f"timm {repo}", **_timm_inputs(cfg))


def _timm_inputs(cfg) -> dict:
    return {"normalization": _scaled(cfg.mean, cfg.std), "input_size": cfg.input_size[-1],
            "interpolation": cfg.interpolation}


def _scaled(mean, std) -> dict:
    """Statistics of 0..1 pixels (timm's, torchvision's) in the 0..255 scale of uint8 images, as
    Weights.normalization holds them."""
    return {"mean": [255 * v for v in mean], "std": [255 * v for v in std]}


def _torchvision_weights(name: str) -> Weights:
    import torchvision

    default = torchvision.models.get_model_weights(name).DEFAULT
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(default.url).name
    if not file.is_file():
        timeout = socket.getdefaulttimeout()
        try:  # torch.hub's urlopen has no timeout of its own: a silent network would hang it
            socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
            # load_state_dict_from_url's own "Downloading: ..." line would come before ours
            file.parent.mkdir(parents=True, exist_ok=True)
            digest = torch.hub.HASH_REGEX.search(file.name)
            torch.hub.download_url_to_file(default.url, str(file), digest and digest.group(1),
                                           progress=False)  # to a temporary file, then renamed
        except Exception as error:  # noqa: BLE001 - offline, unreachable, a bad download
            raise UserError(
                f"--pretrained: the weights of torchvision:{name} ({default}) are not at {file} "
                f"and cannot be downloaded ({first_line(error)}): put {default.url} there (or "
                f"set TORCH_HOME to the folder holding hub/checkpoints/), or pass "
                f"--pretrained-path FILE") from None
        finally:
            socket.setdefaulttimeout(timeout)
    return Weights(file, f"torchvision {default}", **_torchvision_inputs(default))


def _torchvision_inputs(weights) -> dict:
    preset = weights.transforms()
    return {"normalization": _scaled(preset.mean, preset.std), "input_size": preset.crop_size[0],
            "interpolation": preset.interpolation.value}


def _inputs_of_file(file: Path, model: str) -> dict:
    """The inputs of a --pretrained-path file: the metadata of one of our runs' model.safetensors,
    else the library's default weights for the architecture, else unknown (the data's own)."""
    stored = read_metadata(file)  # {} when unreadable: load_pretrained says so in its line
    if "normalization" in stored:
        return {"normalization": stored["normalization"],  # as save_final_weights wrote it
                "input_size": stored.get("image_size", [None])[0],
                # runs that did not record it resized bilinear
                "interpolation": stored.get("interpolation", "bilinear")}
    if model.startswith(TIMM_PREFIX):
        from timm.models import get_pretrained_cfg
        cfg = get_pretrained_cfg(model.removeprefix(TIMM_PREFIX))
        return _timm_inputs(cfg) if cfg is not None else {}
    if model.startswith(TORCHVISION_PREFIX):
        import torchvision
        name = model.removeprefix(TORCHVISION_PREFIX)
        return _torchvision_inputs(torchvision.models.get_model_weights(name).DEFAULT)
    return {}


def fine_tune(model: torch.nn.Module, weights: Weights | None, model_name: str, num_classes: int,
              image_size: int, freeze: str) -> dict:
    """``weights`` loaded into ``model`` (load_pretrained), its backbone frozen if ``freeze`` is
    "backbone" (freeze_backbone): {"fine_tune": what was done, for config.json and the start
    line}, or {} for random weights. An ``image_size`` other than the weights' own (--image-size
    wins), and an interpolation the data path lacks, are warnings in the same line."""
    if weights is None:
        return {}
    gone = "" if weights.file.is_file() else f" ({weights.file} is gone)"
    loaded = (f"weights of {weights.source} not read{gone}: the checkpoint resumed holds the "
              f"trained ones" if weights.recorded_only
              else load_pretrained(model, weights, model_name, num_classes))
    done = {"file": str(weights.file), "source": weights.source, "input_size": weights.input_size,
            "interpolation": weights.interpolation, "normalization": weights.normalization,
            "loaded": loaded}  # what config.json records of them, and what was done
    if weights.input_size and image_size != weights.input_size:
        done["loaded"] += (f"; warning: the weights were trained on {weights.input_size} px "
                           f"images and --image-size {image_size} differs: accuracy may suffer")
    if weights.interpolation and weights.interpolation != weights.resize_interpolation:
        done["loaded"] += (f"; warning: the weights were trained on images resized with "
                           f"{weights.interpolation!r} interpolation, which this data path does "
                           f"not do: it resizes bilinear")
    if freeze == "backbone":
        done["frozen"] = freeze_backbone(model, num_classes)
    return {"fine_tune": done}


def load_pretrained(model: torch.nn.Module, weights: Weights, model_name: str,
                    num_classes: int) -> str:
    """Load ``weights`` into ``model`` (built for ``num_classes``): strictly, except the classifier
    when the file's has another number of classes (or none), which keeps its new random init. The
    line that says so. A file of another model is a UserError naming the tensors that do not fit."""
    flag = "--pretrained-path" if weights.source == "--pretrained-path" else "--pretrained"
    found, own = load_weights(weights.file, flag), model.state_dict()
    if bad := non_finite(found):  # else the first step's NaN loss would be put down to the lr
        raise UserError(f"{flag}: the weights in {weights.file} are not finite ({bad} NaN or "
                        f"infinite): pass weights that are")
    head = classifier_name(model, num_classes)
    head_keys = {k for k in own if k.startswith(f"{head}.")}
    swap = any(k not in found or found[k].shape != own[k].shape for k in head_keys)
    state = {k: v for k, v in found.items() if not (swap and k in head_keys)}
    # Older files (torchvision's V1 ResNets) lack BatchNorm's step counts: the load fills them in.
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")
               and not (swap and k in head_keys)]
    unexpected = [k for k in state if k not in own]
    reshaped = [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or reshaped:
        parts = [f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for keys, what in ((missing, "missing"), (unexpected, "not in the model"),
                                    (reshaped, "of another shape")) if keys]
        raise UserError(f"the weights in {weights.file} do not fit --model {model_name}: tensors "
                        f"{'; '.join(parts)}; pass weights of this architecture")
    model.load_state_dict(state, strict=False)  # what does not fit was refused above
    said = f"weights from {weights.source} ({weights.file})"
    if not swap:
        return f"{said}, the head {head} kept ({num_classes} classes)"
    weight = found.get(f"{head}.weight")
    was = f"{weight.shape[0]} classes" if weight is not None else "none"
    return f"{said}; head {head} swapped: {was} -> {num_classes} classes, newly initialised"


def freeze_backbone(model: torch.nn.Module, num_classes: int) -> str:
    """Every parameter but the classifier's frozen, and every BatchNorm outside it held in eval
    mode: requires_grad alone does not stop BatchNorm's running statistics, which train() updates
    from each batch. Call it before the optimizer is built and before prepare, so the optimizer
    holds the head only and DDP needs no find_unused_parameters. The line that says so."""
    head = classifier_name(model, num_classes)
    model.requires_grad_(False)
    model.get_submodule(head).requires_grad_(True)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and \
                not name.startswith(f"{head}."):
            module.__class__ = _frozen_class(type(module))
            module.eval()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters()) - trained
    return f"--freeze backbone: {frozen:,} parameters frozen, {trained:,} trained (the head {head})"


@functools.cache
def _frozen_class(cls: type) -> type:
    """``cls`` (a BatchNorm class) whose train() keeps it in eval mode: the same module and state
    dict, normalising with the running statistics it was given."""
    def train(self, mode: bool = True):
        return torch.nn.Module.train(self, False)

    return type(f"Frozen{cls.__name__}", (cls,), {"train": train, "__module__": __name__})
