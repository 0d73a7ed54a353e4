"""Guarded specialisation on sizes (fusion/specialise.py): a forward that branches on a size or iterates over a
shape traces with the example's answers, each answer is a guard checked at every call, a call it does not hold
for runs the original forward, and branches on values or after steps that cannot run twice still stop fx."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.fx as fx
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.plan import FusionPlan
from opsnn_lab.fusion.specialise import SpecialisationMiss, expect, expect_len, metadata_only
from opsnn_lab.fusion.tracer import trace_region
from opsnn_lab.testing import AroundRegion, seeded


class BySize(nn.Module):
    """Branches on a size of a value it computed (as Hugging Face's SDPA attention decides ``is_causal`` from
    ``query.shape[2] > 1``) and unpacks a slice of that value's shape into a new one."""

    def __init__(self, scale_short: bool = False):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
        self.scale_short = scale_short

    def forward(self, x):
        h = self.fc(x)
        if h.shape[1] > 1:  # a sequence, not one token
            h = h * 0.5
        lead = (*h.shape[:-1], 2, 4)
        h = h.view(lead).flatten(-2)
        return self.ln(x + h)  # residual add + LayerNorm, inline: only fx can fuse it


def test_without_an_example_fx_stops_and_with_one_the_answers_are_guards():
    torch.manual_seed(0)
    m, x = BySize(), seeded(2, 5, 8)
    with pytest.raises(fx.proxy.TraceError, match="control flow"):
        trace_region(m, {}, True)
    gm, _ = trace_region(m, {}, True, example={"x": x})
    # h.shape[1] > 1; len(h.shape[:-1]), asked by the star twice; each with the line that asked
    assert [a[::2] for a in gm.meta["answers"]] == [["bool", True], ["len", 2], ["len", 2]]
    assert "test_specialise.py" in gm.meta["answers"][0][1] and "if h.shape[1] > 1" in gm.meta["answers"][0][1]
    guards = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in (expect, expect_len)]
    assert guards == [expect, expect_len, expect_len]
    torch.testing.assert_close(gm(x), m(x))
    with pytest.raises(SpecialisationMiss, match="False here, True when traced"):
        gm(seeded(2, 1, 8))  # one token: the traced code took the other branch
    with pytest.raises(SpecialisationMiss, match="3 entries here, 2 when traced"):
        gm(seeded(2, 3, 5, 8))
    again, _ = trace_region(m, {}, True, answers=gm.meta["answers"])  # the rewrite: the answers, no example
    assert again.code == gm.code
    with pytest.raises(fx.proxy.TraceError, match="a question on sizes the analysis did not"):
        trace_region(m, {}, True, answers=gm.meta["answers"][:1])


def test_the_example_is_left_as_it_was_and_gradients_are_not_recorded():
    torch.manual_seed(0)
    m, x = BySize(), seeded(2, 5, 8, requires_grad=True)
    before = x.detach().clone()
    trace_region(m, {}, True, example={"x": x})
    assert torch.equal(x, before) and x.grad is None and m.fc.weight.grad is None


class ByValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # a value, not a size: never answered from the example
            h = -h
        return h


def test_a_branch_on_values_still_stops_fx():
    torch.manual_seed(0)
    with pytest.raises(fx.proxy.TraceError, match="control flow"):
        trace_region(ByValue(), {}, True, example={"x": seeded(2, 5, 8)})


class AfterState(nn.Module):
    """A step that cannot run twice before the branch: a call that misses the guard would run it again."""

    def __init__(self, first: nn.Module):
        super().__init__()
        self.first, self.fc = first, nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        if h.shape[1] > 1:
            h = self.fc(h)
        return h


@pytest.mark.parametrize("first, why", [(nn.BatchNorm1d(5), "has buffers"),
                                        (nn.ReLU(inplace=True), "writes in place")])
def test_a_branch_after_a_step_that_cannot_run_twice_stops_fx_and_says_where(first, why):
    torch.manual_seed(0)
    with pytest.raises(fx.proxy.TraceError, match=f"{why}") as info:
        trace_region(AfterState(first), {}, True, example={"x": seeded(2, 5, 8)})
    assert "test_specialise.py" in str(info.value) and "if h.shape[1] > 1" in str(info.value)


