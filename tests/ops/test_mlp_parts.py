import math

import pytest
import torch
from torch import nn

from opsnn_lab.ops import _mlp_parts as parts


# Stand-ins with the class names and maths of Hugging Face's Conv1D and ACT2FN modules (no transformers import).
class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D: weight [in, out], y = x @ W + b
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


class NewGELUActivation(nn.Module):  # GPT-2's gelu_new
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGELUActivation(nn.Module):  # CLIP
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class GELUActivation(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x)


class SiLUActivation(nn.Module):
    def forward(self, x):
        return nn.functional.silu(x)


class Swish(nn.Module):  # unknown class name: recognised by behaviour
    def forward(self, x):
        return x * torch.sigmoid(x)


class ImpostorGELU(NewGELUActivation):
    def forward(self, x):  # an HF class name computing something else must be refused
        return nn.functional.gelu(x)


ImpostorGELU.__name__ = "NewGELUActivation"


@pytest.mark.parametrize("module, name", [
    (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"), (nn.SiLU(), "silu"),
    (nn.ReLU(inplace=True), "relu"), (GELUActivation(), "gelu"), (NewGELUActivation(), "gelu_tanh"),
    (QuickGELUActivation(), "quick_gelu"), (SiLUActivation(), "silu"), (Swish(), "silu"),
])
def test_recognised_activations(module, name):
    assert parts.activation_name(module) == (name, "")


@pytest.mark.parametrize("module, words", [
    (nn.Tanh(), "not one of"), (nn.PReLU(), "parameters"), (ImpostorGELU(), "does not compute gelu_tanh"),
    (nn.Linear(3, 3), "parameters"), (torch.relu, "nn.Module"), (nn.Identity(), "not one of"),
])
def test_refused_activations_say_why(module, words):
    name, why = parts.activation_name(module)
    assert name is None and words in why


@pytest.mark.slow  # importing transformers takes 10-25 s on the CI machine
def test_hf_activation_classes_are_recognised():
    act2fn = pytest.importorskip("transformers.activations").ACT2FN
    expected = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu", "relu": "relu", "gelu_python": "gelu"}
    for key, name in expected.items():
        assert parts.activation_name(act2fn[key]) == (name, ""), key
    for key in ("mish", "gelu_10", "relu6", "tanh"):
        assert parts.activation_name(act2fn[key])[0] is None, key


def test_linear_layouts():
    assert parts.linear_layout(nn.Linear(3, 4)) == (False, "")
    assert parts.linear_layout(Conv1D(4, 3)) == (True, "")
    fake = Conv1D(4, 3)
    fake.nf = 5  # attributes that disagree with the weight: not the HF layer
    assert parts.linear_layout(fake)[0] is None
    assert "neither" in parts.linear_layout(nn.Conv1d(3, 4, 1))[1]
    conv = Conv1D(4, 3)
    x = torch.randn(2, 3)
    torch.testing.assert_close(parts.linear2d(x, conv.weight, conv.bias, True), conv(x))
    assert parts.features(conv.weight, True) == (3, 4)
