"""Fusion on models written in styles torch.fx.symbolic_trace rejects.

Each model below fails ``symbolic_trace`` as a whole (asserted), yet runs; analysis must still find every
pattern, give the right reason for every rejection, and the rewrite must be numerically equivalent with
unchanged state_dict keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import seeded

# --------------------------------------------------------------------------- model 1: data-dependent control flow


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, pool=False, padding_mode="zeros", stats=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, padding_mode=padding_mode, bias=False)
        self.bn = nn.BatchNorm2d(cout, track_running_stats=stats)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if pool else None

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        return self.pool(x) if self.pool is not None else x


class GatedCNN(nn.Module):
    """``if x.mean() > 0`` at the top level; blocks trace on their own."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBlock(3, 8, pool=True)
        self.gate_conv, self.gate_bn, self.gate_act = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU6()
        self.top_conv, self.top_bn, self.top_act = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU()
        self.reflect = ConvBlock(8, 8, padding_mode="reflect")
        self.nostats = ConvBlock(8, 8, stats=False)
        self.body = ConvBlock(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        if x.mean() > 0:
            x = x * 1.0
        x = self.gate_act(self.gate_bn(self.gate_conv(x)))
        x = self.top_act(self.top_bn(self.top_conv(x)))
        x = self.body(self.nostats(self.reflect(x)))
        return self.head(x.mean((2, 3)))


# --------------------------------------------------------------------------- model 2: **kwargs, loops, item assignment,
# dict-looked-up activations, dataclass output
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}
BY_DTYPE = {"torch.float32": F.gelu, "torch.float64": F.gelu}


class GeluWrapper(nn.Module):
    def forward(self, x):
        return F.gelu(x)


class HandAttention(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.heads, self.p = heads, p
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        probs = F.dropout((scores + mask).softmax(dim=-1), p=self.p, training=self.training)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, d))


class LookupMLP(nn.Module):
    """Activation chosen from a dict by name (fx resolves it) or by the input's dtype (fx cannot)."""

    def __init__(self, d, act, p, by_dtype=False):
        super().__init__()
        self.fc1, self.fc2, self.drop, self.act, self.by_dtype = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), \
            nn.Dropout(p), act, by_dtype

    def forward(self, x):
        act = BY_DTYPE[str(x.dtype)] if self.by_dtype else ACTIVATIONS[self.act]
        return self.fc2(self.drop(act(self.fc1(x))))


@dataclass
class MixerOutput:
    logits: torch.Tensor
    hidden: torch.Tensor


class MixerBlock(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.attn = HandAttention(d, heads, p)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(d, 2 * d), "act": GeluWrapper(), "drop": nn.Dropout(p),
                                  "fc2": nn.Linear(2 * d, d)})
        self.tanh_fc, self.tanh_act, self.tanh_out = nn.Linear(d, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)

    def forward(self, x, mask):
        h = self.attn(x, mask)
        m = self.mlp
        h = h + m["fc2"](m["drop"](m["act"](m["fc1"](h))))
        return self.tanh_out(self.tanh_act(self.tanh_fc(h)))


class TokenMixer(nn.Module):
    def __init__(self, vocab=32, d=16, heads=2, p=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = MixerBlock(d, heads, p)
        self.silu_mlp = LookupMLP(d, "silu", p)
        self.dtype_mlp = LookupMLP(d, "gelu", p, by_dtype=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, **batch):
        ids, lengths = batch["ids"], batch["lengths"]
        mask = torch.zeros(ids.shape[0], 1, 1, ids.shape[1])
        for i in range(ids.shape[0]):  # a loop over a tensor size, with item assignment
            mask[i, ..., int(lengths[i]):] = -1e4
        h = self.block(self.emb(ids), mask)
        h = self.dtype_mlp(self.silu_mlp(h))
        return MixerOutput(logits=self.head(h), hidden=h)


# --------------------------------------------------------------------------- model 3: cross attention, shared
# modules, extra consumers, a different dtype
class CrossBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, memory):
        q, k, v = self.query(x), self.key(memory), self.value(memory)
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-1)
        return torch.matmul(probs, v), probs  # the probabilities are returned too


