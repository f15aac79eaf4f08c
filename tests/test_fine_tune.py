"""Fine-tuning: --pretrained, --pretrained-path, --freeze backbone, --head-lr-scale, --optimizer.

No weights are downloaded and no accuracy is claimed from them: the "pretrained" weights are made
here from a seed (timm's and torchvision's ResNet-18 with its 1000-way ImageNet head), saved as a
file, put where the libraries keep their caches when a test needs that, and every run sees an
offline Hub (HF_HUB_OFFLINE=1) and its own empty HF_HOME and TORCH_HOME. The data is a 3-class
image folder made here. What is checked is what a user relies on: every tensor but the head is the
file's, the head has the folder's classes, the inputs are normalised with the weights' statistics
(not the folder's) and resized with their interpolation (timm's bicubic) on both loaders, recorded
for evaluate.py and a later --pretrained-path, a frozen backbone and its BatchNorm statistics do
not move, the parameter groups, and one line for each way the weights can be missing or wrong.
"""

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from accelerate import Accelerator
from helpers import ROOT, assert_same_weights, image_folder, run, weights
from probe_counts import per_class, predictions, printed_per_class
from safetensors.torch import load_file, save_file
from torchvision.io import decode_image

from common.cli import build_parser
from common.data.flags import data_options
from common.data.images import fit
from common.data.inputs import load_inputs
from common.data.pretrained import Weights, find_weights, fine_tune
from common.data.stats import channel_stats
from common.errors import UserError
from common.recipe.models import build_model
from common.run.weights import read_metadata

CLASSES = 3
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# ImageNet-stem ResNet-18 at 32 px (the weights say 224: --image-size wins, with a warning), 72
# training images of 3 classes: 3 steps an epoch.
FLAGS = ["--model", "timm:resnet18", "--image-size", "32", "--batch-size", "24", "--reference-batch-size",
         "24", "--epochs", "2", "--report-to", "none"]
ACCELERATE = (str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
              str(ROOT / "accelerate_configs" / "4gpu.yaml"), "--num_processes", "2")
PROBE = (sys.executable, str(ROOT / "tests" / "probe_fine_tune.py"))


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """(root, data folder, weights file, offline environment)."""
    root = tmp_path_factory.mktemp("fine-tune")
    data = image_folder(root / "data", train=72, val=24, classes=CLASSES)
    torch.manual_seed(1)
    save_file(timm.create_model("resnet18", num_classes=1000).state_dict(), root / "imagenet.safetensors")
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf"), "TORCH_HOME": str(root / "torch")}
    return root, data, root / "imagenet.safetensors", offline


def train(place, script, out, *extra, launcher=(sys.executable,), own_caches=False):
    """A run on the folder; with ``own_caches`` in the empty HF_HOME and TORCH_HOME of ``place``
    (a cold start: they are read at import), else forked warm (tests/zygote.py), the Hub offline."""
    root, data, _, offline = place
    env = offline if own_caches else {"HF_HUB_OFFLINE": "1"}
    return run(script, *FLAGS, "--data-dir", data, "--output-dir", out, *extra, cwd=root, launcher=launcher,
               env_extra={**env, "PROBE_FILE": str(out)})


def untouched_network(place) -> None:
    """Nothing was downloaded or cached: the runs' Hugging Face home and TORCH_HOME hold no file."""
    root = place[0]
    assert not [p for p in (root / "hf").rglob("*") if p.is_file()]
    assert not [p for p in (root / "torch").rglob("*") if p.is_file()]


def is_head(key: str) -> bool:
    return key.startswith("fc.")


@pytest.fixture(scope="module")
def frozen(place):
    """2-process DDP, the backbone frozen."""
    out = place[0] / "frozen"
    done = train(place, "train_ddp.py", out, "--pretrained-path", place[2], "--freeze", "backbone",
                 launcher=ACCELERATE, own_caches=True)
    return out, done