class DrawsThenBranches(nn.Module):
    """Draws before a branch on a size: a dropout (torch's, or a counter stream), and a label dropout as diffusers'
    class embedding writes it (``torch.rand(n) < p`` picks the rows that become the unconditional class)."""

    def __init__(self, drop: nn.Module | None = None):
        super().__init__()
        self.drop, self.fc, self.ln = drop or nn.Dropout(0.5), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        keep = (torch.rand(x.shape[0], device=x.device) >= 0.3).to(x.dtype)[:, None, None]
        h = self.drop(self.fc(x)) * keep
        if h.shape[1] > 1:
            h = h * 0.5
        return self.ln(x + h)


def test_a_guard_after_torchs_draws_keeps_the_generators_and_a_miss_draws_what_eager_draws():
    torch.manual_seed(0)
    m, x = DrawsThenBranches(), seeded(2, 5, 8)
    state = torch.get_rng_state()
    gm, _ = trace_region(m, {}, True, example={"x": x})
    assert torch.equal(torch.get_rng_state(), state)  # answering drew on a copy of the generators
    assert gm.meta["restore_rng"] and [a[::2] for a in gm.meta["answers"]] == [["bool", True]]
    model = AroundRegion(DrawsThenBranches()).double()
    fused, plan = ol.fusion.fuse(model.train(), (seeded(2, 5, 8, dtype=torch.float64),))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    for inp in (seeded(3, 5, 8, dtype=torch.float64), seeded(3, 1, 8, dtype=torch.float64)):  # traced; a miss
        torch.manual_seed(5)
        want, after_eager = model(inp), torch.rand(4)
        torch.manual_seed(5)
        got, after_fused = fused(inp), torch.rand(4)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # the same masks and label drops
        assert torch.equal(after_fused, after_eager)  # and as many draws: the generators are where eager left them
    # made reproducible, the region's keyed calls are counted again from where the aborted attempt began
    eager = ol.consistency.make_reproducible(copy.deepcopy(model), seed=7)
    fused = ol.consistency.make_reproducible(fused, seed=7)
    for inp in (seeded(3, 5, 8, dtype=torch.float64), seeded(3, 1, 8, dtype=torch.float64)):
        torch.testing.assert_close(fused(inp), eager(inp), rtol=1e-12, atol=1e-12)


def test_a_miss_after_a_counter_stream_drew_puts_the_stream_back():
    torch.manual_seed(0)
    model = AroundRegion(DrawsThenBranches(ol.ops.Dropout(0.5, seed=3))).double()
    fused, plan = ol.fusion.fuse(model.train(), (seeded(2, 5, 8, dtype=torch.float64),))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    for inp in (seeded(3, 5, 8, dtype=torch.float64), seeded(3, 1, 8, dtype=torch.float64)):  # traced; a miss
        outs = []
        for m in (model, fused):
            m.block.drop.set_rng(3, 0)
            torch.manual_seed(5)
            outs.append(m(inp))
            assert m.block.drop.rng_step == 1  # one draw, as eager's: the aborted attempt's was put back
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


class Cache:
    def __init__(self):
        self.keys = []

    def update(self, k):
        self.keys.append(k)
        return torch.cat(self.keys, 1)


class FromACache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, cache):
        k = cache.update(self.fc(x))
        if k.shape[1] > x.shape[1]:  # depends on what the cache held: not worked out on the example
            k = k[:, -x.shape[1]:]
        return k


def test_a_size_that_an_objects_method_makes_is_not_worked_out_and_the_object_is_untouched():
    torch.manual_seed(0)
    cache, x = Cache(), seeded(2, 5, 8)
    with pytest.raises(fx.proxy.TraceError, match="calls `update` on an object") as info:
        trace_region(FromACache(), {}, True, facts={"cache": {"type": f"{__name__}:Cache"}},
                     example={"x": x, "cache": cache})
    assert cache.keys == []
    assert "config.use_cache = False" in str(info.value)  # says how a training run avoids it


class FromAStore(FromACache):
    def forward(self, x, store):
        k = store.update(self.fc(x))
        if k.shape[1] > x.shape[1]:
            k = k[:, -x.shape[1]:]
        return k


def test_an_object_that_is_not_a_cache_gets_no_cache_advice():
    with pytest.raises(fx.proxy.TraceError, match="calls `update` on an object") as info:
        trace_region(FromAStore(), {}, True, facts={"store": {"type": f"{__name__}:Cache"}},
                     example={"x": seeded(2, 5, 8), "store": Cache()})
    assert "use_cache" not in str(info.value)