class Probe(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.act, self.shared = nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)
        self.leaky_fc, self.leaky = nn.Linear(d, d), nn.LeakyReLU(0.1)
        self.half_fc = nn.Linear(d, d).to(torch.float64)

    def forward(self, x):
        h = self.act(self.fc(x))
        h[:, 0] = 0.0  # item assignment on the activation: a second consumer
        s = self.shared(F.gelu(self.shared(h)))  # one Linear called twice
        s = self.leaky(self.leaky_fc(s))
        return F.gelu(self.half_fc(s.double())).float()


class PlainMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CrossModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.cross, self.probe = CrossBlock(d), Probe(d)
        self.head = PlainMLP(d)  # a chain that fuses whatever the tracer reads of Probe

    def forward(self, x, memory):
        if memory.abs().sum() > 0:
            memory = memory * 0.5
        out, probs = self.cross(x, memory)
        return self.head(self.probe(out)), probs


# --------------------------------------------------------------------------- helpers
def _mixer_inputs():
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 32, (3, 7), generator=g), "lengths": torch.tensor([7, 5, 2])}


CASES = {
    "gated_cnn": (GatedCNN, lambda: (seeded(2, 3, 8, 8),)),
    "token_mixer": (TokenMixer, _mixer_inputs),
    "cross_model": (CrossModel, lambda: (seeded(2, 5, 16), seeded(2, 6, 16, seed=1))),
}


def _by_modules(plan):
    return {tuple(d.modules): d for d in plan.decisions}


def _loss(out):
    tensors = [out.logits] if isinstance(out, MixerOutput) else list(out) if isinstance(out, tuple) else [out]
    return sum((t.float() * seeded(*t.shape, seed=9)).sum() for t in tensors), tensors


