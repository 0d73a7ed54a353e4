"""The pattern table on small hand-written models: each form matches, each rejection says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.patterns import FAMILIES, PATTERNS, find_all, pattern_of
from opsnn_lab.fusion.runtime import trace_runtime
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


def _matches(model, *inputs):
    return find_all(trace_runtime(model, inputs).graph)


class Attn(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, q, k, v, mask):
        kt = {"no_transpose": lambda: k.permute(0, 1, 3, 2), "mT": lambda: k.mT}.get(self.variant,
                                                                                    lambda: k.transpose(-1, -2))()
        s = q @ kt
        s = 0.5 * s if self.variant != "div" else s / 4.0
        s = mask + s
        if self.variant == "cast_back":  # Llama's eager code: the softmax in fp32, cast back to the query's dtype
            p = s.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            p = s.softmax(dim=-1 if self.variant != "dim2" else 2)
        out = p @ v
        if self.variant == "probs_read":
            return out + p.sum(-1, keepdim=True)
        return {"scores_out": (out, s), "probs_out": (out, p)}.get(self.variant, out)


@pytest.mark.parametrize("variant, ok, why", [
    ("plain", True, "fused"),
    ("div", True, "fused"),
    ("dim2", False, "softmax over dim 2"),
    ("mT", True, "fused"),
    ("no_transpose", False, "is `permute`, not a transpose"),
    ("scores_out", False, "also read by `output`"),
    ("probs_out", False, "also read by `output`"),  # the model returns its weights: a loss may use them
    ("probs_read", False, "also read by `sum`"),
])
def test_attention_forms(variant, ok, why):
    q, k, v = (seeded(2, 3, 5, 4, seed=i) for i in range(3))
    mask = seeded(2, 1, 5, 5, seed=3)
    (m,) = [m for m in _matches(Attn(variant), q, k, v, mask) if m.pattern == "attention"]
    assert m.ok is ok and why in m.reason
    if ok:
        assert m.params["scale"] == (0.25 if variant == "div" else 0.5) and m.params["dropout_p"] == 0.0
        assert len(m.inputs) == 4  # q, k (before its transpose), v, mask
        assert "return_probs" not in m.params and len(m.outputs) == 1


class Siblings(nn.Module):
    def __init__(self, bias_v=True, n=3):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4, bias=(i < 2 or bias_v)) for i in range(n))

    def forward(self, x):
        return [lin(x) for lin in self.lins]


def test_qkv_siblings_and_bias_mismatch():
    (m,) = _matches(Siblings(), seeded(2, 4))
    assert m.pattern == "qkv" and m.ok and m.modules == ["lins.0", "lins.1", "lins.2"]
    (m,) = _matches(Siblings(bias_v=False), seeded(2, 4))
    assert not m.ok and ("bias" in m.reason)
    assert _matches(Siblings(n=4), seeded(2, 4)) == []  # four siblings: not the QKV shape


def test_overlapping_candidates_and_switches():
    stack = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    first, second = _matches(stack, seeded(2, 4))
    assert first.ok and first.pattern == "linear_gelu_linear" and first.modules == ["0", "1", "2"]
    assert not second.ok and "overlaps the fused linear_gelu_linear" in second.reason
    assert second.viable  # it would fuse on its own
    off = find_all(trace_runtime(stack, (seeded(2, 4),)).graph, enabled=["qkv"])
    assert all("switched off" in m.reason for m in off)


def test_table_rows():
    assert FAMILIES == ("conv_bn_relu", "conv_act_conv", "gated_mlp", "gated_product", "linear_gelu_dropout",
                        "dropout_linear", "attention", "qkv", "add_layer_norm", "add_rms_norm", "layer_norm",
                        "rms_norm", "group_norm_act", "instance_norm_act", "linear_cross_entropy")
    assert pattern_of("linear_cross_entropy").op == "FusedLinearCrossEntropy"
    assert pattern_of("group_norm_silu").op == "FusedGroupNormAct"
    assert pattern_of("instance_norm_leaky_relu").op == "FusedInstanceNormAct"
    assert pattern_of("gated_product_gelu_tanh").op == "FusedGatedProduct"
    assert pattern_of("dropout_linear").op == "FusedDropoutLinear"
    assert pattern_of("add_rms_norm").op == "FusedAddRMSNorm" and pattern_of("rms_norm").op == "FusedRMSNorm"
    assert pattern_of("conv_bn_relu_maxpool") is PATTERNS[0] and pattern_of("gated_mlp_silu") is PATTERNS[2]
    assert pattern_of("linear_gelu_dropout_linear").op == "FusedLinearGELUDropout"
    assert pattern_of("conv_silu_dropout_conv").op == "FusedConvActDropoutConv"
    assert all(callable(p.find) and callable(p.build) and p.chain for p in PATTERNS)


def test_conv_output_read_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(self.bn(y)) + y

    (m,) = _matches(Twice(), seeded(2, 3, 4, 4))
    assert not m.ok and "the output of `conv` is also read by `add`" in m.reason
    assert m.pattern.startswith("conv_bn_relu") and list(m.modules)[:2] == ["conv", "bn"]


@pytest.mark.parametrize("act, pattern", [
    (nn.GELU(approximate="tanh"), "conv_bn_gelu_tanh"), (nn.GELU(), "conv_bn_gelu"),
    (nn.LeakyReLU(0.2), "conv_bn_leaky_relu"), (nn.Mish(), "conv_bn_mish"), (nn.ELU(), "conv_bn_elu"),
    (nn.ELU(alpha=0.5), None), (nn.Sigmoid(), None)])
def test_conv_bn_activation_rows_and_the_ones_the_op_does_not_compute(act, pattern):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), act, nn.Conv2d(4, 2, 1)).double()
    x = seeded(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = plan.decisions
    if pattern is None and isinstance(act, nn.ELU):  # the kernels compute ELU at alpha 1
        assert not d.fused and d.pattern == "conv_bn_elu" and "act (ELU) has alpha=0.5" in d.reason
        return
    if pattern is None:  # an activation, named as one, with the list the fused op computes
        assert not d.fused and "an activation FusedConvBNAct does not compute (it computes elu, gelu, gelu_tanh" in \
            d.reason
        return
    assert d.fused and d.pattern == pattern
    for mode in (True, False):
        model.train(mode)
        fused.train(mode)
        want = model(x)
        (gx_want,) = torch.autograd.grad(want.sin().sum(), x)
        got = fused(x)
        (gx_got,) = torch.autograd.grad(got.sin().sum(), x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)


def _attention_inputs(tokens: int = 12):
    """q, k, v (2 x 3 heads x ``tokens`` x 4, requiring grad) and an additive mask: more tokens than head
    features, where the probabilities (tokens^2 a head) outweigh what the fused core keeps instead."""
    return tuple(seeded(2, 3, tokens, 4, seed=i, requires_grad=True) for i in range(3)) + \
        (seeded(2, 1, tokens, tokens, seed=3),)


@pytest.mark.parametrize("variant", ["plain", "div", "mT"])
def test_attention_forms_rewrite_equivalently(variant):
    inputs = _attention_inputs()
    model = Attn(variant)
    fused, plan = ol.fusion.fuse(model, inputs)
    assert plan.summary() == {"attention": {"fused": 1, "rejected": 0}}
    torch.testing.assert_close(fused(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(m(*inputs).sum(), inputs[:3]) for m in (model, fused)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_a_bool_mask_added_to_the_scores_adds_one_where_true_as_the_code_does():
    """``scores + mask`` with a bool mask adds 1.0 where True (a BERT text backbone given a 4-d bool mask, as Grounding
    DINO passes it); SDPA's bool mask means keep / discard. The fused core took the second reading (train 0.9 off)."""
    q, k, v, _ = _attention_inputs()
    mask = torch.eye(12, dtype=torch.bool).expand(2, 1, 12, 12).contiguous()
    model = Attn("plain")
    fused, plan = ol.fusion.fuse(model, (q, k, v, mask))
    (d,) = [d for d in plan.decisions if d.pattern == "attention"]
    assert d.fused and d.params.get("mask_added") is True, d.reason
    want, got = model(q, k, v, mask), fused(q, k, v, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (want, got)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


class DropsTheWeights(nn.Module):
    """Eager attention code returning its weights to a caller that drops them (a Hugging Face layer without
    output_attentions); the root's data-dependent branch makes ``attn`` the region fx rewrites."""

    def __init__(self):
        super().__init__()
        self.attn = Attn("probs_out")

    def forward(self, q, k, v, mask):
        if mask.sum() > 1e9:
            mask = mask * 0.5
        out, _ = self.attn(q, k, v, mask)
        return out


def test_weights_a_region_returns_and_its_caller_drops_are_returned_by_the_fused_op():
    inputs = _attention_inputs()
    model = DropsTheWeights()
    fused, plan = ol.fusion.fuse(model, inputs)
    assert plan.summary() == {"attention": {"fused": 1, "rejected": 0}}
    (op,) = [m.op for m in fused.modules() if type(getattr(m, "op", None)).__name__ == "FusedAttention"]
    assert op.return_probs
    # costed as that variant, which saves neither its output nor the row statistics (the probabilities are
    # recomputed in backward), so the plan's figure is what a step saves (the SDPA variant's cost left them in)
    eager, fused_bytes = (activation_bytes(lambda m=m: m(*inputs)) for m in (model, fused))
    assert plan.saved_bytes == eager - fused_bytes > 0
    torch.testing.assert_close(fused(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(m(*inputs).sum(), inputs[:3]) for m in (model, fused)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    out, probs = fused.attn(*inputs)  # the region called for its weights: eager's, for reading
    torch.testing.assert_close(probs, model.attn(*inputs)[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="for reading only"):  # a loss on them: refused, never wrong gradients
        (out.sum() + probs.square().sum()).backward()


class CastsBack(nn.Module):
    """The root's data-dependent branch makes ``attn``, which casts its probabilities back, the fx region."""

    def __init__(self):
        super().__init__()
        self.attn = Attn("cast_back")

    def forward(self, q, k, v, mask):
        if mask.sum() > 1e9:
            mask = mask * 0.5
        return self.attn(q, k, v, mask)


def test_probabilities_cast_back_to_the_querys_dtype_are_part_of_the_fused_core():
    inputs = _attention_inputs()
    model = CastsBack()
    fused, plan = ol.fusion.fuse(model, inputs)
    (d,) = plan.decisions
    assert (d.pattern, d.fused, d.route) == ("attention", True, "fx:attn"), d.reason
    (op,) = [m.op for m in fused.modules() if type(getattr(m, "op", None)).__name__ == "FusedAttention"]
    assert op.fp32_softmax  # the code's softmax(..., dtype=torch.float32): the op keeps it
    torch.testing.assert_close(fused(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(m(*inputs).sum(), inputs[:3]) for m in (model, fused)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


class ParallelBlock(nn.Module):
    """GPT-J's and Phi's parallel block: one norm output read by q, k, v and the MLP's first Linear."""

    def __init__(self, names=("q_proj", "k_proj", "v_proj", "fc_in"), sdpa=False, fourth_in_attention=False):
        super().__init__()
        self.ln, self.names, self.sdpa, self.mixed = nn.LayerNorm(16), names, sdpa, fourth_in_attention
        for name in names:
            self.add_module(name, nn.Linear(16, 16, bias=name == names[3]))  # q/k/v without a bias, as in GPT-J

    def forward(self, x):
        h = self.ln(x)
        q, k, v, fc = (getattr(self, n)(h) for n in self.names)
        if self.mixed:  # the fourth Linear feeds the attention too: no triple to pick
            v = v + fc
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
        return x + a + F.gelu(fc) if not self.mixed else x + a


def _fwd_bwd(model, x):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y.double() * 1.7).sin().sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters())]


@pytest.mark.parametrize("names, sdpa", [
    (("q_proj", "k_proj", "v_proj", "fc_in"), False),  # picked by name
    (("query", "key", "value", "dense_h_to_4h"), True),
    (("w0", "w1", "w2", "w3"), False),  # unnamed: the three feeding the attention
    (("a", "b", "c", "mlp_in"), True),
])
def test_qkv_is_picked_among_four_readers_and_the_fourth_is_left_alone(names, sdpa):
    torch.manual_seed(0)
    model, x = ParallelBlock(names, sdpa), seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern == "qkv"]
    assert d.fused and d.modules == list(names[:3]) and d.route == "module:qkv", d.reason
    head, _, more = d.reason.partition("; keeps ")
    assert head == f"fused: {' -> '.join(f'{n} (Linear)' for n in names[:3])} into FusedQKV"
    assert bool(more) == sdpa  # SDPA saves v, a view of the one q/k/v buffer: the whole buffer stays alive
    assert names[3] not in ol.fusion.patches(fused)  # the MLP's Linear runs as it did
    for a, b in zip(_fwd_bwd(model, x), _fwd_bwd(fused, x)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_four_readers_with_no_triple_to_pick_say_so():
    torch.manual_seed(0)
    names = ("w0", "w1", "w2", "w3")
    plan = ol.fusion.analyze(ParallelBlock(names, fourth_in_attention=True), seeded(2, 5, 16))
    (d,) = [d for d in plan.decisions if d.pattern == "qkv"]
    assert not d.fused and d.modules == list(names)
    assert d.reason == ("4 Linear layers read `ln` (`w0`, `w1`, `w2`, `w3`); no three of them are named q/k/v, "
                        "and 4 (not 3) feed an attention")


class _TableReader(nn.Module):
    """Chains whose input is a parameter or buffer (Swin-v2's position-bias MLP reads a coordinate table)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("table", seeded(9, 8, seed=1))
        self.p = nn.Parameter(seeded(5, 8, seed=2))
        self.img = nn.Parameter(seeded(1, 3, 6, 6, seed=3))
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.ln = nn.LayerNorm(8)
        self.cbr = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        if self.kind == "mlp":
            return x + self.mlp(self.table).sum()
        if self.kind == "norm":
            return x + self.ln(self.p).sum()
        return x + self.cbr(self.img).sum()


@pytest.mark.parametrize("kind, head", [("mlp", "mlp.0"), ("norm", "ln"), ("conv", "cbr.0")])
def test_a_chain_reading_a_parameter_or_buffer_is_refused_with_the_reason(kind, head):
    model = _TableReader(kind).double()
    x = seeded(5, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (x,))  # raised TypeError in the cost model before
    (d,) = plan.decisions
    assert not d.fused and d.reason.startswith(f"`{head}` reads a parameter or buffer")
    torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)


class _PerHeadNorm(nn.Module):
    """StableLM's qk LayerNorm: one LayerNorm per head, each on a strided slice of the projection."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 4)
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))

    def forward(self, x):
        q = self.q(x).view(*x.shape[:-1], 4, 4)
        return self.o(torch.stack([n(q[..., i, :]) for i, n in enumerate(self.norms)], dim=-2).flatten(-2))


def test_a_norm_that_would_keep_more_bytes_says_so():
    plan = ol.fusion.analyze(_PerHeadNorm().train(), (seeded(2, 5, 16),))
    norms = [d for d in plan.decisions if d.pattern == "layer_norm"]
    assert len(norms) == 4
    for d in norms:  # was "saves -120 of its 80 activation bytes here (under 10%)"
        assert not d.fused and d.reason.startswith("not fused: would keep 120 activation bytes more than eager's 80")


class _StarReLUMlp(nn.Module):
    """A MetaFormer MLP: fc1 -> StarReLU (``scale * relu(x) ** 2 + bias``, learnable scalars) -> fc2. The pow
    saves the ReLU's output, which eager's ReLU saves too (one tensor); a fused Linear -> ReLU saves the
    pre-activation instead and the pow still keeps the output: one hidden tensor more than eager."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)
        self.scale, self.bias = nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.fc2(self.scale * self.relu(self.fc1(x)) ** 2 + self.bias)


def test_a_linear_act_pair_that_would_keep_more_bytes_is_declined():
    torch.manual_seed(0)
    model, x = _StarReLUMlp().train(), seeded(3, 5, 8)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern == "linear_relu"]
    hidden = 3 * 5 * 32 * 4
    assert not d.fused and d.saved_bytes == -hidden
    assert d.reason.startswith(f"not fused: would keep {hidden:,} activation bytes more"), d.reason
    assert "the fused op saves the activation's input" in d.reason
    assert activation_bytes(lambda: fused(x)) == activation_bytes(lambda: model(x))


class ChannelsFirstAttention(nn.Module):
    """Visformer's attention: a 1x1 conv makes q, k and v as views of one (B, 3, heads, d, N) output permuted to
    (B, heads, N, d), so each has its tokens, not its features, contiguous."""

    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads, self.qkv = heads, nn.Conv2d(dim, 3 * dim, 1, bias=False)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, c // self.heads, -1).permute(1, 0, 2, 4, 3).unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        return (attn @ v).permute(0, 1, 3, 2).reshape(b, -1, h, w)


def test_an_attention_core_reading_strided_views_is_costed_as_it_runs():
    """The cost model ran the op on contiguous clones of q, k and v, where SDPA takes its flash path and keeps
    them as they are; in the model it gets the strided views, takes its math path and keeps copies (as eager
    does). Counted as the views' whole output, the plan said the model kept 6,144 bytes more than it does."""
    torch.manual_seed(0)
    model, x = ChannelsFirstAttention().train(), seeded(2, 24, 4, 4, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern == "attention"]
    assert d.fused
    eager, fused_bytes = (activation_bytes(lambda m=m: m(x)) for m in (model, fused))
    assert plan.saved_bytes == d.saved_bytes == eager - fused_bytes
    torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


def test_an_attention_core_that_would_keep_more_bytes_is_declined():
    """Two tokens, heads 4 wide: eager keeps 2 x 2 probabilities a head, the fused core its 2 x 4 output, a row
    statistic and the mask (a model input nothing else saves). Fused before: the model kept 176 bytes more."""
    inputs = _attention_inputs(tokens=2)
    model = Attn("plain")
    fused, plan = ol.fusion.fuse(model, inputs)
    (d,) = [d for d in plan.decisions if d.pattern == "attention"]
    probs, out, stats, mask = 2 * 3 * 2 * 2 * 4, 2 * 3 * 2 * 4 * 4, 2 * 3 * 2 * 4, 2 * 2 * 2 * 4
    assert not d.fused and d.saved_bytes == probs - out - stats - mask == -176
    assert d.reason.startswith("not fused: would keep 176 activation bytes more"), d.reason
    assert "more keys than the head's width" in d.reason
    assert activation_bytes(lambda: fused(*inputs)) == activation_bytes(lambda: model(*inputs))
    fused, plan = ol.fusion.fuse(model, _attention_inputs())  # 12 tokens: the probabilities outweigh it
    (d,) = plan.decisions
    assert d.fused and d.saved_bytes > 0


@pytest.mark.parametrize("norm", [nn.LayerNorm(8), nn.RMSNorm(8)])
def test_a_norm_whose_output_is_written_in_place_saves_its_input(norm):
    """An ``inplace=True`` activation after the norm (timm's EfficientViT head): the output a fused norm would keep
    for backward is overwritten by then, so it keeps its input, as eager's does."""
    model = nn.Sequential(nn.Linear(8, 8), norm, nn.Hardswish(inplace=True), nn.Linear(8, 4)).double()
    x = seeded(5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    (d,) = [d for d in plan.decisions if d.pattern.endswith("norm")]
    assert d.params["save_output"] is False
    want, got = model(x), fused(x)  # backward raised "modified by an inplace operation" before
    (g_want,) = torch.autograd.grad(want.sum(), x)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


class SDPABlock(nn.Module):
    """nanoGPT's attention core: ``F.scaled_dot_product_attention`` with dropout in training."""

    def __init__(self, p=0.1, causal=True, gqa=False, masked=False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48 if not gqa else 32), nn.Linear(16, 16)
        self.p, self.causal, self.gqa, self.masked = p, causal, gqa, masked

    def forward(self, x):
        b, t, _ = x.shape
        if self.gqa:  # 4 query heads over 2 key/value heads
            q, k, v = self.qkv(x).split([16, 8, 8], dim=-1)
            k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in (k, v))
        else:
            q, k, v = self.qkv(x).split(16, dim=-1)
            k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in (k, v))
        q = q.view(b, t, 4, 4).transpose(1, 2)
        mask = (x.abs().sum(-1) > 0)[:, None, None, :] if self.masked else None  # padding form, (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0,
                                           is_causal=self.causal and not self.masked, enable_gqa=self.gqa)
        return self.proj(y.transpose(1, 2).reshape(b, t, 16))


