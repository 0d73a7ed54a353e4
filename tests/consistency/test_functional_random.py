"""``make_reproducible`` keys every random torch call of a training forward, not only dropout: drop path
written with ``Tensor.bernoulli_`` (timm) or ``torch.rand`` (Hugging Face), ``rand_like``/``randn``, and the
channel dropouts ``F.dropout1d/2d/3d``; composite functions (``F.gumbel_softmax``, ``F.rrelu``, alpha dropout,
``nn.init``) draw from torch's generators seeded from (seed, step). Masks repeat across runs and global seeds,
change with the step, leave the global generator alone, replay under checkpointing (module calls, and a layer
whose own ``forward`` is checkpointed with its hooks outside, with a drop path called twice), and a new random
call never shifts a dropout's mask. A call with its own ``generator=`` is left to it; draws from Python's or
numpy's generators are named in a warning."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from opsnn_lab.consistency import make_reproducible
from opsnn_lab.testing import seeded


class DropPath(nn.Module):
    def __init__(self, p, style):
        super().__init__()
        self.p, self.style = p, style

    def forward(self, x):
        keep = 1 - self.p
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        if self.style == "timm":
            mask = x.new_empty(shape).bernoulli_(keep)
        elif self.style == "hf":
            mask = (keep + torch.rand(shape, dtype=x.dtype, device=x.device)).floor_()
        else:
            mask = (torch.rand_like(x[:, :1]) < keep).to(x.dtype) + 0 * torch.randn(1)
        return x * mask / keep


class Body(nn.Module):
    def __init__(self, style, extra_random):
        super().__init__()
        self.lin, self.path, self.extra = nn.Linear(8, 8), DropPath(0.5, style), extra_random
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x, img):
        if self.extra:  # a new random call before the dropout: must not shift the dropout's mask
            torch.rand(3)
        h = F.dropout(self.lin(x), 0.3, self.training)
        return self.path(h) + x, F.dropout2d(self.conv(img), 0.5, self.training)


class Net(nn.Module):  # checkpointing is per module call, as Hugging Face and most trainers do it
    def __init__(self, style="timm", extra_random=False, ckpt=None):
        super().__init__()
        self.body, self.ckpt = Body(style, extra_random), ckpt

    def forward(self, x, img):
        if self.ckpt is not None:
            return checkpoint(self.body, x, img, use_reentrant=self.ckpt == "reentrant")
        return self.body(x, img)


def _run(model, global_seed, steps=2):
    x, img = seeded(16, 8, seed=1), seeded(4, 3, 5, 5, seed=2)
    torch.manual_seed(global_seed)
    return [tuple(t.detach() for t in model(x, img)) for _ in range(steps)]


@pytest.mark.parametrize("style", ["timm", "hf", "like"])
def test_drop_path_and_channel_dropout_repeat_across_runs_and_change_with_the_step(style):
    torch.manual_seed(0)
    base = Net(style).train()
    a = _run(make_reproducible(copy.deepcopy(base), seed=3), 1)
    b = _run(make_reproducible(copy.deepcopy(base), seed=3), 2)
    for (x1, i1), (x2, i2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(i1, i2)
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[0][1], a[1][1])  # step 0 vs step 1


def test_the_global_generator_is_left_alone():
    model = make_reproducible(Net("hf").train(), seed=3)
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    _run(model, 5, steps=1)
    torch.manual_seed(5)  # _run reseeded; draw as a user would after a step
    assert torch.equal(torch.rand(4), want)
    state = torch.get_rng_state()
    model(seeded(16, 8, seed=1), seeded(4, 3, 5, 5, seed=2))
    assert torch.equal(torch.get_rng_state(), state)


def test_a_new_random_call_does_not_shift_the_dropout_mask():
    torch.manual_seed(0)
    base = Net("timm").train()
    plain = make_reproducible(copy.deepcopy(base), seed=4)
    extra = make_reproducible(copy.deepcopy(base), seed=4)
    extra.body.extra = True
    x = seeded(16, 8, seed=1)
    with torch.no_grad():
        h_plain = F.dropout(plain.body.lin(x), 0.3)  # not keyed (no forward running): only its shape matters
    seen = {}
    for name, m in (("plain", plain), ("extra", extra)):
        m.body.path.register_forward_pre_hook(lambda mod, a, n=name: seen.setdefault(n, a[0].detach()))
        m(x, seeded(4, 3, 5, 5, seed=2))
    assert seen["plain"].shape == h_plain.shape and torch.equal(seen["plain"], seen["extra"])


def test_channel_dropout_zeroes_whole_channels_and_rescales():
    model = make_reproducible(Net("timm").train(), seed=6)
    img = seeded(4, 3, 5, 5, seed=2)
    _, out = model(seeded(16, 8, seed=1), img)
    ref = model.body.conv(img)
    per_channel = out.flatten(2)
    kept = per_channel.abs().sum(-1) > 0
    assert 0 < kept.sum() < kept.numel()  # some channels dropped, some kept
    torch.testing.assert_close(per_channel[kept], (ref.flatten(2) * 2.0)[kept])


def test_an_explicit_generator_is_left_to_the_caller():
    class Own(nn.Module):
        def forward(self, x):
            return x * torch.rand(x.shape, generator=torch.Generator().manual_seed(7))

    model = make_reproducible(Own().train(), seed=1)
    torch.testing.assert_close(model(torch.ones(3)), torch.rand(3, generator=torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_checkpoint_recomputation_replays_the_random_calls(mode):
    torch.manual_seed(0)
    base = Net("timm").train()
    grads = []
    for ckpt in (None, mode):
        m = make_reproducible(copy.deepcopy(base), seed=2)
        m.ckpt = ckpt
        x = seeded(16, 8, seed=1).requires_grad_(True)
        a, b = m(x, seeded(4, 3, 5, 5, seed=2))
        (a.sin().sum() + b.sin().sum()).backward()
        grads.append([x.grad, *[p.grad for p in m.parameters()]])
    for g, w in zip(*grads):
        assert torch.equal(g, w)


class Layer(nn.Module):
    """A layer whose own ``forward`` is checkpointed with its hooks outside (Hugging Face 5's
    ``GradientCheckpointingLayer``): functional dropouts in its body run outside any module call of the recompute,
    and its drop-path module is called twice."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.norm, self.fc, self.path, self.ckpt = nn.LayerNorm(8), nn.Linear(8, 8), DropPath(0.5, "hf"), ckpt

    def __call__(self, x):
        if self.ckpt is None:
            return super().__call__(x)
        body = functools.partial(type(self).forward, self)
        return nn.Module.__call__(self, x, _body=lambda x: checkpoint(body, x, use_reentrant=self.ckpt == "reentrant"))

    def forward(self, x, _body=None):
        if _body is not None:
            return _body(x)
        h = F.dropout(self.fc(self.norm(x)), 0.3, self.training)  # body-level, after a module call
        h = x + self.path(h)
        h = h + self.path(F.dropout(self.fc(h), 0.2, self.training))  # the same drop path, second call
        return h * torch.rand_like(h)  # body-level, last


