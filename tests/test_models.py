"""common/recipe/models.py: every name trains, and each model has the shape, size and cost its source gives."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from common.errors import UserError
from common.recipe.models import BasicBlock, build_model, model_names

ALL_NAMES = model_names() + ["torchvision:resnet18", "torchvision:mobilenet_v3_small"]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("num_classes", [10, 100])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_predicts_one_logit_per_class(name, num_classes):
    with torch.no_grad():
        assert build_model(name, num_classes).eval()(torch.randn(2, 3, 32, 32)).shape == (2, num_classes)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_one_step_trains_every_parameter(name):
    torch.manual_seed(0)
    model = build_model(name, 10).train()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss = F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.randint(10, (4,)))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss)
    # Every parameter moved: the gradient reaches the stem and nothing is left out of the graph.
    assert [k for k, p in model.named_parameters() if torch.equal(p, before[k])] == []


@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet50"])
def test_cifar_stem_keeps_32x32(name):
    model = build_model(name, 10).eval()
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.padding) == ((3, 3), (1, 1), (1, 1))
    assert model.conv1.bias is None and isinstance(model.maxpool, nn.Identity)
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    assert stem(torch.randn(1, 3, 32, 32)).shape == (1, 64, 32, 32)


def test_torchvision_resnet50_keeps_imagenet_stem():
    model = build_model("torchvision:resnet50", 10).eval()
    assert (model.conv1.kernel_size, model.conv1.stride) == ((7, 7), (2, 2))
    assert isinstance(model.maxpool, nn.MaxPool2d)
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    assert stem(torch.randn(1, 3, 32, 32)).shape == (1, 64, 8, 8)


@pytest.mark.parametrize("name, depth, paper_millions", [("resnet20", 20, 0.27), ("resnet32", 32, 0.46),
                                                         ("resnet56", 56, 0.85)])
def test_cifar_resnets_match_he_et_al(name, depth, paper_millions):
    # He et al. 2016, section 4.2: 6n + 2 weighted layers; parameter counts as quoted there.
    model = build_model(name, 10)
    assert n_params(model) / 1e6 == pytest.approx(paper_millions, rel=0.02)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == depth - 1  # no shortcut convs
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 1


def test_option_a_shortcut_subsamples_and_zero_pads():
    block = BasicBlock(16, 32, stride=2).eval()
    assert all(k.startswith(("conv", "bn")) for k, _ in block.named_parameters())
    nn.init.zeros_(block.bn2.weight)  # silences the residual branch: the output is relu(shortcut)
    x = torch.randn(2, 16, 8, 8)
    expected = torch.cat([x[:, :, ::2, ::2], torch.zeros(2, 16, 4, 4)], dim=1).relu()
    torch.testing.assert_close(block(x), expected)


def test_resnet18_cifar_size_and_cost():
    model = build_model("resnet18", 10)
    # kuangliu/pytorch-cifar's ResNet18: torchvision's 11,181,642 minus the 7x7 stem's extra 7,680.
    assert n_params(model) == 11_173_962
    # 0.556 GMAC = 1.11 GFLOP forward per 32x32 image, about 3.33 GFLOP with the backward pass.
    with FlopCounterMode(display=False) as forward:
        model.eval()(torch.randn(1, 3, 32, 32))
    assert forward.get_total_flops() / 1e9 == pytest.approx(1.11, rel=0.01)
    with FlopCounterMode(display=False) as step:
        F.cross_entropy(model.train()(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
    assert step.get_total_flops() / 2 / 1e9 == pytest.approx(3.33, rel=0.01)


@pytest.mark.parametrize("name, must_mention", [
    ("resnet-18", [*model_names(), "torchvision:NAME", "list_models"]),
    ("torchvision:resnet5", ["resnet50", "list_models"]),  # closest matches, then the rule
    ("torchvision:fasterrcnn_resnet50_fpn", ["list_models"]),  # detection is not classification
    ("torchvision:", ["list_models"]),
])
def test_bad_name_is_a_one_line_user_error(name, must_mention):
    with pytest.raises(UserError) as error:
        build_model(name, 10)
    message = error.value.message
    assert repr(name.removeprefix("torchvision:")) in message and "\n" not in message
    assert [word for word in must_mention if word not in message] == []


@pytest.mark.parametrize("name", ALL_NAMES)
def test_state_dict_is_plain_and_reloads(name):
    state = build_model(name, 10).state_dict()
    assert [k for k in state if k.startswith(("module.", "_orig_mod."))] == []
    build_model(name, 10).load_state_dict(state)  # strict: a checkpoint loads into a fresh model


@pytest.mark.parametrize("name, size", [("torchvision:googlenet", 32), ("torchvision:inception_v3", 75)])
def test_models_with_auxiliary_heads_train_on_logits(name, size):
    model = build_model(name, 10, size).train()
    logits = model(torch.randn(2, 3, size, size))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 10)
    F.cross_entropy(logits, torch.tensor([0, 1])).backward()
    assert all(p.grad is not None for p in model.parameters())  # no head left out of the graph


ADVICE_RUN = set()  # the (model, size) pairs whose advised size a real forward has shown to work


@pytest.mark.parametrize("name, size, message", [
    ("torchvision:vit_b_16", 32, "takes 224x224 images only, not 32x32"),
    ("torchvision:vit_b_16", 256, "takes 224x224 images only, not 256x256"),
    ("torchvision:inception_v3", 32, "needs images of at least 75x75, not 32x32"),
    ("torchvision:alexnet", 32, "needs images of at least 63x63, not 32x32"),
    ("torchvision:maxvit_t", 32, "takes images from 221x221 to 224x224 only, not 32x32"),
])
def test_a_size_the_model_cannot_take_is_refused_with_the_size_it_needs(name, size, message):
    with pytest.raises(UserError) as error:
        build_model(name, 10, size)
    assert error.value.message.startswith(f"--model {name} {message} (")
    assert "\n" not in error.value.message
    fix = int(re.search(r"pass --image-size (\d+)", error.value.message).group(1))
    model = build_model(name, 10, fix).eval()  # the advice works: the size check passes ...
    if (name, fix) not in ADVICE_RUN:  # ... and a real forward too (seconds at 224 px: once a model and size)
        with torch.no_grad():
            assert model(torch.zeros(1, 3, fix, fix)).shape == (1, 10)
        ADVICE_RUN.add((name, fix))


# RegNet computes its widths from the values of tensors as it is built (torch.arange(...).tolist()):
# a probe built on the meta device, which holds no values, fails there.
@pytest.mark.parametrize("name", ["resnet20", "torchvision:mobilenet_v3_small", "torchvision:regnet_y_400mf"])
def test_checking_the_size_changes_neither_the_weights_nor_the_random_numbers(name):
    torch.manual_seed(0)
    unchecked, after_unchecked = build_model(name, 10).state_dict(), torch.rand(3)
    torch.manual_seed(0)
    checked, after_checked = build_model(name, 10, 32).state_dict(), torch.rand(3)
    assert all(torch.equal(unchecked[k], checked[k]) for k in unchecked)
    assert torch.equal(after_unchecked, after_checked)