def test_a_frozen_backbone_and_its_batchnorm_statistics_do_not_move_under_ddp(place, frozen):
    out, done = frozen
    source, final = load_file(str(place[2])), weights(out)
    assert sorted(final) == sorted(source)
    moved = [k for k in source if not is_head(k) and not torch.equal(final[k], source[k])]
    assert not moved, moved[:5]  # weights, BatchNorm running statistics and their counts
    assert any(k.endswith("running_mean") for k in source)
    assert final["fc.weight"].shape == (CLASSES, 512) and final["fc.bias"].shape == (CLASSES,)
    assert "head fc swapped: 1000 classes -> 3 classes, newly initialised" in done.stdout
    assert "--freeze backbone: 11,176,512 parameters frozen, 1,539 trained (the head fc)" in done.stdout
    assert "the weights were trained on 224 px images and --image-size 32 differs" in done.stdout
    assert "32px (bicubic), loader device" in done.stdout  # timm's ResNet-18 was trained so
    untouched_network(place)


def test_inputs_are_normalised_as_the_weights_expect_and_evaluate_needs_nothing_more(place, frozen):
    out, _ = frozen
    config = json.loads((out / "config.json").read_text())
    expected = {"mean": [255 * m for m in IMAGENET_MEAN], "std": [255 * s for s in IMAGENET_STD]}
    for key in ("mean", "std"):
        assert config["normalization"][key] == pytest.approx(expected[key], rel=1e-6)
    images = torch.stack([decode_image(str(p)) for p in sorted((place[1] / "train").rglob("*.jpg"))])
    folder_mean, _ = channel_stats(images)
    assert max(abs(a - b) for a, b in zip(folder_mean, config["normalization"]["mean"])) > 5  # not the folder's
    tuned = config["fine_tune"]
    assert tuned["source"] == "--pretrained-path" and tuned["input_size"] == 224
    assert tuned["interpolation"] == "bicubic" and config["image_size"] == [32, 32]
    # what the weights say (fine_tune), what the run resized with, and what evaluate.py reads
    assert config["interpolation"] == "bicubic"
    assert read_metadata(out / "model.safetensors")["interpolation"] == "bicubic"
    # evaluate.py reads the weights' normalisation from model.safetensors: the count made here agrees
    done = run("evaluate.py", "--weights", out / "model.safetensors", "--data-dir", place[1], cwd=place[0])
    assert " interpolation=bicubic " in done.stdout  # with nothing on its command line
    test = sorted((place[1] / "val").rglob("*.jpg"))
    images = torch.stack([decode_image(str(p)) for p in test])
    labels = torch.tensor([int(p.parent.name.removeprefix("class")) for p in test])
    counts = per_class(predictions(out / "model.safetensors", images), labels, CLASSES)
    assert printed_per_class(done.stdout) == counts
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["test_acc"] == sum(c for c, _ in counts) / len(test)


@pytest.fixture(scope="module")
def tuned(place):
    """One process, nothing frozen, AdamW with the head at 10x the lr; the probe keeps step 0."""
    out = place[0] / "tuned"
    done = train(place, "train_single.py", out, "--pretrained-path", place[2], "--optimizer", "adamw",
                 "--head-lr-scale", "10", "--weight-decay", "0.05", "--checkpoint-every", "1",
                 "--keep-checkpoints", "10", launcher=PROBE)
    return out, done, torch.load(f"{out}.pt")


def test_every_tensor_but_the_head_is_the_file_s_at_step_zero(place, tuned):
    out, _, probe = tuned
    source, start = load_file(str(place[2])), probe["state"]
    assert sorted(start) == sorted(source)
    assert all(torch.equal(start[k], source[k]) for k in source if not is_head(k))
    assert start["fc.weight"].shape == (CLASSES, 512)
    final = weights(out)  # nothing frozen: the backbone trained
    assert any(not torch.equal(final[k], source[k]) for k in source if k.endswith("conv1.weight"))


