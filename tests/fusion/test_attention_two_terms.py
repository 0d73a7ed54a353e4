"""An attention core adding two terms to its scores (T5's decoder self-attention: a learned position bias, then the
causal mask) is an ``attention`` candidate: it fuses through fx, trains as eager with the dropout drawn from the
same stream (``make_reproducible``), the position bias's embedding included, and keeps no T x T tensor."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded
from tests.fusion._reproducible import assert_trains_as_eager


class BiasedSelfAttention(nn.Module):
    def __init__(self, d=16, heads=4, buckets=8, p=0.2):
        super().__init__()
        self.heads, self.dk = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.rel = nn.Embedding(buckets, heads)
        self.dropout = nn.Dropout(p)

    def position_bias(self, t):
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]).clamp(-3, 4) + 3
        return self.rel(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, heads, t, t)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, self.dk).transpose(1, 2) for f in (self.q, self.k, self.v))
        causal = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.dk))
        scores = scores + self.position_bias(t)
        scores = scores + causal
        probs = self.dropout(torch.softmax(scores, dim=-1))
        return x + self.o(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1))


def test_two_additive_terms_fuse_and_train_as_eager():
    torch.manual_seed(0)
    model = nn.Sequential(BiasedSelfAttention(), BiasedSelfAttention()).double()
    x = seeded(3, 12, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    found = [d for d in plan.decisions if d.pattern == "attention"]
    assert len(found) == 2 and all(d.fused and d.route.startswith("fx") for d in found), plan.summary()
    assert "add -> add -> softmax" in found[0].reason
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 2 * 3 * 4 * 12 * 12 * 8  # more than a (B, H, T, T) tensor per layer
    assert_trains_as_eager(model, fused, x)  # the position bias's embedding among them