def _compare(model, fused, inputs):
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    outs = []
    for m in (model, fused):
        m.zero_grad()
        loss, tensors = _loss(m(*args, **kwargs))
        loss.backward()
        outs.append(tensors)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    grads = dict(fused.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_symbolic_trace_rejects_the_whole_model(case):
    cls, make_inputs = CASES[case]
    model = cls()  # outside pytest.raises: a constructor error must not pass for a tracer error
    inputs = make_inputs()
    model(*inputs) if isinstance(inputs, tuple) else model(**inputs)  # it runs eagerly
    with pytest.raises((fx.proxy.TraceError, TypeError, RuntimeError)):
        fx.symbolic_trace(model)


def test_gated_cnn_decisions():
    torch.manual_seed(0)
    plan = ol.fusion.analyze(GatedCNN(), CASES["gated_cnn"][1]())
    d = _by_modules(plan)
    assert d[("stem.conv", "stem.bn", "stem.act", "stem.pool")].fused
    assert d[("stem.conv", "stem.bn", "stem.act", "stem.pool")].pattern == "conv_bn_relu_maxpool"
    assert d[("body.conv", "body.bn", "body.act")].fused
    assert "ReLU6" in d[("gate_conv", "gate_bn", "gate_act")].reason
    assert "padding_mode" in d[("reflect.conv", "reflect.bn", "reflect.act")].reason
    assert "track_running_stats" in d[("nostats.conv", "nostats.bn", "nostats.act")].reason
    top = d[("top_conv", "top_bn", "top_act")]  # data-dependent control flow around it: module calls carry it
    assert top.fused and top.route == "module:chain"
    assert plan.routes == []  # no chain needed a tracer


def test_token_mixer_decisions():
    plan = ol.fusion.analyze(TokenMixer(), _mixer_inputs())
    d = _by_modules(plan)
    assert d[("block.attn.q_proj", "block.attn.k_proj", "block.attn.v_proj")].fused
    att = d[("block.attn",)]
    assert att.fused and att.pattern == "attention" and att.params["scale"] == pytest.approx(8**-0.5)
    mlp = d[("block.mlp.fc1", "block.mlp.act", "block.mlp.drop", "block.mlp.fc2")]  # a wrapper computing gelu
    assert mlp.fused and mlp.pattern == "linear_gelu_dropout_linear" and mlp.route == "module:chain"
    assert d[("block.tanh_fc", "block.tanh_act", "block.tanh_out")].fused  # the op computes tanh-GELU too
    silu = d[("silu_mlp.fc1", "silu_mlp.drop", "silu_mlp.fc2")]  # F.silu through a lookup table
    assert silu.fused and silu.pattern == "linear_silu_dropout_linear" and "FusedLinearActDropoutLinear" in silu.reason
    dtype_mlp = d[("dtype_mlp.fc1", "dtype_mlp.drop", "dtype_mlp.fc2")]
    assert dtype_mlp.fused and dtype_mlp.route == "module:whole"  # its one call computes exactly the chain


def test_cross_model_decisions():
    plan = ol.fusion.analyze(CrossModel(), CASES["cross_model"][1]())
    d = _by_modules(plan)
    qkv = d[("cross.query", "cross.key", "cross.value")]
    assert not qkv.fused and "read different tensors" in qkv.reason
    att = d[("cross",)]
    assert not att.fused and "also read by `output`" in att.reason
    assert "modified in place by `probe.setitem`" in d[("probe.fc", "probe.act")].reason
    # Probe.forward traces (its item assignment is one call of the traced code), so its inline GELUs fuse there
    twice = d[("probe.shared", "probe.shared")]  # one Linear at both ends of the chain
    assert twice.fused and twice.route.startswith("fx:probe"), twice
    assert ("probe.leaky_fc", "probe.leaky") not in d  # LeakyReLU after a Linear is not a named chain
    half = d[("probe.half_fc",)]  # float64 throughout
    assert half.fused and half.route.startswith("fx:probe"), half


FUSED = {"gated_cnn": 4, "token_mixer": 6, "cross_model": 3}  # chains each rewrite replaces


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_rewrite_is_equivalent(case, mode):
    cls, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = cls() if mode == "eval" or case == "cross_model" else cls(**({"p": 0.0} if case == "token_mixer" else {}))
    getattr(model, mode)()
    inputs = make_inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused, plan = ol.fusion.fuse(model, inputs)
    assert list(fused.state_dict()) == list(model.state_dict())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)  # analysis and apply leave the model alone
    _compare(model, fused, inputs)
    for k, v in model.state_dict().items():  # running stats move the same way in train mode
        torch.testing.assert_close(fused.state_dict()[k], v, atol=1e-6, rtol=1e-5, msg=k)
    assert sum(d.fused for d in plan.decisions) == FUSED[case]
    assert sum(v["fused"] for v in plan.summary().values()) == FUSED[case]
    slots = [m for m in fused.modules() if type(m).__name__ == "FusedSlot"]
    assert ol.fusion.patches(fused) or slots  # not a mere copy: module-level patches or fx slots


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip(case):
    cls, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = cls().eval()
    fused, _ = ol.fusion.fuse(model, make_inputs())
    torch.manual_seed(1)
    other = cls().eval()
    other.load_state_dict(fused.state_dict())  # fused -> original architecture
    _compare(model, other, make_inputs())
    fused.load_state_dict(cls().state_dict())  # original architecture -> fused
    fresh = cls().eval()
    fresh.load_state_dict(fused.state_dict())
    _compare(fresh, fused, make_inputs())


def test_chain_inside_a_sequential_is_rewritten():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    fused, plan = ol.fusion.fuse(model, (seeded(2, 16),))
    assert sum(d.fused for d in plan.decisions) == 1
    _compare(model, fused, (seeded(2, 16),))
