"""--compile and --compile-mode: auto chooses CUDA graphs on a GPU only, says so and why; the compiler's
cache goes beside the run folders; a model that fails to compile stops in one line whose advice trains it.
A CUDA-graph mode runs on a CPU (Inductor's CPU code, no graphs) and trains as eager does; what the CUDA
graphs need of the loop holds: a schedule recompiles nothing, evaluation's last, smaller batch is one more
graph. The refusals (other backends, --grad-accum) are in test_bad_input.py; the mode on a GPU, with CUDA
graphs, in test_gpu.py."""


import argparse
import getpass
import json
import os
import pickle
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import TorchDynamoPlugin
from helpers import DATA, ROOT, run, weights
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.utils._triton import has_triton_package

from common.errors import UserError
from common.parallel.data_parallel import check_compile_flag
from common.recipe import compiling
from common.recipe.compiling import chosen, compile_line, set_up_compiling, triton_cannot_build

# two steps of the smallest model, in a new run folder under the working directory's runs/
TINY_RUN = [*DATA, "--model", "resnet20", "--batch-size", "16", "--epochs", "1", "--max-steps", "2",
            "--report-to", "none"]


@pytest.fixture
def fresh_state():
    """Accelerate keeps one state per process: a test's Accelerator gets its own plugin."""
    AcceleratorState._reset_state(True)
    torch._dynamo.reset()
    yield
    AcceleratorState._reset_state(True)
    torch._dynamo.reset()


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))


def train(model, optimizer, scheduler, batches, graphs_after_each=None):
    losses = []
    for images, labels in batches:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        scheduler.step()  # a new lr every step
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if graphs_after_each is not None:
            graphs_after_each.append(counters["stats"]["unique_graphs"])
    return losses


