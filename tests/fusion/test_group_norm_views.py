"""GroupNorm -> views -> activation: video autoencoders normalise per frame on ``(B * T, C, H, W)`` and view the
output back to ``(B, C, T, H, W)`` before the activation (MagVit's and Cosmos' blocks); UNet1D normalises an
unsqueezed map and indexes it back. The activation is pointwise, so the fused op runs it before the views, which
stay in the model's code on the op's output: through a module chain (the activation's pass-through checks it
receives a view of that output), through fx, and from a JSON plan; the outputs and every gradient are eager's."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.patch import PassThrough
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import assert_within_eager_error, seeded


def _per_frame(norm, h):
    b = h.size(0)
    h = norm(h.permute(0, 2, 1, 3, 4).flatten(0, 1))
    return h.unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)


class PerFrameBlock(nn.Module):
    """MagVit's ResNet block with ``spatial_group_norm``; ``shared`` calls one SiLU after both norms (fx rewrites
    each call site), else each norm has its own and a branch on the data keeps fx out (the module route)."""

    def __init__(self, c=8, shared=False, inplace=False):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv3d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(2, c), nn.Conv3d(c, c, 3, padding=1)
        self.act1 = nn.SiLU(inplace=inplace)
        self.act2 = self.act1 if shared else nn.SiLU(inplace=inplace)
        self.shared = shared

    def forward(self, x):
        if not self.shared and x.isnan().any():
            raise ValueError("nan input")
        h = self.conv1(self.act1(_per_frame(self.norm1, x)))
        return x + self.conv2(self.act2(_per_frame(self.norm2, h)))


class CausalGroupNorm(nn.Module):  # Cosmos' norm: the views inside a wrapper, the activation after it returns
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(1, c, eps=1e-6)

    def forward(self, x):
        return _per_frame(self.norm, x)


class WrappedNormBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.norm1, self.nonlinearity, self.conv1 = CausalGroupNorm(c), nn.GELU(), nn.Conv3d(c, c, 1)

    def forward(self, x):
        if x.isnan().any():
            raise ValueError("nan input")
        return self.conv1(self.nonlinearity(self.norm1(x)))


class Conv1dBlock(nn.Module):  # UNet1D's: conv -> unsqueeze by indexing -> GroupNorm -> index back -> Mish
    def __init__(self, c_in=4, c=8):
        super().__init__()
        self.conv1d, self.group_norm, self.mish = nn.Conv1d(c_in, c, 5, padding=2), nn.GroupNorm(4, c), nn.Mish()

    def forward(self, x):
        h = self.conv1d(x)[:, :, None, :]
        return self.mish(self.group_norm(h)[:, :, 0, :])


def _step(model, x):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    grads = torch.autograd.grad((y * seeded(*y.shape, seed=3, dtype=y.dtype)).sum(), [x, *model.parameters()])
    return [y, *grads]


def _fused_like_eager(model, x, route, n, tol=1e-12):
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    decisions = [d for d in plan.decisions if d.pattern.startswith("group_norm_")]
    assert len(decisions) == n and all(d.fused and d.route.startswith(route) for d in decisions), plan.summary()
    for a, b in zip(_step(model, x), _step(fused, x)):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 0
    return fused, plan, decisions


X5 = seeded(2, 8, 3, 6, 5, dtype=torch.float64)


def test_per_frame_norms_fuse_as_a_module_chain_with_the_views_left_in_the_model():
    torch.manual_seed(0)
    fused, plan, decisions = _fused_like_eager(PerFrameBlock().double(), X5, "module:chain", 2)
    assert [d.pattern for d in decisions] == ["group_norm_silu"] * 2
    d = decisions[0]
    assert d.chain == ["norm1", "unflatten", "permute", "act1"] and d.carriers == ["norm1", "act1"]
    assert "`unflatten`, `permute` run inline in `<model>`.forward before `act1`: they view the fused output" \
        in d.reason
    assert ol.fusion.patches(fused)["act1"].after == "permute"
    assert d.traffic_bytes == 4 * X5.numel() * X5.element_size()  # the normalised map's round trips; views move none


def test_a_shared_activation_after_per_frame_norms_fuses_each_call_site_through_fx():
    torch.manual_seed(0)
    _, _, decisions = _fused_like_eager(PerFrameBlock(shared=True).double(), X5, "fx", 2)
    assert [d.chain for d in decisions] == [["norm1", "unflatten", "permute", "act1"],
                                            ["norm2", "unflatten", "permute", "act1"]]


def test_views_inside_the_norm_s_wrapper_and_an_index_back_from_an_unsqueezed_map():
    torch.manual_seed(0)
    _, _, (d,) = _fused_like_eager(WrappedNormBlock().double(), X5, "module:chain", 1)
    assert d.pattern == "group_norm_gelu" and d.chain == ["norm1.norm", "norm1.unflatten", "norm1.permute",
                                                          "nonlinearity"]
    _, _, (d,) = _fused_like_eager(Conv1dBlock().double(), seeded(3, 4, 11, dtype=torch.float64), "module:chain", 1)
    assert d.pattern == "group_norm_mish" and d.chain == ["group_norm", "getitem", "mish"]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_grad_the_views_of_the_fused_output_pass_too(mode):
    """A view made under ``inference_mode`` keeps no reference to what it views: the chain holds the op's output
    until its activation has run (UNet1D's eval under ``inference_mode`` raised here)."""
    torch.manual_seed(0)
    for model, x in ((Conv1dBlock().double(), seeded(3, 4, 11, dtype=torch.float64)),
                     (PerFrameBlock().double(), X5)):
        fused, _ = ol.fusion.fuse(copy.deepcopy(model), (x,))
        with mode():
            torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)
        assert all(p.held is None for p in ol.fusion.patches(fused).values() if hasattr(p, "held"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_activations_and_low_precision(dtype):
    """Fused and eager in ``dtype`` against the float64 model: the fused error within twice eager's (the tolerance
    table's low-precision criterion), outputs and every gradient; in-place SiLUs write through the views."""
    torch.manual_seed(0)
    model = PerFrameBlock(inplace=True).double()
    low = copy.deepcopy(model).to(dtype)
    fused, plan = ol.fusion.fuse(copy.deepcopy(low), (X5.to(dtype),))
    assert [d.fused for d in plan.decisions if d.pattern.startswith("group_norm")] == [True, True]
    names = ["output", "input grad", *(n for n, _ in model.named_parameters())]
    for name, ref, a, b in zip(names, _step(model, X5), _step(low, X5.to(dtype)), _step(fused, X5.to(dtype))):
        assert_within_eager_error(b, a, ref, name=name)


def test_a_json_plan_a_deepcopy_and_a_saved_model_keep_the_views_and_the_check():
    torch.manual_seed(0)
    model = PerFrameBlock().double()
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (X5,))
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    want = _step(model, X5)
    for other in (again, copy.deepcopy(fused), loaded):
        assert isinstance(other.act2.__dict__["forward"], PassThrough) and other.act2.forward.after == "permute"
        for a, b in zip(want, _step(other, X5)):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_the_activation_given_anything_but_a_view_of_the_fused_output_raises():
    torch.manual_seed(0)
    fused, _ = ol.fusion.fuse(PerFrameBlock().double(), (X5,))
    with pytest.raises(RuntimeError, match=r"`act1` passes on the output of the fused group_norm_silu chain "
                                           r"\(`norm1` computes it whole\), but received another tensor: the "
                                           r"`permute` run inline in `<model>`.forward before it viewed that output"):
        fused.act1(X5.clone())
    out = fused.norm1(X5[:, :, 0])
    assert fused.act1(out.permute(0, 1, 3, 2)).shape == (2, 8, 5, 6)  # any view of what the op just returned


class Rearranged(nn.Module):
    def __init__(self, step, act=None):
        super().__init__()
        self.norm, self.act, self.step = nn.GroupNorm(2, 4), act or nn.SiLU(), step

    def forward(self, x):
        return self.act(self.step(self.norm(x)))


@pytest.mark.parametrize("step", [
    lambda h: h.mT, lambda h: h.transpose(1, 2), lambda h: h.swapaxes(1, 3), lambda h: h.movedim(1, -1),
    lambda h: h.narrow(3, 1, 4), lambda h: h.select(2, 1), lambda h: h.unsqueeze(0).squeeze(0),
    lambda h: h.view(2, 4, 18), lambda h: h[:, 1:, None, ..., ::2], lambda h: h.unflatten(2, (1, 3)),
])
def test_each_view_step_runs_on_the_fused_output(step):
    torch.manual_seed(0)
    model, x = Rearranged(step).double(), seeded(2, 4, 3, 6, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    (d,) = plan.decisions
    assert d.fused and d.route == "module:chain" and len(d.chain) >= 3, d.reason
    for a, b in zip(_step(model, x), _step(fused, x)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("step, reason", [
    (lambda h: h.reshape(2, 4, -1), "the output of `norm` goes to `reshape`"),  # may copy: not a view step
    (lambda h: h[:, torch.tensor([1, 0, 3, 2])], "the output of `norm` goes to `getitem`"),  # a gather copies
    (lambda h: h.view(torch.float32), "the output of `norm` goes to `view`"),  # reinterprets bits
    (lambda h: h.permute(0, 1, 3, 2) * 2, "the output of `norm`, past `permute`, goes to `mul`"),
])
def test_what_is_no_view_step_is_declined_with_its_reason(step, reason):
    model, x = Rearranged(step).double(), seeded(2, 4, 3, 6, dtype=torch.float64)
    (d,) = ol.fusion.analyze(model, (x,)).decisions
    assert d.pattern == "group_norm_act" and not d.fused and reason in d.reason


def test_a_view_read_twice_or_followed_by_another_activation_is_declined():
    class ReadTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.act = nn.GroupNorm(2, 4), nn.SiLU()

        def forward(self, x):
            v = self.norm(x).transpose(2, 3)
            return self.act(v) + v

    (d,) = ol.fusion.analyze(ReadTwice(), (seeded(2, 4, 3, 5),)).decisions
    assert not d.fused and "past `transpose`, goes to `act`, `add`" in d.reason
    (d,) = ol.fusion.analyze(Rearranged(lambda h: h.transpose(2, 3), nn.Tanh()), (seeded(2, 4, 3, 5),)).decisions
    assert not d.fused and "past `transpose`, goes to `act`, not one activation of" in d.reason