def test_metadata_only_is_sizes_dtypes_and_arithmetic_on_them():
    g = fx.symbolic_trace(lambda x: (x.shape[0] + 1 > x.size(1), x.dtype == torch.float16, x.sum() > 0)).graph
    out = next(n for n in g.nodes if n.op == "output")
    sizes, dtype, value = out.args[0]
    assert metadata_only(sizes) and metadata_only(dtype) and not metadata_only(value)


def test_a_fused_region_runs_its_original_forward_where_a_guard_misses():
    torch.manual_seed(0)
    model, x = AroundRegion(BySize()).double(), seeded(3, 5, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    region = next(r for r in plan.routes if r["path"] == "block")
    assert [a[2] for a in region["answers"]] == [True, 2, 2]
    (slot,) = [m for n, m in fused.block.named_children() if n.startswith("fused_")]
    calls = []
    hook = slot.register_forward_hook(lambda *_: calls.append(1))
    for inp, traced in ((x, True), (seeded(3, 1, 8, dtype=torch.float64, requires_grad=True), False)):
        calls.clear()
        want, got = model(inp), fused(inp)
        assert calls == ([1] if traced else [])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (g_want,) = torch.autograd.grad(want.sin().sum(), inp)
        (g_got,) = torch.autograd.grad(got.sin().sum(), inp)
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
    hook.remove()
    restored = pickle.loads(pickle.dumps(fused))
    torch.testing.assert_close(restored(x), model(x), rtol=1e-12, atol=1e-12)
    again = ol.fusion.apply(model, FusionPlan.from_json(plan.to_json()))  # answers replayed from JSON
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)


class ByChunks(nn.Module):
    """Iterates over the pieces of a split (ProphetNet, DiffLlama): how many is a question on sizes."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(4)

    def forward(self, x):
        h = sum(p * (i + 1) for i, p in enumerate(self.fc(x).chunk(2, dim=-1)))
        return self.ln(x[..., :4] + h)


def test_the_number_of_pieces_a_split_makes_is_answered_and_guarded():
    torch.manual_seed(0)
    m, x = ByChunks(), seeded(2, 5, 8)
    gm, _ = trace_region(m, {}, True, example={"x": x})
    assert [a[2] for a in gm.meta["answers"]] == [2]
    torch.testing.assert_close(gm(x), m(x))
    gm.fc.weight, gm.fc.bias = nn.Parameter(torch.randn(1, 8)), nn.Parameter(torch.randn(1))  # chunk(2) of 1: 1 piece
    with pytest.raises(SpecialisationMiss, match="1 entries here, 2 when traced"):
        gm(x)


class ByTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, dims: tuple):
        if min(dims) <= 2:  # Swin's `if min(input_resolution) <= self.window_size`
            x = x * 0.5
        h = self.fc(x).view(x.shape[0], *dims, -1).flatten(1, 2)
        return self.ln(x + h)


class HoldsByTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.dims = ByTuple(), (2, 3)

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: `block` is the region
            x = x * 0.5
        return self.block(x, self.dims)


def test_a_tuple_of_plain_values_is_specialised_and_another_tuple_is_traced_for_its_own():
    torch.manual_seed(0)
    model, x = HoldsByTuple().double(), seeded(3, 6, 8, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("add_layer_norm", "fx:block")]
    assert next(r for r in plan.routes if r["path"] == "block")["concrete"] == {"dims": (2, 3)}
    (slot,) = [m for n, m in fused.block.named_children() if n.startswith("fused_")]
    calls = []
    hook = slot.register_forward_hook(lambda *_: calls.append(1))
    for dims in ((2, 3), (3, 2), (1, 6), (3, 2)):  # another tuple: the region traced for it (its alternate), fused
        model.dims = fused.dims = dims
        calls.clear()
        want, got = model(x), fused(x)
        assert calls == [1], dims
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert [k for k, alt in fused.block.__dict__["forward"].alternates.items() if alt is not None] == [
        (("dims", (3, 2)),), (("dims", (1, 6)),)]
    hook.remove()
    model.dims = fused.dims = (2, 3)
    again = ol.fusion.apply(model, FusionPlan.from_json(plan.to_json()))  # the tuple is a list in JSON
    again.block.fused_add_layer_norm_0.register_forward_hook(lambda *_: calls.append(2))
    torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)
    assert calls[-1] == 2


class ByDtype(nn.Module):
    """Fills with the lowest value of a computed tensor's dtype (Hugging Face's position-bias masks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h.masked_fill(x < 0, torch.finfo(h.dtype).min)