def test_parameter_groups_decay_weights_only_and_give_the_head_its_lr(tuned):
    _, done, probe = tuned
    assert probe["optimizer"] == "AdamW"
    model = timm.create_model("resnet18", num_classes=CLASSES)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    seen = [n for group in probe["groups"] for n in group["names"]]
    assert sorted(seen) == sorted(shapes)  # every parameter, once
    base = min(group["lr"] for group in probe["groups"])
    for group in probe["groups"]:
        one_dimensional = {len(shapes[n]) == 1 for n in group["names"]}
        assert len(one_dimensional) == 1  # norm and bias parameters apart from the weights
        assert group["weight_decay"] == (0.0 if one_dimensional == {True} else 0.05)
        head = {is_head(n) for n in group["names"]}
        assert len(head) == 1 and group["lr_scale"] == (10 if head == {True} else 1)
        assert group["lr"] == pytest.approx(base * group["lr_scale"])
    assert "lr 0.001," in done.stdout  # AdamW's default lr (batch 24 = --reference-batch-size)
    assert probe["groups"][0]["lr_scale"] == 1  # the group whose lr the log line shows is the base lr's


def test_head_lr_scale_finds_a_convolution_head_and_logs_the_base_lr_first():
    from common.recipe.optim import build_optimizer
    model = build_model("torchvision:squeezenet1_1", CLASSES, 64)  # its head: classifier.1, a 1x1 convolution
    groups = build_optimizer(model, 0.1, 0.9, 5e-4, head_lr_scale=10).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    head = [g for g in groups if g["lr_scale"] == 10]
    assert sorted(names[id(p)] for g in head for p in g["params"]) == ["classifier.1.bias", "classifier.1.weight"]
    assert groups[0]["lr_scale"] == 1 and groups[0]["lr"] == 0.1


@pytest.mark.floor
def test_a_stopped_fine_tuning_resumes_bit_for_bit_with_the_same_groups(place, tuned, tmp_path):
    """... also when the weights' file is damaged or gone by then (a cleaned cache, another machine):
    the resumed run needs only what config.json recorded of them, the checkpoint holds the rest."""
    out, file = tmp_path / "run", tmp_path / "imagenet.safetensors"
    shutil.copy(place[2], file)
    common = ["--pretrained-path", file, "--optimizer", "adamw", "--head-lr-scale", "10", "--weight-decay",
              "0.05", "--checkpoint-every", "1"]
    train(place, "train_single.py", out, *common, "--max-steps", "4")
    file.write_bytes(file.read_bytes()[:1000])  # damaged: no other file would be accepted on resume
    done = train(place, "train_single.py", out, *common, "--resume", "--max-steps", "6")
    assert "weights of --pretrained-path not read: the checkpoint resumed holds the trained ones" in done.stdout
    file.unlink()
    done = train(place, "train_single.py", out, *common, "--resume")
    assert "resumed from" in done.stdout and "step 6" in done.stdout
    assert f"weights of --pretrained-path not read ({file} is gone): the checkpoint resumed holds the trained " \
           f"ones" in done.stdout
    assert_same_weights(out, tuned[0])


# ------------------------------------------------------------------- the weights' interpolation

def test_both_loaders_resize_with_the_weights_interpolation(place, tmp_path):
    """timm's ResNet-18 says bicubic: data_options threads it to the decode cache, the evaluation
    view of either loader (the test images are fit bicubic, not bilinear), the device path's crops,
    the workers' dataset, evaluate.py's loader, config.json and the start line. Images of 40x48,
    so that 32 px is a resize."""
    weights = find_weights("timm:resnet18", False, str(place[2]))  # no metadata: timm's config
    assert weights.interpolation == weights.resize_interpolation == "bicubic"
    folder = image_folder(tmp_path / "data", train=6, val=3, classes=CLASSES, sizes=((40, 48),))
    test = [decode_image(str(p)) for p in sorted((folder / "val").rglob("*.jpg"))]
    expected = torch.stack([fit(image, 32, "bicubic") for image in test])
    assert (expected.int() - torch.stack([fit(image, 32) for image in test]).int()).abs().max() > 2
    accelerator = Accelerator(cpu=True)
    spec = importlib.util.spec_from_file_location("evaluate", ROOT / "scripts" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)  # imports and definitions only: main() runs under __main__
    for loader in ("device", "workers"):
        args = build_parser("test").parse_args(
            [*FLAGS, "--data-dir", str(folder), "--batch-size", "3", "--loader", loader,
             "--cache-dir", str(tmp_path / "cache"), "--pretrained-path", str(place[2])])
        options = data_options(args, weights)
        data = load_inputs(options, accelerator)
        assert data.config["interpolation"] == "bicubic" and "32px (bicubic)" in data.line
        evaluated = evaluate.load_test_inputs(options, accelerator, 32, 3, None, weights.normalization)
        for loaded in (data, evaluated):
            assert torch.equal(torch.cat([images for images, _ in loaded.test_loader]), expected)
        if loader == "workers":
            assert data.train_loader.dataset.interpolation == "bicubic"
        else:
            assert data.transform.interpolation == "bicubic"
    assert [p.name for p in (tmp_path / "cache").glob("*.pt")][0].endswith("-32px-bicubic.pt")


