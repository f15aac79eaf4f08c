"""The final weights: model.safetensors, a plain state dict with what evaluation needs.

Training writes it at the end of a run (``save_weights``); scripts/evaluate.py reads it back
(``load_weights``, ``read_metadata``), as does any code that loads it into a plain model.
"""

import json
import re
import warnings
from contextlib import suppress
from pathlib import Path

import safetensors.torch  # safetensors too: safe_open
import torch

from common.errors import UserError, first_line
from common.failures import fail_together, from_main, why_not_written
from common.files import atomic_write, check_file
from common.run.checkpoints import CHECKPOINT_DIR, intact_advice

_WRAPPER_PREFIXES = re.compile(r"^(module\.|_orig_mod\.)+")  # DataParallel/DDP, torch.compile
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colour codes in torch's messages


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    """The final weights, a plain state dict (keys without wrapper prefixes: strip_wrapper_prefixes)
    in safetensors, which loads into an unwrapped model, with ``metadata`` (what evaluation needs:
    save_final_weights), its values that are not strings as JSON (read_metadata)."""
    plain = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    text = {key: value if isinstance(value, str) else json.dumps(value)
            for key, value in metadata.items()}
    with atomic_write(path) as f:
        f.write(safetensors.torch.save(plain, metadata=text))


def read_metadata(path: Path) -> dict:
    """The metadata save_weights stored in a .safetensors file, JSON values decoded; empty for
    other files and for files without metadata."""
    if Path(path).suffix != ".safetensors":
        return {}
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            stored = f.metadata() or {}
    except Exception:  # noqa: BLE001 - an unreadable file is reported by load_weights
        return {}
    for key, value in stored.items():
        with suppress(ValueError):  # else a plain string, e.g. the model name
            stored[key] = json.loads(value)
    return stored


def load_weights(path: Path, flag: str = "--weights") -> dict[str, torch.Tensor]:
    """A state dict from our safetensors or from a torch.save'd file of another script (or library),
    named by ``flag`` in the one line that refuses a file it cannot read. Accepts a plain state
    dict, one nested under "state_dict" or "model", and keys prefixed with ``module.`` (saved from a
    DataParallel/DDP-wrapped model) or ``_orig_mod.`` (torch.compile)."""
    path = Path(path)
    check_file(flag, path, "pass a .safetensors file or a torch.save'd state dict")
    try:
        with warnings.catch_warnings(action="ignore"):  # torch's on a pickle's protocol: a 2nd line
            state = (safetensors.torch.load_file(str(path)) if path.suffix == ".safetensors"
                     else torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise UserError(f"{flag} {path}: cannot read it ({_plain(error)}); pass a "
                        f".safetensors file or a torch.save'd state dict") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{flag} {path}: not a state dict of tensors")
    return strip_wrapper_prefixes(state)


def _plain(error: Exception) -> str:
    """A loading error in one plain line. torch's refusal of a pickle that holds objects is several
    lines in terminal colours, advising weights_only=False (which runs the file's code): its one
    telling line, "Unsupported global: GLOBAL __main__.Net ..." (or in torch 2.14, on the lines
    after it, "Unsupported operand 149"), is kept."""
    if told := re.search(r"WeightsUnpickler error:\s*(\S.*?)(?: was not |\. |[ \t]*$)",
                         _ANSI.sub("", str(error)), re.MULTILINE):
        return (f"it holds pickled objects, not only tensors: {told[1]}; save model.state_dict() "
                f"instead")
    return _ANSI.sub("", first_line(error))


def non_finite(state: dict[str, torch.Tensor]) -> str | None:
    """The first tensor of ``state`` holding a NaN or an infinity, as "name: n of m values"."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not (finite := torch.isfinite(tensor)).all():
            return f"{name}: {(~finite).sum().item()} of {tensor.numel()} values"
    return None


def strip_wrapper_prefixes(state: dict) -> dict:
    """Remove the key prefixes that DataParallel/DDP (``module.``) and torch.compile add."""
    return {_WRAPPER_PREFIXES.sub("", k): v for k, v in state.items()}


EVALUATION = ("classes", "image_size", "normalization", "interpolation", "mixed_precision",
              "eval_split")


def save_final_weights(accelerator, model, output_dir: Path, config: dict, step: int) -> Path:
    """model.safetensors of a finished run, written by the main process: the weights of the
    unwrapped ``model`` (unwrap_model strips DDP and DataParallel, strip_wrapper_prefixes then
    --compile's _orig_mod.), so they load into a plain model, and in its metadata the model name,
    the step and EVALUATION of the run's ``config``: all scripts/evaluate.py needs but the images.

    Weights that are not finite are not written, nor is a file the disk cannot hold: every process
    stops with one line, and the run's checkpoints stay as they are."""
    path = Path(output_dir) / "model.safetensors"
    failure = None
    if accelerator.is_main_process:
        state = strip_wrapper_prefixes(accelerator.unwrap_model(model).state_dict())
        if bad := non_finite(state):
            failure = (f"the final weights are not finite ({bad} NaN or infinite) at step {step}: "
                       f"{path} was not written, and the run's checkpoints in "
                       f"{Path(output_dir) / CHECKPOINT_DIR} are intact; resume from an earlier "
                       f"one into a new --output-dir (--resume CHECKPOINT --output-dir NEW), or "
                       f"start again")
        else:
            run = config["args"]  # the run's flags
            metadata = {"model": run["model"], "step": step, "channels_last": run["channels_last"],
                        # --ema-decay: the averaged weights, not the last step's
                        "weights": f"ema {run['ema_decay']}" if run.get("ema_decay") else "live",
                        # and where fine-tuned weights came from (--pretrained ...)
                        **{key: config[key] for key in (*EVALUATION, "fine_tune") if key in config}}
            try:
                save_weights(state, path, metadata)
            except Exception as error:  # noqa: BLE001 - SafetensorError, OSError ...
                failure = (f"cannot write {path} ({why_not_written(error, path)})"
                           f"{intact_advice(output_dir)} to write the weights")
    if (failure := from_main(accelerator, failure)) is not None:
        fail_together(accelerator, failure)
    return path
