"""FusedGatedProduct: ``act(gate) * up`` for gated MLPs whose projections are not Linears (a low-rank adapter
around each), against eager in outputs and every gradient, fp32 / bf16 / fp16, odd and strided layouts, the
bytes it saves, and bad arguments."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.ops import FusedGatedProduct
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, run_fwd_bwd, seeded

_ACTS = {"silu": nn.SiLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


class LowRankLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update: ``base(x) + scale * B(A(x))`` (LoRA's form)."""

    def __init__(self, n_in, n_out, rank=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Linear(n_in, n_out).requires_grad_(False)
        self.A, self.B = nn.Linear(n_in, rank, bias=False), nn.Linear(rank, n_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.2)
        self.scale = 2.0

    def forward(self, x):
        return self.base(x) + self.B(self.A(x)) * self.scale


class AdapterMLP(nn.Module):
    def __init__(self, h=12, inter=37, act="silu", product=None):
        super().__init__()
        self.gate, self.up = LowRankLinear(h, inter, seed=1), LowRankLinear(h, inter, seed=2)
        self.down = LowRankLinear(inter, h, seed=3)
        self.act, self.product = _ACTS[act](), product

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        return self.down(self.product(g, u) if self.product is not None else self.act(g) * u)


def _pair(act, dtype=torch.float32, shape=(3, 5, 12)):
    eager = AdapterMLP(shape[-1], act=act).to(dtype)
    fused = AdapterMLP(shape[-1], act=act, product=FusedGatedProduct.from_modules(_ACTS[act]())).to(dtype)
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def _trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_adapter_mlp_matches_eager_in_every_gradient(act):
    eager, fused = _pair(act)
    x = seeded(3, 5, 12, seed=4).requires_grad_(True)
    out, grads = run_fwd_bwd(fused, [x], _trainable(fused))
    ref, ref_grads = run_fwd_bwd(eager, [x], _trainable(eager))
    assert_close_dtype(out, ref)
    assert len(grads) == len(ref_grads) == 1 + 6
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_low_precision_within_eager_error(dtype, act):
    eager, fused = _pair(act, dtype)
    ref64 = _pair(act, torch.float64)[0]
    x = seeded(7, 12, seed=5, dtype=dtype).requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    out, grads = run_fwd_bwd(fused, [x], _trainable(fused))
    eag, eager_grads = run_fwd_bwd(eager, [x], _trainable(eager))
    ref, ref_grads = run_fwd_bwd(ref64, [x64], _trainable(ref64))
    assert_within_eager_error(out, eag, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_saves_gate_and_up_but_not_the_activation():
    eager, fused = _pair("silu")
    x = seeded(4, 9, 12, seed=6).requires_grad_(True)
    saved = activation_bytes(lambda: eager(x)) - activation_bytes(lambda: fused(x))
    assert saved == 4 * 9 * 37 * 4  # exactly act(gate): one (tokens, I) fp32 tensor


@pytest.mark.parametrize("layout", ["halves", "non_contiguous", "transposed", "empty", "one"])
def test_layouts_match_eager(layout):
    op = FusedGatedProduct("gelu")
    if layout == "halves":  # gate, up = proj(x).chunk(2, -1)
        gate, up = seeded(3, 7, 2 * 41, seed=1).chunk(2, -1)
    elif layout == "non_contiguous":
        gate, up = non_contiguous(seeded(5, 33, seed=1)), seeded(5, 33, seed=2)
    elif layout == "transposed":
        gate, up = seeded(6, 9, seed=1).t(), seeded(9, 6, seed=2)
    elif layout == "empty":
        gate, up = torch.empty(0, 3, 8), torch.empty(0, 3, 8)
    else:
        gate, up = torch.tensor([0.7]), torch.tensor([-1.3])
    g, u = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
    g2, u2 = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
    out, grads = run_fwd_bwd(op, [g, u])
    ref, ref_grads = run_fwd_bwd(lambda a, b: F.gelu(a) * b, [g2, u2])
    assert out.shape == ref.shape
    assert_close_dtype(out, ref)
    for got, want in zip(grads, ref_grads):
        assert_close_dtype(got, want)


def test_zero_dim_tensors():
    g, u = torch.tensor(0.7, requires_grad=True), torch.tensor(-1.3, requires_grad=True)
    out = FusedGatedProduct("silu")(g, u)
    out.backward()
    assert out.shape == () and torch.allclose(out, F.silu(torch.tensor(0.7)) * -1.3)
    g2, u2 = torch.tensor(0.7, requires_grad=True), torch.tensor(-1.3, requires_grad=True)
    (F.silu(g2) * u2).backward()
    assert torch.allclose(g.grad, g2.grad) and torch.allclose(u.grad, u2.grad)


def test_one_tensor_in_both_roles_and_one_input_without_grad():
    op = FusedGatedProduct("silu")
    x = seeded(4, 10, seed=3).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    g1 = run_fwd_bwd(op, [x, x])[1][0]  # the one leaf, listed once per argument
    (g2,) = run_fwd_bwd(lambda a: F.silu(a) * a, [x2])[1]
    assert_close_dtype(g1, g2)
    up = seeded(4, 10, seed=4)  # a constant: no gradient asked for it
    (g3,) = run_fwd_bwd(op, [x, up])[1]
    (g4,) = run_fwd_bwd(lambda a: F.silu(a) * up, [x2])[1]
    assert_close_dtype(g3, g4)


def test_bad_arguments_name_the_argument():
    op = FusedGatedProduct("silu")
    with pytest.raises(ValueError, match="act"):
        FusedGatedProduct("swish")
    with pytest.raises(TypeError, match="act"):
        FusedGatedProduct.from_modules(nn.Tanh())
    assert FusedGatedProduct.supports(nn.Tanh())[0] is False and FusedGatedProduct.supports(nn.SiLU()) == (True, "")
    with pytest.raises(ValueError, match="up"):
        op(torch.zeros(3, 4), torch.zeros(1, 4))  # no broadcasting
    with pytest.raises(TypeError, match="up"):
        op(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="gate"):
        op(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="gate"):
        op([0.0], torch.zeros(1))
