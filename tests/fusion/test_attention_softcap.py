"""An attention core whose scores are capped before the mask, ``c * tanh(s / c)`` (Gemma 2's
``attn_logit_softcapping``), is an ``attention`` candidate: it fuses through fx in the forms code writes it, trains
as eager with the dropout drawn from the same stream (``make_reproducible``), keeps no T x T tensor, and a tanh in
another form is declined with why."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded
from tests.fusion._hf import transformers_with
from tests.fusion._reproducible import assert_trains_as_eager

FORMS = {  # the cap as code writes it; "other" is no cap (two constants)
    "gemma": lambda s, c: torch.tanh(s / c) * c,
    "product": lambda s, c: c * (s * (1.0 / c)).tanh(),
    "other": lambda s, c: torch.tanh(s / c) * (2 * c),
}


class CappedSelfAttention(nn.Module):
    def __init__(self, form, d=16, heads=4, cap=2.0, p=0.2):
        super().__init__()
        self.form, self.cap, self.heads, self.dk = form, cap, heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.dropout = nn.Dropout(p)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, self.dk).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.dk))
        scores = FORMS[self.form](scores, self.cap) + mask
        probs = self.dropout(torch.softmax(scores, dim=-1))
        return x + self.o(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1))


class Stack(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.layers = nn.ModuleList(CappedSelfAttention(form) for _ in range(2))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, mask)
        return x


@pytest.mark.parametrize("form", ["gemma", "product"])
def test_a_capped_core_fuses_and_trains_as_eager(form):
    torch.manual_seed(0)
    model = Stack(form).double()
    x = seeded(3, 12, 16, dtype=torch.float64, scale=4.0)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    found = [d for d in plan.decisions if d.pattern == "attention"]
    assert len(found) == 2 and all(d.fused and d.route.startswith("fx") for d in found), plan.summary()
    assert found[0].params["softcap"] == pytest.approx(2.0)
    assert "tanh" in found[0].reason
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    # eager keeps the tanh, the fp32 probabilities, the dropout's mask and the dropped probabilities per layer
    assert plan.saved_bytes == eager - ours > 2 * 2 * 3 * 4 * 12 * 12 * 8
    assert_trains_as_eager(model, fused, x)


def test_a_tanh_in_another_form_is_declined_with_why():
    model = Stack("other").double()
    plan = ol.fusion.analyze(model, (seeded(2, 6, 16, dtype=torch.float64),))
    found = [d for d in plan.decisions if d.pattern == "attention"]
    assert len(found) == 2 and not any(d.fused for d in found)
    assert "c * tanh(s / c)" in found[0].reason, found[0].reason


def test_gemma2_attention_with_dropout_fuses_and_trains_as_eager():
    T = transformers_with("Gemma2Config", "Gemma2ForCausalLM")
    cfg = T.Gemma2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, query_pre_attn_scalar=8,
                         attn_logit_softcapping=1.0, final_logit_softcapping=None, attention_dropout=0.25,
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T.Gemma2ForCausalLM(cfg).train()  # float32: its softmax runs in fp32 (a float64 model's is declined)
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    found = [d for d in plan.decisions if d.pattern == "attention"]
    assert len(found) == 2 and all(d.fused for d in found), [d.reason for d in found]
    assert found[0].params["softcap"] == 1.0 and found[0].params["dropout_p"] == 0.25
    runs = []
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=3)
        loss = m(**inputs).loss
        runs.append((loss, torch.autograd.grad(loss, list(m.parameters()))))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    largest = max(float(g.abs().max()) for g in grads_a)
    for a, b in zip(grads_a, grads_b):  # rounding apart (the cap in another order), the same dropout masks
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * largest)