def test_a_run_s_interpolation_is_carried_forward_by_pretrained_path(frozen, tmp_path):
    """The frozen run's model.safetensors says bicubic, and so do weights found from it for a model
    whose library says bilinear (torchvision's); a file of a run that did not record it resized
    bilinear, whatever the model's library says."""
    out, _ = frozen
    found = find_weights("torchvision:resnet18", False, str(out / "model.safetensors"))
    assert found.interpolation == "bicubic" and found.input_size == 32
    metadata = {key: json.dumps(value) for key, value in read_metadata(out / "model.safetensors").items()
                if key in ("normalization", "image_size")}
    save_file({"x": torch.zeros(1)}, tmp_path / "older.safetensors", metadata=metadata)
    assert find_weights("timm:resnet18", False, str(tmp_path / "older.safetensors")).interpolation == "bilinear"


@pytest.mark.parametrize("said", ["nearest", "random"])  # "random": some of timm's configs
def test_an_interpolation_the_data_path_lacks_resizes_bilinear_with_a_warning(place, tmp_path, said):
    model = build_model("resnet20", CLASSES)
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    found = Weights(tmp_path / "w.safetensors", "--pretrained-path", interpolation=said)
    args = build_parser("test").parse_args([*FLAGS, "--data-dir", str(place[1])])
    assert found.resize_interpolation == data_options(args, found).interpolation == "bilinear"
    loaded = fine_tune(model, found, "resnet20", CLASSES, 32, "none")["fine_tune"]["loaded"]
    assert loaded.endswith(f"; warning: the weights were trained on images resized with '{said}' "
                           f"interpolation, which this data path does not do: it resizes bilinear")


# ---------------------------------------------------------------- the libraries' caches, offline

def test_pretrained_reads_timm_weights_from_the_hugging_face_cache(place, tmp_path):
    """The file where huggingface_hub keeps it (models--timm--NAME/snapshots/REV/, refs/main), as a
    download by timm leaves it; loaded without asking the Hub."""
    _, data, file, offline = place
    hf = tmp_path / "hf"
    repo = hf / "hub" / "models--timm--resnet18.a1_in1k"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "model.safetensors").write_bytes(file.read_bytes())
    out = tmp_path / "run"
    done = run("train_single.py", *FLAGS, "--data-dir", data, "--output-dir", out, "--pretrained", "--freeze",
               "backbone", "--max-steps", "1", cwd=tmp_path, env_extra={**offline, "HF_HOME": str(hf)})
    assert "weights from timm timm/resnet18.a1_in1k" in done.stdout
    source, final = load_file(str(file)), weights(out)
    assert all(torch.equal(final[k], source[k]) for k in source if not is_head(k))