def test_a_dtype_handed_to_finfo_is_the_examples_and_guarded():
    torch.manual_seed(0)
    m, x = ByDtype(), seeded(2, 5, 8)
    with pytest.raises(TypeError):
        trace_region(m, {}, True)
    gm, _ = trace_region(m, {}, True, example={"x": x})
    assert [a[::2] for a in gm.meta["answers"]] == [["dtype", "float32"]]
    assert isinstance(torch.finfo, type) and isinstance(torch.iinfo, type)  # put back after the trace
    torch.testing.assert_close(gm(x), m(x))
    m.double()
    with pytest.raises(SpecialisationMiss, match="torch.float64 here, torch.float32 when traced"):
        gm(x.double())
    again, _ = trace_region(m.float(), {}, True, answers=gm.meta["answers"])
    assert again.code == gm.code


class MergesHeadsAfterDropout(nn.Module):
    """Self-attention as RoFormer, MPNet, RemBert, Tapas... write it: dropout on the probabilities, then the heads
    merged back through a shape built from sizes (``view(*ctx.size()[:-2], hidden)``: fx asks its length), then
    the residual add and LayerNorm. ``squeeze``: a step whose result's rank follows sizes comes first."""

    def __init__(self, p: float = 0.1, squeeze: bool = False):
        super().__init__()
        self.qkv, self.drop, self.ln = nn.Linear(8, 24), nn.Dropout(p), nn.LayerNorm(8)
        self.squeeze = squeeze

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:-1], 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1))
        ctx = (probs @ v).permute(0, 2, 1, 3).contiguous()
        if self.squeeze:
            ctx = ctx.squeeze(0).unsqueeze(0)
        return self.ln(x + ctx.view(*ctx.size()[:-2], 8))


def test_the_number_of_sizes_after_a_dropout_is_decided_by_the_arguments_ranks_checked_before_the_call():
    from opsnn_lab.fusion.regions import tensor_facts

    torch.manual_seed(0)
    m, x = MergesHeadsAfterDropout(), seeded(2, 5, 8)
    facts = tensor_facts(m, ((x,), {}))
    gm, _ = trace_region(m, {}, True, facts=facts, example={"x": x})
    kinds = [a[0] for a in gm.meta["answers"]]
    assert kinds == ["len", "len"]  # ctx's sizes after the dropout, asked twice by the star (x's rank is a fact)
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is expect_len]
    assert gm.meta["facts_read"]["x"]["ndim"] == 3  # checked when a call comes in, before anything runs
    assert not gm.meta["restore_rng"]
    # a squeeze's rank follows sizes: the guard stays, after the dropout's draw (the generators are kept)
    gm, _ = trace_region(MergesHeadsAfterDropout(squeeze=True), {}, True, facts=facts, example={"x": x})
    assert [n for n in gm.graph.nodes if n.op == "call_function" and n.target is expect_len]
    assert gm.meta["restore_rng"]


