"""``make_reproducible`` under activation checkpointing, and SDPA's dropout.

* A checkpointed module recomputed inside the backward replays the masks of the forward it recomputes:
  module dropouts (``ops.Dropout``, by their replay log) and functional ones (``F.dropout`` and
  ``F.scaled_dot_product_attention``, by their (module path, call index, step) key), so every gradient
  equals the run without checkpointing, reentrant or not, fused or not, and on a Hugging Face model.
* A checkpoint around the whole model runs the model's forward again inside the backward: at the step of the
  forward it recomputes (found by the autograd node asking), so a model called twice before one backward
  recomputes each call with its own masks, and the step counter moves only with real forwards.
* SDPA with ``dropout_p > 0`` (Hugging Face's default attention) draws the counter mask of its key
  (``ops.attention.counter_sdpa``), checked against the formula with that mask, causal and GQA included.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import opsnn_lab as ol
from opsnn_lab.consistency import SeedPool, get_step, make_reproducible
from opsnn_lab.kernels import rng
from opsnn_lab.ops.attention import counter_sdpa
from opsnn_lab.testing import seeded


class Block(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.3), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.out(a.transpose(1, 2).reshape(b, t, d)), 0.1, self.training)
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.blocks, self.ckpt = nn.ModuleList([Block(), Block()]), ckpt

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x) if self.ckpt is None else checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        return x


def _grads(model, x, steps=2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        xg = x.detach().requires_grad_(True)  # a reentrant checkpoint needs an input that requires grad
        y = model(xg)
        y.square().sum().backward()
        out.append((y.detach(), {"input": xg.grad, **{k: p.grad.clone() for k, p in model.named_parameters()}}))
    return out


@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_checkpointed_blocks_replay_every_mask(ckpt, fuse):
    torch.manual_seed(0)
    plain, x = Net().train(), seeded(2, 6, 16, seed=1)
    other = copy.deepcopy(plain)
    if fuse:
        other, plan = ol.fusion.fuse(other, (x,))
        assert any(d.pattern == "linear_gelu_dropout_linear" for d in plan.fused)
    make_reproducible(plain, seed=9)
    make_reproducible(other, seed=9)
    other.ckpt = ckpt
    for (y, g), (want, want_g) in zip(_grads(other, x), _grads(plain, x)):
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-5)
        for k, w in want_g.items():
            torch.testing.assert_close(g[k], w, atol=1e-5 * w.abs().max().item() + 1e-7, rtol=1e-5, msg=k)
    assert get_step(other) == get_step(plain) == 2  # the recomputations advanced no step


class _WholeModel(nn.Module):
    """``Net`` called ``calls`` times per step (a siamese loss), each call checkpointed whole or not."""

    def __init__(self, net, ckpt=None, calls=1):
        super().__init__()
        self.net, self.ckpt, self.calls = net, ckpt, calls

    def loss(self, x):
        run = self.net if self.ckpt is None else (
            lambda z: checkpoint(self.net, z, use_reentrant=self.ckpt == "reentrant"))
        return sum(run(x * (i + 1)).square().sum() for i in range(self.calls))


def _whole_grads(model, x, steps=2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # torch's own stream, for the functional=False runs (a checkpoint restores it)
        xg = x.detach().requires_grad_(True)
        loss = model.loss(xg)
        loss.backward()
        out.append((loss.detach(), {"input": xg.grad, **{k: p.grad.clone() for k, p in model.named_parameters()}}))
    return out


@pytest.mark.parametrize("calls", [1, 2], ids=["one_call", "two_calls"])
@pytest.mark.parametrize("functional", [True, False], ids=["functional", "modules_only"])
@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_a_checkpoint_around_the_whole_model_reruns_each_forward_at_its_step(ckpt, fuse, functional, calls):
    torch.manual_seed(0)
    net, x = Net().train(), seeded(2, 6, 16, seed=1)
    if fuse:
        net, plan = ol.fusion.fuse(net, (x,))
        assert any(d.pattern == "linear_gelu_dropout_linear" for d in plan.fused)
    plain, other = _WholeModel(net, calls=calls), _WholeModel(copy.deepcopy(net), ckpt, calls)
    make_reproducible(plain.net, seed=9, functional=functional)
    make_reproducible(other.net, seed=9, functional=functional)
    for (y, g), (want, want_g) in zip(_whole_grads(other, x), _whole_grads(plain, x)):
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
        for k, w in want_g.items():
            torch.testing.assert_close(g[k], w, atol=1e-6 * w.abs().max().item() + 1e-8, rtol=1e-5, msg=k)
    assert get_step(other.net) == get_step(plain.net) == 2 * calls  # the recomputations advanced no step


class _Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x):
        return torch.tanh(self.net(x))  # the forward's last autograd node saves a tensor: it asks for the rerun


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_a_forward_without_gradients_in_between_does_not_take_the_rerun(ckpt):
    """A training-mode forward under ``no_grad`` (a target, a probe) between the checkpointed forward and its
    backward makes no autograd node; the node asking for the rerun still names the checkpointed forward."""
    torch.manual_seed(0)
    base, x = _Tanh().train(), seeded(2, 6, 16, seed=1)
    grads = []
    for ck in (False, True):
        m = make_reproducible(copy.deepcopy(base), seed=9)
        xg = x.detach().requires_grad_(True)
        y = checkpoint(m, xg, use_reentrant=ckpt == "reentrant") if ck else m(xg)
        with torch.no_grad():
            m(x)
        y.square().sum().backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
        assert get_step(m) == 2
    for k, want in grads[0].items():
        torch.testing.assert_close(grads[1][k], want, atol=1e-6 * want.abs().max().item() + 1e-8, rtol=1e-5, msg=k)


def test_a_training_forward_inside_a_backward_that_recomputes_nothing_is_named():
    torch.manual_seed(0)
    net, x = make_reproducible(Net().train(), seed=9), seeded(2, 6, 16, seed=1)
    net(x).sum().backward()
    leaf = torch.ones(3, requires_grad=True)
    leaf.register_hook(lambda g: net(x).sum() * 0 + g)  # the model run in the backward of an unrelated graph
    with pytest.warns(RuntimeWarning, match="not as the recomputation of one of its last 16 training forwards"):
        (leaf * 2).sum().backward()
    assert get_step(net) == 1


def test_sdpa_dropout_is_reproducible_and_keyed_like_a_functional_dropout():
    torch.manual_seed(0)
    model, x = Net().train(), seeded(2, 6, 16, seed=2)
    outs = []
    for global_seed in (1, 2):
        m = make_reproducible(copy.deepcopy(model), seed=4)
        torch.manual_seed(global_seed)
        outs.append(m(x))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("causal, gqa", [(False, False), (True, False), (True, True)])
def test_counter_sdpa_is_the_formula_with_the_counter_mask(causal, gqa):
    q = seeded(2, 4, 5, 8, seed=1, dtype=torch.float64)
    k = seeded(2, 2 if gqa else 4, 7, 8, seed=2, dtype=torch.float64)
    v = seeded(2, 2 if gqa else 4, 7, 8, seed=3, dtype=torch.float64)
    p, seed = 0.25, SeedPool(1).seed_for("att", 0)
    got = counter_sdpa(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=gqa, seed=seed)
    kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if gqa else (k, v)
    s = q @ kk.transpose(-1, -2) / math.sqrt(8)
    if causal:
        s = s.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(), float("-inf"))
    keep = rng.dropout_mask(seed, 0, (2, 4, 5, 7), p, dtype=torch.float64)
    torch.testing.assert_close(got, (s.softmax(-1) * keep / (1 - p)) @ vv)
    torch.testing.assert_close(counter_sdpa(q, kk, vv, is_causal=causal, seed=seed),  # p = 0: SDPA itself
                               F.scaled_dot_product_attention(q, kk, vv, is_causal=causal))


def test_counter_sdpa_bad_arguments():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        counter_sdpa(q, q, q, torch.zeros(3, 3), 0.1, True, seed=1)
    with pytest.raises(ValueError, match="enable_gqa"):
        counter_sdpa(q, q[:, :3], q[:, :3], dropout_p=0.1, enable_gqa=True, seed=1)
    with pytest.raises(ValueError, match="dropout_p"):
        counter_sdpa(q, q, q, dropout_p=1.5, seed=1)


@pytest.mark.slow
def test_a_hugging_face_model_with_gradient_checkpointing_replays_its_masks():
    pytest.importorskip("transformers")
    from opsnn_lab.demos import zoo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = zoo.build("gpt2", dropout=0.1)  # SDPA attention, functional and module dropouts
        runs = []
        for ckpt in (False, True):
            m = make_reproducible(copy.deepcopy(model).train(), seed=4)
            if ckpt:
                m.gradient_checkpointing_enable()
            torch.manual_seed(ckpt)  # the global RNG must not matter
            out = m(**inputs)
            out.loss.backward()
            runs.append((out.loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}))
    (loss, grads), (ck_loss, ck_grads) = runs
    assert torch.equal(loss, ck_loss)
    for k, g in grads.items():
        torch.testing.assert_close(ck_grads[k], g, atol=1e-6 * g.abs().max().item() + 1e-9, rtol=1e-5, msg=k)


def test_sdpa_dropout_under_autocast_casts_like_sdpa_and_stays_reproducible():
    """Under autocast SDPA casts q, k, v and a float mask to bf16; so does ``counter_sdpa`` (Llama's rotary q/k
    are fp32 there while v is bf16: a routed call refused that mix before)."""
    pytest.importorskip("transformers")
    from opsnn_lab.demos import zoo

    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for global_seed in (0, 5):
            model, inputs = zoo.build("llama", dropout=0.1)
            make_reproducible(model.train(), seed=1)
            torch.manual_seed(global_seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            runs.append((loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    for k, g in ga.items():
        assert torch.equal(gb[k], g), k


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_layer_that_checkpoints_its_own_forward_replays_its_functional_dropouts(reentrant):
    """Hugging Face 5 checkpoints a layer's ``forward`` with its hooks outside; OPT's decoder layer calls
    ``F.dropout`` in that forward (a CheckpointError before, or silently other gradients with reentrant)."""
    T = pytest.importorskip("transformers")
    cfg = T.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                      max_position_embeddings=32, dropout=0.2, attention_dropout=0.2, activation_dropout=0.2,
                      word_embed_proj_dim=32)
    torch.manual_seed(0)
    base = T.OPTForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ckpt in (False, True):
            m = make_reproducible(copy.deepcopy(base), seed=3)
            if ckpt:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            torch.manual_seed(int(ckpt))
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            runs.append((out.loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}))
    (loss, grads), (ck_loss, ck_grads) = runs
    assert torch.equal(loss, ck_loss)
    for k, g in grads.items():  # reentrant accumulates the recomputed layer's gradients in another order
        torch.testing.assert_close(ck_grads[k], g, atol=1e-6 * g.abs().max().item() + 1e-9, rtol=1e-5, msg=k)