def test_sdpa_with_dropout_is_an_attention_candidate_and_without_none():
    x = seeded(2, 6, 16, seed=1)
    (m,) = [m for m in _matches(SDPABlock(), x) if m.pattern == "attention"]
    assert m.ok and m.params == {"scale": None, "dropout_p": 0.1, "is_causal": True, "enable_gqa": False,
                                 "rng_name": "<root>:dropout.0"}
    assert [m for m in _matches(SDPABlock(p=0.0), x) if m.pattern == "attention"] == []  # SDPA keeps no T x T
    g = trace_runtime(SDPABlock(), (x,)).graph  # on a GPU its kernels keep none either: said, not fused
    (sdpa,) = [n for n in g.nodes if n.op == "scaled_dot_product_attention"]
    g.tensors[sdpa.inputs[0]] = torch.empty(2, 4, 6, 4, device="meta")
    (m,) = [m for m in find_all(g) if m.pattern == "attention"]
    assert not m.ok and "flash / memory-efficient kernels" in m.reason


@pytest.mark.parametrize("variant", [{}, {"gqa": True}, {"masked": True}])
def test_sdpa_with_dropout_fuses_saves_the_probabilities_and_draws_make_reproducibles_masks(variant):
    torch.manual_seed(0)
    model = nn.Sequential(SDPABlock(**variant), SDPABlock(**variant)).train()
    x = seeded(2, 32, 16, seed=1)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert plan.summary()["attention"] == {"fused": 2, "rejected": 0}
    from opsnn_lab.measuring import activation_bytes

    eager = activation_bytes(lambda: model(x), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x), exclude=tuple(fused.parameters()))
    assert ours < 0.5 * eager  # the math path's T x T probabilities and mask, per call, are gone
    outs = []  # make_reproducible runs the unfused SDPA's dropout on the same counter stream: the same masks
    for m in (model, fused):
        ol.consistency.make_reproducible(m, 3)
        out = m(x)
        outs.append((out, torch.autograd.grad(out.square().sum(), m[0].qkv.weight)[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
    model.eval()
    fused.eval()
    torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)  # eval: SDPA itself, p = 0


class ConvMlp(nn.Module):
    """timm's ConvMlp / Mlp(use_conv=True) in a channels-first block: 1x1 conv -> GELU -> Dropout -> an identity
    placeholder (its norm) -> 1x1 conv, with the residual add; ``inline``: the GELU as a function call (fx)."""

    def __init__(self, c=8, inline=False, p=0.1):
        super().__init__()
        self.fc1, self.act, self.drop = nn.Conv2d(c, 4 * c, 1), nn.GELU(), nn.Dropout(p)
        self.norm, self.fc2, self.inline = nn.Identity(), nn.Conv2d(4 * c, c, 1), inline

    def forward(self, x):
        h = F.gelu(self.fc1(x)) if self.inline else self.act(self.fc1(x))
        return x + self.fc2(self.norm(self.drop(h)))


@pytest.mark.parametrize("inline, route", [(False, "module:chain"), (True, "fx:")])
def test_a_channels_first_conv_mlp_fuses_and_draws_the_unfused_masks(inline, route):
    from opsnn_lab.testing import AroundRegion

    torch.manual_seed(0)
    model = AroundRegion(ConvMlp(inline=inline)).double().train()
    x = seeded(2, 8, 5, 6, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = [d for d in plan.decisions if d.fused]
    assert d.pattern == "conv_gelu_dropout_conv" and d.route.startswith(route) and "FusedConvActDropoutConv" in d.reason
    assert ol.bench.activation_bytes(lambda: fused(x)) < 0.6 * ol.bench.activation_bytes(lambda: model(x))
    eager, fused = (ol.consistency.make_reproducible(m, seed=3) for m in (model, fused))
    for _ in range(2):  # two steps: the masks move on alike
        want, got = eager(x), fused(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        params = [*eager.parameters()], [*fused.parameters()]
        g_want = torch.autograd.grad(want.sin().sum(), [x, *params[0]])
        g_got = torch.autograd.grad(got.sin().sum(), [x, *params[1]])
        for a, b in zip(g_want, g_got):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_conv_mlp_whose_hidden_output_is_read_twice_says_so():
    class Tapped(ConvMlp):
        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(self.act(h)) + h.mean(1, keepdim=True)

    plan = ol.fusion.analyze(Tapped().train(), seeded(2, 8, 4, 4))
    (d,) = [d for d in plan.decisions if d.pattern.startswith("conv_")]
    assert not d.fused and "the output of `fc1` is also read by" in d.reason
    assert pattern_of("conv_gelu_conv").op == "FusedConvActDropoutConv" and "conv_act_conv" in FAMILIES
