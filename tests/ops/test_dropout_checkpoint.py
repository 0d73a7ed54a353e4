"""Counter-RNG dropout under activation checkpointing: the recomputation inside the backward replays the
draw of the forward it recomputes, so outputs and every gradient equal the run without checkpointing (same
streams, same steps). Reentrant and non-reentrant checkpoints; ops.Dropout and every fused op with dropout;
one module applied twice in a region; one module in several regions; the recomputation advances nothing;
and a recomputation no logged draw matches raises instead of training on a mask the forward never used."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from opsnn_lab.ops import Dropout, FusedAttention, FusedGatedMLP, FusedLinearActDropoutLinear
from opsnn_lab.testing import seeded


def _lin(i, o, seed):
    torch.manual_seed(seed)
    return nn.Linear(i, o)


def _ops():
    return {
        "dropout": Dropout(0.4, seed=11),
        "mlp": FusedLinearActDropoutLinear.from_modules(_lin(12, 24, 1), nn.GELU(), nn.Dropout(0.3), _lin(24, 12, 2),
                                                        seed=12),
        "gated": FusedGatedMLP.from_modules(_lin(12, 20, 3), _lin(12, 20, 4), _lin(20, 12, 5), nn.SiLU(),
                                            nn.Dropout(0.3), seed=13),
        "attention": FusedAttention(dropout_p=0.3, seed=14),
    }


def _apply(name, op, x):
    if name == "attention":
        q = x.view(2, 3, 4, 3).transpose(1, 2)  # (batch, heads, seq, dim) from (2, 4, 9) rows
        return op(q, q * 0.5, q + 1.0).transpose(1, 2).reshape(x.shape)
    return op(x)


def _run(name, op, x, mode):
    op.set_rng(op.rng_seed, 5)
    op.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)

    def region(t):  # the op twice on one input shape: both calls replay, in order (sin saves its input, so
        return _apply(name, op, _apply(name, op, t) * 0.5 + t).sin()  # the whole region is recomputed)

    y = region(x) if mode is None else checkpoint(region, x, use_reentrant=mode == "reentrant")
    y.square().sum().backward()
    return y.detach(), [x.grad, *[p.grad for p in op.parameters()]], op.rng_step


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", ["dropout", "mlp", "gated", "attention"])
def test_a_checkpointed_region_replays_the_masks_of_its_forward(name, mode, monkeypatch):
    op = _ops()[name].train()
    replays = _count_replays(monkeypatch)
    x = seeded(2, 4, 12 if name != "attention" else 9, seed=1)
    want, want_grads, want_step = _run(name, op, x, None)
    got, grads, step = _run(name, op, x, mode)
    assert torch.equal(got, want)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)
    assert step == want_step == 7  # two draws in the forward; the recomputation advanced nothing
    assert len(replays) == 2  # ... and it did run both calls again


def _count_replays(monkeypatch) -> list:
    from opsnn_lab.ops.dropout import CounterRNG

    calls, replay = [], CounterRNG._replay
    monkeypatch.setattr(CounterRNG, "_replay", lambda self, fp: calls.append(1) or replay(self, fp))
    return calls


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_one_module_in_several_regions_replays_each(mode, monkeypatch):
    replays = _count_replays(monkeypatch)
    drop = Dropout(0.5, seed=3).train()
    lin = _lin(8, 8, 0)

    def layer(t):
        return (drop(lin(t)) + t).sin()

    def model(x, ckpt):
        for _ in range(3):
            x = checkpoint(layer, x, use_reentrant=mode == "reentrant") if ckpt else layer(x)
        return x

    def run(ckpt):
        drop.set_rng(3, 0)
        lin.zero_grad(set_to_none=True)
        x = seeded(4, 8, seed=2).requires_grad_(True)
        model(x, ckpt).sum().backward()
        return x.grad, lin.weight.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
    assert len(replays) == 3


def test_gradient_accumulation_replays_each_micro_batch():
    drop, lin = Dropout(0.5, seed=4).train(), _lin(6, 6, 1)

    def run(ckpt):
        drop.set_rng(4, 0)
        lin.zero_grad(set_to_none=True)
        for i in range(3):  # forward, backward, forward, backward, ...: each backward replays its own forward
            x = seeded(5, 6, seed=10 + i)
            f = (lambda t: drop(lin(t)).sin())
            y = checkpoint(f, x, use_reentrant=False) if ckpt else f(x)
            y.square().sum().backward()
        return lin.weight.grad.clone(), drop.rng_step

    assert run(True)[1] == run(False)[1] == 3
    assert torch.equal(run(True)[0], run(False)[0])


def test_a_recomputation_no_draw_matches_raises():
    drop, lin = Dropout(0.5, seed=5).train(), _lin(6, 6, 2)
    calls = []

    def region(t):  # not deterministic: the recomputation sees other inputs, twice the same shape
        calls.append(1)
        h = lin(t) + len(calls)
        return (drop(h) + drop(h * 2.0)).sin()

    x = seeded(5, 6, seed=3).requires_grad_(True)
    y = checkpoint(region, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        y.sum().backward()


def test_one_non_deterministic_draw_of_its_shape_is_still_found():
    drop, lin = Dropout(0.5, seed=6).train(), _lin(6, 6, 3)
    calls = []

    def region(t):
        calls.append(1)
        return drop(lin(t) + 1e-3 * len(calls)).sin()  # recomputed 1e-3 off: matched by its shape alone

    def run(ckpt):
        drop.set_rng(6, 0)
        lin.zero_grad(set_to_none=True)
        y = checkpoint(region, seeded(5, 6, seed=3), use_reentrant=False) if ckpt else region(seeded(5, 6, seed=3))
        y.sum().backward()
        return lin.weight.grad

    calls.clear()
    want = run(False)
    calls.clear()
    torch.testing.assert_close(run(True), want, rtol=1e-2, atol=1e-2)  # another mask moves it by O(1)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_p0_draws_keep_the_step_but_log_no_fingerprint(mode, monkeypatch):
    # a p = 0 draw has no mask to replay: it advances the step (streams stay aligned) without sampling its
    # input, and a region mixing it with a p > 0 draw still replays that one's mask
    from opsnn_lab.ops import dropout as dropout_mod

    sampled = []
    fingerprint = dropout_mod._fingerprint
    monkeypatch.setattr(dropout_mod, "_fingerprint", lambda x: sampled.append(x) or fingerprint(x))
    still = FusedGatedMLP.from_modules(_lin(6, 10, 4), _lin(6, 10, 5), _lin(10, 6, 6), nn.SiLU(), seed=9).train()
    drop = Dropout(0.5, seed=8).train()

    def run(ckpt):
        drop.set_rng(8, 0)
        still.set_rng(9, 0)
        x = seeded(5, 6, seed=4).requires_grad_(True)
        f = (lambda t: drop(still(t)).sin())
        y = checkpoint(f, x, use_reentrant=mode == "reentrant") if ckpt else f(x)
        y.square().sum().backward()
        return x.grad, still.rng_step, drop.rng_step

    want, got = run(False), run(True)
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:] == (1, 1)
    # only drop's input is ever sampled: its draw in each forward and its replay in the recomputation
    assert [tuple(t.shape) for t in sampled if t is not None] == [(5, 6)] * 3