class Stack(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.layers = nn.ModuleList([Layer(ckpt), Layer(ckpt)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_checkpointed_forward_with_its_hooks_outside_replays_every_call(mode):
    torch.manual_seed(0)
    base = Stack().train()
    runs = []
    for ckpt in (None, mode):
        m = make_reproducible(copy.deepcopy(base), seed=2)
        for layer in m.layers:
            layer.ckpt = ckpt
        x = seeded(6, 8, seed=1).requires_grad_(True)
        torch.manual_seed(7 if ckpt else 3)  # the global generator must not matter
        out = m(x)
        out.sin().sum().backward()
        runs.append([out.detach(), x.grad, *[p.grad for p in m.parameters()]])
    for g, w in zip(*runs):
        assert torch.equal(g, w)


def test_composite_and_generator_none_draws_repeat_across_global_seeds_and_change_with_the_step():
    class Composite(nn.Module):
        def forward(self, x):
            a = F.gumbel_softmax(x, tau=0.5)
            b = F.rrelu(x, training=True) + F.alpha_dropout(x, 0.3, True)
            c = torch.rand(x.shape, generator=None) + torch.randint_like(x, 5) + torch.randint_like(x, 2, 9)
            d = torch.empty_like(x)
            nn.init.normal_(d)
            return a + b + c + d

    _repeats_across_global_seeds_and_changes_with_the_step(Composite, seed=9)


def _repeats_across_global_seeds_and_changes_with_the_step(module_class, seed: int) -> None:
    x = seeded(4, 6, seed=1)
    outs = []
    for global_seed in (1, 2):
        model = make_reproducible(module_class().train(), seed=seed)
        torch.manual_seed(global_seed)
        outs.append([model(x), model(x)])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[0][1])  # step 0 vs step 1


def test_torch_seed_in_a_forward_repeats_with_the_step_and_is_torch_s_again_after():
    class Reseeding(nn.Module):  # Reformer's reversible layers pick their seeds so: torch.seed(), then manual_seed
        def forward(self, x):
            seed = torch.seed() % (1 << 62)
            torch.manual_seed(seed)
            return F.rrelu(x, training=True) * (1 + seed % 7)

    _repeats_across_global_seeds_and_changes_with_the_step(Reseeding, seed=5)
    # outside the forward torch.seed is torch's own again: it reseeds from the system and leaves no patch behind
    assert torch.seed is torch.random.seed and torch.seed.__module__ == "torch.random"
    torch.manual_seed(0)
    assert torch.seed() != torch.seed()


def test_draws_from_python_or_numpy_generators_are_named_once():
    import random

    class Foreign(nn.Module):
        def forward(self, x):
            return x * random.random()

    model = make_reproducible(Foreign().train(), seed=1)
    with pytest.warns(RuntimeWarning, match="Python's `random` module"):
        model(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(2))  # said once per model
        make_reproducible(nn.Linear(2, 2).train(), seed=1)(torch.ones(2))  # torch draws only: nothing to say