def test_pretrained_reads_torchvision_weights_from_torch_home(place, tmp_path, monkeypatch, capsys):
    """torchvision's file name in $TORCH_HOME/hub/checkpoints/, its keys loaded into torchvision's
    ResNet-18 by what the scripts call (find_weights, then fine_tune); the weights' preset (bilinear,
    224 px, ImageNet's statistics x 255) recorded; without the file, the line that says where it must
    be, when no network answers (torch.hub would download it otherwise)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    with pytest.raises(UserError) as missing:
        find_weights("torchvision:resnet18", True, None)
    assert capsys.readouterr() == ("", "")  # not torch.hub's "Downloading: ..." before our line
    assert str(missing.value).startswith(
        f"error: --pretrained: the weights of torchvision:resnet18 (ResNet18_Weights.IMAGENET1K_V1) are not at "
        f"{tmp_path}/torch/hub/checkpoints/resnet18-f37072fd.pth and cannot be downloaded (")
    assert str(missing.value).endswith(f"put {url} there (or set TORCH_HOME to the folder holding hub/checkpoints/), "
                                       f"or pass --pretrained-path FILE")
    torch.manual_seed(2)  # without BatchNorm's step counts, as torchvision's V1 files are
    state = {k: v for k, v in torchvision.models.resnet18().state_dict().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "torch" / "hub" / "checkpoints" / Path(url).name)
    found = find_weights("torchvision:resnet18", True, None)
    assert (found.input_size, found.interpolation) == (224, "bilinear")
    assert found.normalization["mean"] == pytest.approx([255 * m for m in IMAGENET_MEAN])
    assert found.normalization["std"] == pytest.approx([255 * s for s in IMAGENET_STD])
    model = build_model("torchvision:resnet18", CLASSES)
    tuned = fine_tune(model, found, "torchvision:resnet18", CLASSES, 224, "backbone")["fine_tune"]
    assert tuned["loaded"].endswith("head fc swapped: 1000 classes -> 3 classes, newly initialised")
    final = model.state_dict()
    assert all(torch.equal(final[k], state[k]) for k in state if not is_head(k))


def test_pretrained_without_a_cached_file_is_one_line_at_once(place, tmp_path):
    """As a user meets it: timm's weights not in an empty Hugging Face cache, the Hub offline."""
    _, data, _, offline = place
    done = run("train_single.py", "--model", "timm:resnet18", "--pretrained", "--data-dir", data, "--report-to",
               "none", cwd=tmp_path, env_extra={**offline, "HF_HOME": str(tmp_path / "hf")}, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: --pretrained: the weights of timm:resnet18 are not in the Hugging Face cache "
                               f"({tmp_path / 'hf'}/hub) and cannot be downloaded ("), lines[0]
    assert lines[0].endswith("or pass --pretrained-path FILE")
    written = [p for p in tmp_path.rglob("*") if p.is_file() and ".cache" not in p.parts]
    assert not written and not (tmp_path / "runs").exists()  # no run folder, nothing downloaded


@pytest.mark.parametrize("flags, message", [
    (["--model", "timm:resnet34", "--pretrained-path", "{file}"],
     r"error: the weights in \S+ do not fit --model timm:resnet34: tensors \d+ missing \(layer1\.2\."),
    (["--model", "resnet20", "--pretrained"], r"error: --pretrained: --model resnet20 has no published weights"),
    (["--freeze", "backbone"], r"error: --freeze backbone: a backbone of random weights, frozen, learns nothing"),
    (["--pretrained", "--pretrained-path", "{file}"], r"error: --pretrained and --pretrained-path \S+: both"),
    (["--pretrained-path", "nothing-here.pt"], r"error: --pretrained-path nothing-here.pt: no such file"),
    (["--pretrained-path", "{folder}"], r"error: --pretrained-path \S+/weights: is a folder, not a file \(it holds "
                                        r"model.safetensors\); pass a safetensors file or a torch state dict$"),
    (["--pretrained-path", "{nan}"], r"error: --pretrained-path: the weights in \S+ are not finite \(\S+: 1 of \d+ "
                                     r"values NaN or infinite\): pass weights that are$"),
    (["--head-lr-scale", "0"], r"error: --head-lr-scale 0.0: must be a positive number"),
])
def test_wrong_weights_and_flags_are_one_line(place, tmp_path, flags, message):
    _, data, file, _ = place
    (folder := tmp_path / "weights").mkdir()
    shutil.copy(file, folder / "model.safetensors")
    state = load_file(str(file))
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(nan := tmp_path / "nan.safetensors"))
    flags = [f.format(file=file, folder=folder, nan=nan) for f in flags]
    done = run("train_single.py", *FLAGS, "--data-dir", data, *flags, cwd=tmp_path,
               env_extra={"HF_HUB_OFFLINE": "1"}, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and re.match(message, lines[0]), done.stderr
