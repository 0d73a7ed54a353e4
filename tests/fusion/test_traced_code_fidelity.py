"""What torch.fx's code would get wrong in a region it rewrites, and how the tracer keeps it right: a power of a
negative constant (fx writes ``-1 ** x``, which Python reads as ``-(1 ** x)``), and a forward that assigns a
computed value to an attribute its next call reads (fx records no assignment: the module stays one call). And what
fusing must not leave behind in the model: what its forwards wrote in the modules or in a cache object they hold."""

from __future__ import annotations

import collections
import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import seeded


def _step(model, x):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    return [y, *torch.autograd.grad((y * seeded(*y.shape, seed=5, dtype=y.dtype)).sum(), [x, *model.parameters()])]


def _same_as_eager(model, x, calls=2):
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    decisions = [d for d in plan.decisions if d.pattern.startswith("group_norm")]
    assert decisions and all(d.fused and d.route.startswith("fx:") for d in decisions), plan.summary()
    for _ in range(calls):  # the state a call leaves behind reaches the next one alike
        for a, b in zip(_step(model, x), _step(fused, x)):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    return fused


class Wavelet(nn.Module):
    """Cosmos' inverse Haar transform weighs its filters by ``(-1) ** arange``; the GroupNorm -> SiLU chain before
    it runs inline (``F.silu``), so fx rewrites this forward."""

    def __init__(self, c=8):
        super().__init__()
        self.norm = nn.GroupNorm(2, c)
        self.register_buffer("arange", torch.arange(c), persistent=False)

    def forward(self, x):
        h = F.silu(self.norm(x))
        sign = (-1) ** self.arange
        return h * sign.view(1, -1, 1) + (-0.5) ** self.arange.view(1, -1, 1) + (-0.0) ** self.arange.view(1, -1, 1)


def test_a_power_of_a_negative_constant_keeps_its_sign_in_the_rewritten_code():
    torch.manual_seed(0)
    fused = _same_as_eager(Wavelet().double(), seeded(2, 8, 5, dtype=torch.float64), calls=1)
    (code,) = {gm.code for gm in fused.__dict__["forward"].variants.values()}
    assert "-1 **" not in code and "power(-1, " in code and "power(-0.5, " in code and "power(-0.0, " in code


class TemporalUpsample(nn.Module):
    """MagVit's temporal upsampler: the first call of a video only notes that it ran (``self.prev = x``); the next
    ones double the frames. Traced code would drop the note and never double."""

    def __init__(self):
        super().__init__()
        self.prev = None

    def forward(self, x):
        if self.prev is None:
            self.prev = x
            return x
        return x.repeat_interleave(2, dim=-1)


class Decoder(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.norm, self.up, self.conv = nn.GroupNorm(4, c), TemporalUpsample(), nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(self.up(F.silu(self.norm(x))))


class Video(nn.Module):
    """Decodes the first frame alone, then the rest (as MagVit's autoencoder calls its decoder), and clears the
    upsampler's note after the video."""

    def __init__(self):
        super().__init__()
        self.decoder = Decoder()

    def forward(self, x):
        if x.isnan().any():  # keeps fx to the decoder
            raise ValueError("nan input")
        out = torch.cat([self.decoder(x[..., :1]), self.decoder(x[..., 1:])], dim=-1)
        self.decoder.up.prev = None
        return out


def test_a_module_assigning_a_computed_value_for_its_next_call_stays_one_call_of_the_rewritten_code():
    torch.manual_seed(0)
    x = seeded(2, 8, 4, dtype=torch.float64)
    model = Video().double()
    again, _ = ol.fusion.fuse(model, (x,))
    assert model.decoder.up.prev is None and again.decoder.up.prev is None  # probes and traces left no note
    fused = _same_as_eager(model, x)
    assert fused(x).shape == (2, 8, 7)  # 1 frame, then 3 doubled
    for gm in fused.decoder.__dict__["forward"].variants.values():
        assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target == "up"] == ["up"]


class LRUCache:  # OmDet-Turbo's cache of text embeddings: a plain object around an OrderedDict
    def __init__(self):
        self.cache = collections.OrderedDict()


class PromptedNorm(nn.Module):
    """Embeds its prompt once and caches the embedding (with its autograd graph) for the calls after."""

    def __init__(self, c=8):
        super().__init__()
        self.embed, self.norm, self.texts = nn.Embedding(16, c), nn.GroupNorm(2, c), LRUCache()
        self.prompt = torch.tensor([3, 1, 4])

    def forward(self, x):
        key = tuple(self.prompt.tolist())
        if key not in self.texts.cache:
            self.texts.cache[key] = self.embed(self.prompt).mean(0)
        return F.silu(self.norm(x)) * self.texts.cache[key][None, :, None]


def test_fusing_leaves_no_entry_in_a_cache_object_the_forward_fills():
    """The analysis's forward filled the model's cache with an embedding whose graph it kept: the model's next
    step backpropagated into the analysis's graph, and the fused copy (a detached copy of the entry) did not, so
    their gradients differed (OmDet-Turbo's text encoder: no gradient in the fused model)."""
    torch.manual_seed(0)
    model, x = PromptedNorm().double(), seeded(2, 8, 5, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert not model.texts.cache and not fused.texts.cache
    assert [d.fused for d in plan.decisions if d.pattern.startswith("group_norm")] == [True]
    for a, b in zip(_step(model, x), _step(fused, x)):  # the embedding's gradient included
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
