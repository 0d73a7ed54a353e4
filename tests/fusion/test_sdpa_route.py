"""The ``module:sdpa`` route: an attention core that is one ``F.scaled_dot_product_attention`` call inside a
forward fx cannot trace (a key/value cache updated before a question on sizes, as GPT-2's layers do at their
default ``use_cache=True``) runs the fused core at the call, the module's own code around it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import opsnn_lab as ol
from opsnn_lab.fusion.patch import SDPACallSite, patches
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class Store:
    """A key/value cache: ``update`` keeps what it is given and returns all it holds."""

    def __init__(self):
        self.k, self.v = [], []

    def update(self, k, v):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, -2), torch.cat(self.v, -2)


class CachedAttention(nn.Module):
    def __init__(self, d=16, heads=2, p=0.3, calls=1):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.p, self.calls = heads, p, calls

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (self.q(x), self.k(x), self.v(x)))
        k, v = cache.update(k, v)
        causal = q.shape[-2] > 1 and k.shape[-2] == q.shape[-2]  # a size the cache's update made: fx stops here
        out = sum(F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                                 is_causal=causal) for _ in range(self.calls))
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    def __init__(self, p=0.3, calls=1):
        super().__init__()
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.layers = nn.ModuleList(CachedAttention(p=p, calls=calls) for _ in range(2))
        self.checkpointed = False

    def forward(self, x):
        if not bool(x.isfinite().all()):  # a branch on values: fx traces the layers alone, each given its cache
            raise ValueError("x has non-finite values")
        h = self.emb(x)
        for layer in self.layers:
            if self.checkpointed:  # recomputed in backward, with a fresh cache as in the forward
                h = h + checkpoint(lambda h, layer=layer: layer(h, Store()), h, use_reentrant=False)
            else:
                h = h + layer(h, Store())
        return self.head(h)


def _fused(model, x):
    torch.manual_seed(0)
    return ol.fusion.fuse(copy.deepcopy(model), (x,))


def _step(model, x):
    out = model(x)
    grads = torch.autograd.grad(out.pow(2).mean(), list(model.parameters()))
    return out, grads


def _attention(plan):
    return [d for d in plan.decisions if d.pattern == "attention"]


def test_an_sdpa_call_in_a_forward_fx_cannot_trace_runs_the_fused_core_at_the_call():
    torch.manual_seed(0)
    model, x = Net().train(), seeded(2, 24, 8)
    fused, plan = _fused(model, x)
    found = _attention(plan)
    assert len(found) == 2 and all(d.fused and d.route == "module:sdpa" for d in found), [d.reason for d in found]
    assert all("redirected to the fused core" in d.reason for d in found)
    assert {p for p, patch in patches(fused).items() if isinstance(patch, SDPACallSite)} == {"layers.0", "layers.1"}
    # the T x T probabilities and their dropout mask are no longer saved
    eager_b = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    fused_b = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert fused_b < 0.8 * eager_b, (fused_b, eager_b)
    # under make_reproducible fused and unfused draw the same masks: the same step, gradients to rounding
    eager_r = ol.consistency.make_reproducible(copy.deepcopy(model), 5)
    fused_r = ol.consistency.make_reproducible(copy.deepcopy(fused), 5)
    (out_a, g_a), (out_b, g_b) = _step(eager_r, x), _step(fused_r, x)
    assert torch.equal(out_a, out_b)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_without_dropout_and_in_eval_the_call_is_sdpa_itself():
    torch.manual_seed(0)
    model, x = Net(p=0.0).train(), seeded(2, 24, 8)
    fused, plan = _fused(model, x)
    (out_a, g_a), (out_b, g_b) = _step(model, x), _step(fused, x)
    assert torch.equal(out_a, out_b)
    for a, b in zip(g_a, g_b):  # the packed q/k/v GEMM (FusedQKV) sums its weight gradients in another order
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    dropped = Net(p=0.3).train()
    fused, _ = _fused(dropped, x)
    dropped.eval(), fused.eval()
    with torch.no_grad():
        assert torch.equal(dropped(x), fused(x))


def test_the_masks_come_from_the_ops_stream_and_replay_from_seed_and_step():
    torch.manual_seed(0)
    model, x = Net().train(), seeded(2, 24, 8)
    fused, _ = _fused(model, x)
    ops = [patch.op for patch in patches(fused).values() if isinstance(patch, SDPACallSite)]
    with torch.no_grad():
        first, second = fused(x), fused(x)
        assert not torch.equal(first, second)  # each training call draws the next masks
        for i, op in enumerate(ops):
            op.set_rng(100 + i, 0)
        again = fused(x)
        for i, op in enumerate(ops):
            op.set_rng(100 + i, 0)
        assert torch.equal(again, fused(x))


def test_a_checkpointed_layer_replays_the_forwards_masks():
    torch.manual_seed(0)
    model, x = Net().train(), seeded(2, 24, 8)
    fused, _ = _fused(model, x)
    plain, recomputed = copy.deepcopy(fused), copy.deepcopy(fused)
    recomputed.checkpointed = True
    for m in (plain, recomputed):
        for i, patch in enumerate(p for p in patches(m).values() if isinstance(p, SDPACallSite)):
            patch.op.set_rng(50 + i, 0)
    (out_a, g_a), (out_b, g_b) = _step(plain, x), _step(recomputed, x)
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(g_a, g_b))


def test_pickled_copied_and_reverted():
    torch.manual_seed(0)
    model, x = Net().train(), seeded(2, 24, 8)
    fused, _ = _fused(model, x)
    for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
        assert isinstance(patches(other)["layers.0"], SDPACallSite)
        _step(other, x)  # trains
        other.eval(), model.eval()
        with torch.no_grad():
            assert torch.equal(other(x), model(x))
        model.train()
    ol.fusion.revert(fused)
    assert not patches(fused)


def test_a_module_making_two_calls_is_left_alone():
    torch.manual_seed(0)
    model, x = Net(calls=2).train(), seeded(2, 24, 8)
    _, plan = _fused(model, x)
    found = _attention(plan)
    assert found and not any(d.fused for d in found)
    assert all(d.reason.startswith("cannot be rewritten") for d in found)


def test_gpt2_at_its_default_config_fuses_its_attention():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).train()  # use_cache=True, attention dropout 0.1
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), {"input_ids": ids, "labels": ids})
    assert [d.route for d in _attention(plan) if d.fused] == ["module:sdpa"] * 2
    eager_r = ol.consistency.make_reproducible(copy.deepcopy(model), 3)
    fused_r = ol.consistency.make_reproducible(fused, 3)
    loss_a, loss_b = (m(input_ids=ids, labels=ids).loss for m in (eager_r, fused_r))
    assert torch.equal(loss_a, loss_b)
    loss_a.backward(), loss_b.backward()
    for a, b in zip(eager_r.parameters(), fused_r.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
