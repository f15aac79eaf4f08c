"""The pieces of common/ that the scripts rely on: augmentation, loader, schedule, checkpoint files."""

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from torchvision.transforms import v2

from common.data.device import tensor_loader
from common.data.stats import channel_stats
from common.data.transform import BatchTransform, resized_crop_boxes, sample_seed
from common.errors import UserError
from common.files import atomic_write
from common.observe.tracking import log_line
from common.parallel.amp import choose_mixed_precision
from common.recipe.numerics import keep_freed_memory
from common.recipe.optim import build_optimizer, build_scheduler
from common.run.checkpoints import latest_checkpoint
from common.run.record import check_resume_config
from common.run.weights import load_weights, read_metadata, save_weights, strip_wrapper_prefixes


def images(n=16, seed=0):
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- augmentation

def test_augmentation_is_deterministic_for_a_seed_and_varies_with_it():
    transform, batch = BatchTransform([0, 0, 0], [1, 1, 1]), images()
    a, b, c = (transform.train(batch, seed=s) for s in [(0, 5), (0, 5), (0, 6)])
    assert a.shape == (16, 3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_crop_and_flip_match_a_per_image_reference():
    """Each output image is the zero-padded input cropped at some offset, maybe flipped."""
    transform, batch = BatchTransform([0, 0, 0], [1, 1, 1]), images()
    out = transform.crop_and_flip(batch, torch.Generator().manual_seed(3))
    padded = torch.nn.functional.pad(batch, (4, 4, 4, 4))
    flips = 0
    for image, result in zip(padded, out):
        candidates = {(top, left, flip) for top in range(9) for left in range(9) for flip in (False, True)
                      if torch.equal(result, (lambda crop: crop.flip(2) if flip else crop)(
                          image[:, top:top + 32, left:left + 32]))}
        assert candidates, "an output image is not a crop of its padded input"
        flips += all(flip for _, _, flip in candidates)
    assert 0 < flips < len(batch)  # some flipped, some not


def test_large_images_get_torchvisions_random_resized_crop():
    """Above 64 px the device path crops as the workers path does (ImageNet's random-resized crop,
    not CIFAR's padding): each output is torchvision's resized_crop of the box the batch's
    generator drew, flipped when it drew a flip, in float."""
    batch = torch.randint(0, 256, (24, 3, 96, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = BatchTransform([0, 0, 0], [1, 1, 1], channels_last=True).train(batch, seed=(3, 7))
    assert out.shape == batch.shape and out.is_contiguous(memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(sample_seed(3, 7))  # as BatchTransform.train draws
    boxes = torch.stack(resized_crop_boxes(len(batch), 96, 96, generator), dim=1).int().tolist()
    flipped = (torch.rand(len(batch), generator=generator) < 0.5).tolist()
    for image, result, box, flip in zip(batch, out, boxes, flipped):
        expected = v2.functional.resized_crop(image.float(), *box, [96, 96], antialias=False)
        expected = v2.functional.horizontal_flip(expected) if flip else expected
        assert (result - expected).abs().max() < 0.01  # of 255
    assert 0 < sum(flipped) < len(batch) and len({tuple(box) for box in boxes}) == len(batch)


def test_normalisation_uses_the_data_statistics():
    batch = images(64)
    mean, std = channel_stats(batch, chunk_bytes=10 * 8 * batch[0].numel())  # chunks of 10 images
    assert torch.allclose(torch.tensor(mean), batch.float().mean(dim=(0, 2, 3)), atol=1e-3)
    assert torch.allclose(torch.tensor(std), batch.float().std(dim=(0, 2, 3), unbiased=False), atol=1e-3)
    normalised = BatchTransform(mean, std).eval(batch)
    assert normalised.mean().abs() < 1e-3 and (normalised.std() - 1).abs() < 1e-2


def test_channel_stats_of_images_one_at_a_time_equal_those_of_the_whole_tensor():
    batch = images(64)
    whole = torch.tensor(channel_stats(batch))  # (mean, std) x channels
    assert torch.allclose(torch.tensor(channel_stats(iter(batch))), whole, atol=1e-5)
    assert torch.allclose(torch.tensor(channel_stats(batch.split(10))), whole, atol=1e-5)
    for wrong in (iter([]), batch[0]):  # no image; one image where a batch is expected
        with pytest.raises(ValueError):
            channel_stats(wrong)


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["from NCHW", "from NHWC"])
def test_normalisation_is_the_textbook_formula_in_the_wanted_layout(channels_last, layout):
    batch = images().contiguous(memory_format=layout)
    out = BatchTransform([10, 20, 30], [2, 3, 4], augment=False, channels_last=channels_last).eval(batch)
    mean, std = torch.tensor([10.0, 20, 30]).view(1, 3, 1, 1), torch.tensor([2.0, 3, 4]).view(1, 3, 1, 1)
    assert torch.equal(out, (batch.float() - mean) / std)  # the same float32 rounding, bit for bit
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_no_augment_only_normalises():
    batch = images()
    transform = BatchTransform([10, 20, 30], [2, 2, 2], augment=False)
    assert torch.equal(transform.train(batch, seed=(0, 1)), transform.eval(batch))


# ------------------------------------------------------------------------------------ loader

def test_loader_yields_whole_shuffled_batches_of_the_right_pairs():
    x = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1).expand(10, 3, 2, 2).contiguous()
    y = torch.arange(10)
    loader = tensor_loader(x, y, batch_size=4, shuffle=True, seed=0)
    batches = list(loader)
    assert len(batches) == len(loader) == 2  # the partial last batch is dropped for training
    for xb, yb in batches:
        assert xb.shape == (4, 3, 2, 2) and torch.equal(xb[:, 0, 0, 0].long(), yb)
    seen = torch.cat([yb for _, yb in batches])
    assert len(set(seen.tolist())) == 8 and not torch.equal(seen, torch.arange(8))
    test = list(tensor_loader(x, y, batch_size=4, shuffle=False))
    assert torch.equal(torch.cat([yb for _, yb in test]), y)  # evaluation keeps every image, in order


# ---------------------------------------------------------------------------------- schedule

def lrs(schedule, steps=20, per_epoch=4, warmup=0.0, milestones=()):
    optimizer = build_optimizer(torch.nn.Linear(2, 2), lr=0.1, momentum=0.9, weight_decay=0)
    scheduler = build_scheduler(optimizer, schedule, steps, per_epoch, warmup, milestones)
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


def test_step_schedule_is_the_articles_recipe():
    seen = lrs("step", steps=60, per_epoch=4, milestones=[4, 9, 14])
    per_epoch = [seen[e * 4] for e in range(15)]
    assert per_epoch == pytest.approx([0.1] * 4 + [0.01] * 5 + [0.001] * 5 + [0.0001])


def test_onecycle_warms_up_to_the_peak_then_decays():
    seen = lrs("onecycle", steps=40, per_epoch=4, warmup=2)
    peak = max(range(40), key=seen.__getitem__)
    assert seen[peak] == pytest.approx(0.1) and peak == 7  # two epochs of 4 steps
    assert seen[0] == pytest.approx(0.1 / 25)
    assert all(a <= b for a, b in zip(seen[:peak], seen[1:peak + 1]))
    assert all(a >= b for a, b in zip(seen[peak:], seen[peak + 1:])) and seen[-1] < 1e-4


def test_step_schedule_with_warmup():
    seen = lrs("step", steps=12, per_epoch=4, warmup=1, milestones=[2])
    assert seen[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1]) and seen[8] == pytest.approx(0.01)


# ------------------------------------------------------------------------------- checkpoints

def test_prefixes_of_wrapped_models_are_stripped(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    wrapped = torch.nn.DataParallel(model)
    assert list(strip_wrapper_prefixes(wrapped.state_dict())) == list(model.state_dict())
    assert list(strip_wrapper_prefixes({"_orig_mod.module.0.weight": 1})) == ["0.weight"]

    # Every way another script may have saved it loads the same tensors.
    files = {"plain.pt": model.state_dict(), "wrapped.pth": wrapped.state_dict(),
             "nested.bin": {"state_dict": wrapped.state_dict(), "epoch": 3}}
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
        loaded = load_weights(tmp_path / name)
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items()), name


def test_save_weights_writes_a_plain_safetensors_file_with_its_metadata(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    metadata = {"model": "resnet20", "classes": ["cat", "dog"], "image_size": [32, 32], "step": 48,
                "normalization": {"mean": [125.3, 123.0, 113.9], "std": [63.0, 62.1, 66.7]}}
    save_weights(model.state_dict(), tmp_path / "model.safetensors", metadata)
    loaded = load_weights(tmp_path / "model.safetensors")
    assert set(loaded) == {"0.weight", "0.bias"}
    assert read_metadata(tmp_path / "model.safetensors") == metadata  # the values, their types too
    assert read_metadata(tmp_path / "other.pt") == {}
    assert not list(tmp_path.glob(".tmp-*"))  # nothing left behind


def test_atomic_write_leaves_the_old_file_or_the_whole_new_one(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")
    with pytest.raises(OSError), atomic_write(path) as f:
        f.write(b"half of the new")
        raise OSError("No space left on device")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with atomic_write(path) as f:
        f.write(b"new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any file of the user's: shared runs/


def write_run(folder, args, **derived):
    (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"args": args, **derived}))
    return folder / "checkpoints" / "step_00000004"


def test_resume_is_refused_for_another_experiment(tmp_path):
    checkpoint = write_run(tmp_path / "bf16", {"model": "resnet20", "mixed_precision": None}, mixed_precision="bf16",
                           classes=["a", "b"])
    same = {"args": {"model": "resnet20", "mixed_precision": None, "output_dir": "x"}, "mixed_precision": "bf16",
            "classes": ["a", "b"]}
    check_resume_config(checkpoint, same, resumable={"output_dir"})
    with pytest.raises(UserError, match="this run has --model 'resnet32' but the run in .* had --model 'resnet20'"):
        check_resume_config(checkpoint, {**same, "args": {**same["args"], "model": "resnet32"}}, {"output_dir"})
    # The precision the Accelerate config chose, not only the flag; a train_single run is fp32.
    with pytest.raises(UserError, match="trained in bf16 but this one would train in fp16"):
        check_resume_config(checkpoint, {**same, "mixed_precision": "fp16"}, {"output_dir"})
    with pytest.raises(UserError, match="trained in bf16 but this one would train in fp32"):
        check_resume_config(checkpoint, {"args": {"model": "resnet20"}, "classes": ["a", "b"]}, {"output_dir"})
    with pytest.raises(UserError, match=r"classes would be \['a', 'c'\] but the run in .* had \['a', 'b'\]"):
        check_resume_config(checkpoint, {**same, "classes": ["a", "c"]}, {"output_dir"})
    # Earlier versions of train_dp.py recorded their precision as a flag.
    old_dp = write_run(tmp_path / "dp", {"model": "resnet20", "mixed_precision": "fp16"})
    with pytest.raises(UserError, match="trained in fp16 but this one would train in fp32"):
        check_resume_config(old_dp, {"args": {"model": "resnet20"}}, set())
    check_resume_config(write_run(tmp_path / "fp32", {"model": "resnet20", "mixed_precision": "no"}),
                        {"args": {"model": "resnet20"}}, set())


def test_mixed_precision_follows_the_flag_then_the_config_then_the_hardware(monkeypatch, capsys):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert choose_mixed_precision(None) == "bf16" and choose_mixed_precision("bf16") == "bf16"  # a CPU has bf16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(UserError, match=r"^error: mixed_precision fp16 \(from the Accelerate config\) needs a GPU"):
        choose_mixed_precision(None)
    assert choose_mixed_precision("bf16") == "bf16"  # the flag wins
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    assert choose_mixed_precision(None) == "bf16"
    assert "the Accelerate config's mixed_precision fp8 is not one train_amp.py trains in" in capsys.readouterr().err
    # GPUs: by compute capability, not bf16 emulation (tests/test_gpu_ready.py)


def test_unreadable_weights_give_one_line(tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=r"--weights .*broken.safetensors: cannot read it"):
        load_weights(bad)
    with pytest.raises(UserError, match="no such file"):
        load_weights(tmp_path / "missing.pt")


def test_latest_checkpoint_ignores_unfinished_ones(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for name in ["step_00000010", "step_00000200", ".tmp-step_00000300", "step_00000030"]:
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert latest_checkpoint(tmp_path).name == "step_00000200"


# ------------------------------------------------------------------------------------ record

def test_log_line_is_one_greppable_line():
    m = {"epoch": 3, "epochs": 15, "step": 1173, "batch_size": 128, "lr": 0.05, "train_loss": 0.81234,
         "test_acc": 0.71249, "epoch_time_s": 13.21, "img_per_s": 3790.4, "data_wait_frac": 0.0123}
    assert log_line(m) == ("epoch=3/15 step=1173 batch=128 lr=0.05 train_loss=0.8123 test_acc=0.7125 "
                           "epoch_time_s=13.2 img_per_s=3790 data_wait_frac=0.012")
    json.dumps(m)  # metrics are plain JSON


@pytest.mark.parametrize("schedule", ["onecycle", "step"])
def test_warmup_as_long_as_the_run_still_works(schedule):
    for steps in (1, 2, 3, 4):  # --epochs 1 with the default warm-up, down to a 1-step epoch
        seen = lrs(schedule, steps=steps, per_epoch=steps, warmup=1)
        assert len(seen) == steps and all(0 < lr <= 0.1 for lr in seen), (steps, seen)


def test_log_line_appends_the_optional_fields_in_a_fixed_order():
    m = {"epoch": 1, "epochs": 2, "step": 10, "batch_size": 8, "lr": 0.1, "train_loss": 1.0, "test_acc": 0.5,
         "epoch_time_s": 1.0, "img_per_s": 80.0, "data_wait_frac": 0.01,
         "gpu_mem_peak_gb": [5.214, 3.0], "loss_scale": 65536.0, "skipped_steps": 2}
    assert log_line(m).endswith(" loss_scale=65536 skipped_steps=2 gpu_mem_peak_gb=5.21,3.00")


def test_channels_last_batches():
    out = BatchTransform([0, 0, 0], [1, 1, 1], channels_last=True).train(images(), seed=(0, 1))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, BatchTransform([0, 0, 0], [1, 1, 1]).train(images(), seed=(0, 1)))


def test_peak_memory_is_reported_per_process_on_gpus_only(monkeypatch):
    from common.observe.utilisation import peak_memory

    class OnCPU:
        device = torch.device("cpu")

    assert peak_memory(OnCPU()) == {}

    class OnGPU:  # two processes, as gather would return them
        device = torch.device("cuda", 0)

        def gather(self, tensor):
            return torch.cat([tensor, tensor * 2])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 1.5e9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch, "tensor", lambda values, device=None: torch.as_tensor(values))
    assert peak_memory(OnGPU()) == {"gpu_mem_peak_gb": [1.5, 3.0]}


FAULTS = """import resource, sys, torch
from common.recipe.numerics import set_numerics
if sys.argv[1] == "cpu":
    set_numerics(torch.device("cpu"), tf32=True, deterministic=False)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20); del x
before = faults()
for _ in range(20):  # a training step's activations: the same 64 MB allocated and freed again
    x = torch.ones(16 << 20); del x
print(faults() - before)
"""


def test_on_a_cpu_freed_tensor_memory_is_reused_not_faulted_in_again(tmp_path):
    """Real page faults of a fresh process: by default glibc maps a 64 MB tensor's pages anew at each
    allocation; after set_numerics on a CPU (common.recipe.numerics.keep_freed_memory) it reuses them."""
    if not keep_freed_memory(torch.device("cpu")):
        pytest.skip("not glibc: malloc's own behaviour")
    (tmp_path / "faults.py").write_text(FAULTS)
    faults = {}
    for device in ("untouched", "cpu"):
        done = subprocess.run([sys.executable, str(tmp_path / "faults.py"), device], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=True)
        faults[device] = int(done.stdout)
    # By default at least 16 of the 20 allocations are mapped anew; after, the pages are kept, and the
    # faults left (16,384 on a quiet machine, up to 49,153 under load: the kernel's own minor faults,
    # e.g. NUMA balancing's) are a quarter of that or less.
    assert faults["untouched"] >= 16 * (16 << 20) * 4 // resource.getpagesize(), faults
    assert faults["cpu"] * 4 <= faults["untouched"], faults