def test_reduce_overhead_on_a_cpu_trains_as_eager_and_a_schedule_recompiles_nothing(fresh_state):
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3, 12, 12, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(4)]
    test = torch.randn(21, 3, 12, 12, generator=generator)  # evaluated in batches of 16 and 5

    def optimizer_and_schedule(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=4)

    eager = small_model()
    reference = train(eager, *optimizer_and_schedule(eager), batches)

    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode="reduce-overhead",
                                                                        dynamic=False))
    assert accelerator.state.dynamo_plugin.to_kwargs() == {"backend": "inductor", "mode": "reduce-overhead", "dynamic": False}
    model = small_model()
    model, optimizer, scheduler = accelerator.prepare(model, *optimizer_and_schedule(model))
    graphs = []
    losses = train(model, optimizer, scheduler, batches, graphs)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 4, graphs  # the lr changed 4 times, no graph was added
    for name, value in model._orig_mod.state_dict().items():
        torch.testing.assert_close(value.float(), eager.state_dict()[name].float(), rtol=1e-4, atol=1e-5)

    model.eval()
    eager.eval()
    with torch.no_grad():
        for images in test.split(16):  # the last batch smaller: one more graph, the same answers
            torch.testing.assert_close(model(images), eager(images), rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs[0] + 2  # evaluation: batch 16, then 5


def flags(compile="auto", mode="default", grad_accum=1, deterministic=False, output_dir=None, profile=None):
    return argparse.Namespace(compile=compile, compile_mode=mode, grad_accum=grad_accum,
                              deterministic=deterministic, output_dir=output_dir, profile=profile)


OLD_GPU = "compute capability 6.1; Triton needs 7.0 or more"


@pytest.mark.parametrize("given, cannot, model_is, processes, expected", [
    (flags(), "no GPU", "whole", 1, ("no", "default")),  # a CPU run stays eager
    (flags(), None, "whole", 1, ("inductor", "reduce-overhead")),  # one process on a GPU: CUDA graphs
    (flags(), OLD_GPU, "whole", 1, ("no", "default")),  # a GPU Inductor cannot compile for
    (flags(profile="5"), None, "whole", 1, ("no", "default")),  # a trace of CUDA graphs shows no layers
    (flags(grad_accum=2), None, "whole", 1, ("inductor", "default")),  # no graphs with accumulation
    (flags(deterministic=True), None, "whole", 1, ("no", "default")),  # eager's kernels
    (flags(), None, "whole", 2, ("no", "default")),  # DDP: BatchNorm makes Inductor skip the graphs
    (flags(), None, "replicas", 1, ("no", "default")),  # DataParallel
    (flags(), None, "shards", 2, ("no", "default")),  # FSDP2
    (flags("none"), None, "whole", 1, ("no", "default")),  # the old behaviour, asked for
    (flags("inductor", "max-autotune"), "no GPU", "whole", 1, ("inductor", "max-autotune")),  # as given
    (flags("inductor", "reduce-overhead"), OLD_GPU, "whole", 4, ("inductor", "reduce-overhead")),
    (flags("aot_eager"), None, "shards", 2, ("aot_eager", "default")),
])
def test_auto_compiles_with_cuda_graphs_for_one_process_on_a_gpu_only(given, cannot, model_is, processes, expected):
    assert chosen(given, cannot, model_is, processes) == expected


def test_auto_knows_when_triton_cannot_build_its_launcher(monkeypatch, tmp_path):
    """Triton's kernels need Triton and a C compiler at run time, found as Triton finds it (CC, else gcc,
    else clang) and tried for real: none on PATH, one that fails, Python's headers missing, Triton not
    importable; this machine's own gcc works."""
    assert triton_cannot_build() is None
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without gcc or clang
    assert triton_cannot_build() == "no C compiler for Triton's launcher: install gcc, or name one in CC"
    monkeypatch.setenv("CC", "/bin/false")
    assert triton_cannot_build() == "the C compiler /bin/false fails (exit 1): install gcc, or name one in CC"
    monkeypatch.setenv("CC", "/usr/bin/gcc")
    monkeypatch.setattr(compiling.sysconfig, "get_paths", lambda scheme: {"include": str(tmp_path)})
    assert re.fullmatch(r"the C compiler /usr/bin/gcc fails \(.*Python\.h.*\): install gcc, or name one in CC",
                        triton_cannot_build())
    monkeypatch.setitem(sys.modules, "triton", None)  # as Python sees a package that is not installed
    has_triton_package.cache_clear()  # torch asks once a process
    try:
        assert triton_cannot_build() == "Triton is not installed: torch's wheels for Linux bring it"
    finally:
        monkeypatch.undo()
        has_triton_package.cache_clear()
    assert triton_cannot_build() is None


def test_the_start_line_says_what_was_chosen_and_why(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor-k3j9x2f1")
    assert compile_line({"compile": "none"}, "cuda:0", "no", "default") is None
    assert compile_line({"compile": "auto"}, "cpu", "no", "default") == (
        "--compile auto: eager (no GPU); --compile inductor compiles")
    monkeypatch.setattr(compiling, "why_eager_here", lambda: None)
    assert compile_line({"compile": "auto"}, "cuda:0", "no", "default") == (
        "--compile auto: eager (CUDA graphs only for one process training a whole model, without --deterministic "
        "or --profile); --compile inductor compiles")
    monkeypatch.setattr(compiling, "why_eager_here", lambda: OLD_GPU)
    assert compile_line({"compile": "auto"}, "cuda:0", "no", "default") == (
        f"--compile auto: eager ({OLD_GPU}); --compile inductor compiles")
    assert compile_line({"compile": "auto"}, "cuda:0", "inductor", "reduce-overhead") == (
        "--compile auto: the model compiled at its first step and first evaluation, its steps replayed as CUDA "
        "graphs; cached in /tmp/torchinductor-k3j9x2f1; auto: a small model's step waits on kernel launches; "
        "--compile none for eager")
    assert compile_line({"compile": "inductor"}, "cpu", "inductor", "reduce-overhead") == (
        "--compile inductor --compile-mode reduce-overhead: no CUDA graphs on cpu: Inductor compiles its cpu "
        "code as in --compile-mode default; cached in /tmp/torchinductor-k3j9x2f1")
    assert compile_line({"compile": "inductor"}, "cpu", "inductor", "max-autotune").endswith(
        "as in --compile-mode max-autotune-no-cudagraphs; cached in /tmp/torchinductor-k3j9x2f1")


def test_each_process_compiles_into_a_cache_of_its_own_unless_the_user_chose_one(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # set_up_compiling installs its own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temporary folder, as TMPDIR names it
    torch_default = default_cache_dir()  # /tmp/torchinductor_<user>: importing torch._dynamo sets it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert set_up_compiling(flags("none")).backend.value == "NO"  # eager: nothing changed
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torch_default
    plugin = set_up_compiling(flags("inductor", output_dir=str(tmp_path / "runs" / "mine")))
    assert plugin.to_kwargs() == {"backend": "inductor"}  # default mode, shapes left to dynamo
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert cache.parent == tmp_path and cache.name.startswith("torchinductor-") and not any(cache.iterdir())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and cache.stat().st_uid == os.geteuid()
    assert os.environ["TRITON_CACHE_DIR"] == str(cache / "triton")  # not ~/.triton
    assert not (tmp_path / "runs" / ".compile-cache").exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default)  # the next process: a new folder
    set_up_compiling(flags("inductor"))
    again = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert again.parent == tmp_path and again != cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # the user's
    assert set_up_compiling(flags("inductor", "reduce-overhead")).to_kwargs() == {
        "backend": "inductor", "mode": "reduce-overhead", "dynamic": False}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=r"--compile inductor: not offered with DataParallel .*: use train_ddp.py"):
        check_compile_flag("inductor")


class Payload:
    """A pickle that runs a shell command as it is loaded, as one planted in a cache would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_compiler_cache_someone_planted_never_runs(tmp_path):
    """A real cache (one compile into the folder TORCHINDUCTOR_CACHE_DIR names), each AOTAutograd and FX graph
    entry replaced by a payload: planted where runs once kept the cache (runs/.compile-cache) and where torch
    keeps it by default (torchinductor_<user> in the temporary folder), a default run never reads it: it
    compiles into a folder of its own, gone at exit, and trains. A run pointed at the cache runs the payload:
    the plant is real."""
    marker, planted, tmp = tmp_path / "MARKER", tmp_path / "planted", tmp_path / "tmp"
    # timm's smallest ResNet compiles in 2/3 of resnet20's time; evaluation in whole batches: 2 graphs
    compiled = [*TINY_RUN, "--model", "timm:test_resnet", "--synthetic-test-size", "64", "--compile"]
    run("train_single.py", *compiled, cwd=tmp_path, env_extra={"TORCHINDUCTOR_CACHE_DIR": str(planted)})
    entries = [path for kind in ("aotautograd", "fxgraph") for path in (planted / kind).rglob("*") if path.is_file()]
    assert len(entries) >= 2
    for entry in entries:
        entry.write_bytes(pickle.dumps(Payload(marker)))
    for where in (tmp / f"torchinductor_{getpass.getuser()}", tmp_path / "runs" / ".compile-cache"):
        shutil.copytree(planted, where)
    done = run("train_single.py", *compiled, cwd=tmp_path, env_extra={"TMPDIR": str(tmp)})
    assert "done: step 2" in done.stdout and not marker.exists(), done.stderr
    config = json.loads((tmp_path / re.search(r"weights in (\S+)/model.safetensors", done.stdout)[1]
                         / "config.json").read_text())
    own = Path(re.search(r"cached in (\S+)$", config["compile"])[1])
    assert own.parent == tmp and own.name.startswith("torchinductor-") and not own.exists()
    pointed = run("train_single.py", *compiled, cwd=tmp_path, env_extra={"TORCHINDUCTOR_CACHE_DIR": str(planted)},
                  check=False)
    assert marker.exists(), pointed.stderr


def test_a_model_that_fails_to_compile_stops_in_one_line_and_its_advice_trains_it(tmp_path):
    """A real compiler failure (Inductor's C++ compiler is /bin/false): one line naming --compile none, exit
    1, the run's cache beside its folder; the same command with --compile none, as the line says, trains."""
    command = [*TINY_RUN, "--compile"]
    failed = run("train_single.py", *command, cwd=tmp_path, env_extra={"CXX": "/bin/false"}, check=False)
    assert failed.returncode == 1, failed.stderr
    last = re.split(r"[\r\n]", failed.stderr.strip())[-1].strip()  # after the progress bar's clearing
    assert re.fullmatch(r"error: --compile inductor could not compile the model \(InductorError: "
                        r"InvalidCxxCompiler: .*\): --compile none trains it without compiling", last), last
    assert "Traceback" not in failed.stderr
    config = json.loads(next((tmp_path / "runs").glob("train_single-*/config.json")).read_text())
    assert not Path(re.search(r"cached in (\S+)$", config["compile"])[1]).exists()  # the run's own, removed
    advice = re.search(r"(--compile none)", last).group(1).split()
    done = run("train_single.py", *command, *advice, cwd=tmp_path, env_extra={"CXX": "/bin/false"})
    assert "done: step 2" in done.stdout
    assert "--compile" not in done.stdout.split("\n")[1]  # an eager run asked for says nothing of compiling
    # The default, on a machine where auto compiles (tests/probe_ready_gpu.py): one warning for the run's
    # graphs (training, evaluation), no traceback, and the weights of the eager run above, bit for bit
    auto = run("train_single.py", *TINY_RUN, cwd=tmp_path, env_extra={"CXX": "/bin/false"},
               launcher=(sys.executable, str(ROOT / "tests" / "probe_ready_gpu.py")))
    assert "done: step 2" in auto.stdout and "Traceback" not in auto.stderr, auto.stderr
    warned = re.findall(r"(?:warning|error): [^\r\n]*", auto.stderr)  # the bar's line may come first
    assert len(warned) == 1 and re.fullmatch(
        r"warning: --compile auto could not compile the model \(InductorError: InvalidCxxCompiler: .*\): it trains "
        r"eagerly; --compile none skips the attempt", warned[0]), warned
    trained = [weights(tmp_path / re.search(r"weights in (\S+)/model.safetensors", d.stdout)[1]) for d in (done, auto)]
    assert trained[0].keys() == trained[1].keys() and all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