def test_attention_after_its_dropout_fuses_and_draws_the_masks_eager_draws_at_any_length():
    torch.manual_seed(0)
    model, x = AroundRegion(MergesHeadsAfterDropout()).double(), seeded(2, 5, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model.train(), (x,))
    assert {d.pattern for d in plan.decisions if d.fused and d.route == "fx:block"} >= {"attention"}
    restored = pickle.loads(pickle.dumps(fused))
    again = ol.fusion.apply(model, FusionPlan.from_json(plan.to_json()))  # traced again from the plan's facts
    for m in (restored, again):
        assert any(n.startswith("fused_attention") for n, _ in m.block.named_children())
        torch.testing.assert_close(m.eval()(x), model.eval()(x), rtol=1e-12, atol=1e-12)
    model.train()
    eager = ol.consistency.make_reproducible(model, seed=7)
    fused = ol.consistency.make_reproducible(fused, seed=7)
    for inp in (x, seeded(3, 11, 8, seed=1, dtype=torch.float64)):  # another batch and length, the same rank
        inp = inp.requires_grad_()
        want, got = eager(inp), fused(inp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not torch.equal(want, model.eval()(inp).detach()) and model.train() is model  # masks were drawn
        (g_want,), (g_got,) = (torch.autograd.grad(o.sin().sum(), inp) for o in (want, got))
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


class FeedForward(nn.Module):
    """An MLP of the model's own class, its GELU inline: fusion patches its forward whole (``module:whole``)."""

    def __init__(self, p: float):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


class BranchesOnRankAfterDropout(nn.Module):
    """A transformer block as Hugging Face diffusers writes it: the attention output (after its dropout) added to
    the residual, then ``if hidden_states.ndim == 4: squeeze(1)``; the same after the MLP (with its dropout),
    whose sum the next LayerNorm reads."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.ln1, self.attn_out, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(p)
        self.ln2, self.ln3 = nn.LayerNorm(8), nn.LayerNorm(8)
        self.ff = FeedForward(p)

    def forward(self, x):
        h = self.drop(self.attn_out(self.ln1(x))) + x
        if h.ndim == 4:
            h = h.squeeze(1)
        h = self.ff(self.ln2(h)) + h
        if h.ndim == 4:
            h = h.squeeze(1)
        return self.ln3(h)


def test_a_branch_on_a_rank_after_a_dropout_is_decided_by_the_arguments_ranks_checked_before_the_call():
    from opsnn_lab.fusion.regions import tensor_facts

    m, x = BranchesOnRankAfterDropout(), seeded(2, 5, 8)
    gm, _ = trace_region(m, {}, True, example={"x": x})  # without the argument's rank: a guard after the draw
    assert [n for n in gm.graph.nodes if n.op == "call_function" and n.target is expect] and gm.meta["restore_rng"]
    gm, _ = trace_region(m, {}, True, facts=tensor_facts(m, ((x,), {})), example={"x": x})
    assert [a[::2] for a in gm.meta["answers"]] == [["bool", False]] * 2
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is expect]
    assert not gm.meta["restore_rng"]
    assert gm.meta["facts_read"]["x"]["ndim"] == 3
    m.eval()
    torch.testing.assert_close(gm.eval()(x), m(x))

    torch.manual_seed(0)
    model = AroundRegion(BranchesOnRankAfterDropout()).double()
    fused, plan = ol.fusion.fuse(model.train(), (seeded(2, 5, 8, dtype=torch.float64),))
    # the MLP is patched first; the block's code, traced again for its rewrite, calls it as one module whose
    # fused op keeps its input's rank, so the second guard is dropped there too
    fused_routes = sorted((d.pattern, d.route) for d in plan.decisions if d.fused)
    assert fused_routes == [("add_layer_norm", "fx:block")] * 2 + [
        ("layer_norm", "module:chain"), ("linear_gelu_dropout_linear", "module:whole")], plan.summary()
    model.eval()
    fused.eval()
    for inp in (seeded(2, 5, 8, dtype=torch.float64), seeded(3, 1, 7, 8, seed=1, dtype=torch.float64)):
        torch.testing.assert_close(fused(inp), model(inp), rtol=1e-12, atol=1e-12)  # a 4-d call: the original


class WrapsAStep(nn.Module):
    """diffusers' UNet2DModel: ``if not torch.is_tensor(timestep): timestep = torch.tensor([timestep])``."""

    def __init__(self, ask_of_computed: bool = False):
        super().__init__()
        self.fc, self.ln, self.ask_of_computed = nn.Linear(8, 8), nn.LayerNorm(8), ask_of_computed

    def forward(self, x, step):
        if not torch.is_tensor(step):
            step = torch.tensor([step], dtype=x.dtype)
        h = self.fc(x)
        if self.ask_of_computed and torch.is_tensor(h):
            h = h * 2
        return self.ln(x + h * step[:, None, None])


def test_is_tensor_of_a_tensor_argument_is_true_and_of_a_computed_value_stops_fx():
    from opsnn_lab.fusion.regions import tensor_facts

    torch.manual_seed(0)
    m, x, step = WrapsAStep(), seeded(2, 5, 8), torch.tensor([0.5, 2.0])
    facts = tensor_facts(m, ((x, step), {}))
    gm, _ = trace_region(m, {}, True, facts=facts, example={"x": x, "step": step})
    assert "step" in gm.meta["facts_read"]  # a tensor at each call, or the original forward runs
    torch.testing.assert_close(gm(x, step), m(x, step))
    with pytest.raises(fx.proxy.TraceError, match="torch.is_tensor of a traced value"):
        trace_region(WrapsAStep(ask_of_computed=True), {}, True, facts=facts, example={"x": x, "step": step})
    assert torch.is_tensor(x) and not torch.is_tensor(1.0)  # put back after the trace
