"""--compile-mode: a CUDA-graph mode runs on a CPU (Inductor's CPU code, no graphs) and trains as eager
does; what the CUDA graphs need of the loop holds: a schedule recompiles nothing, evaluation's last,
smaller batch is one more graph. The refusals (other backends, --grad-accum) are in test_bad_input.py;
the mode on a GPU, with CUDA graphs, in test_gpu.py."""


import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch._dynamo.utils import counters

from common.recipe.compiling import compile_line, compile_plugin


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

    accelerator = Accelerator(cpu=True, dynamo_plugin=compile_plugin("inductor", "reduce-overhead"))
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


def test_the_start_line_says_what_the_mode_does_on_the_device():
    assert compile_line(None, "default", "cpu") is None
    assert compile_line("inductor", "reduce-overhead", "cpu") == (
        "--compile inductor --compile-mode reduce-overhead: no CUDA graphs on cpu: Inductor compiles its cpu "
        "code as in --compile-mode default")
    assert compile_line("inductor", "max-autotune", "cpu").endswith("as in --compile-mode max-autotune-no-cudagraphs")
    assert compile_line("inductor", "reduce-overhead", "cuda:0") == (
        "--compile inductor --compile-mode reduce-overhead: the model compiled at its first step and first "
        "evaluation, its steps replayed as CUDA graphs")
    assert compile_plugin(None).backend.value == "NO"  # no compiling, whatever the Accelerate config says
    assert compile_plugin("inductor").to_kwargs() == {"backend": "inductor"}  # default mode, shapes left to dynamo
