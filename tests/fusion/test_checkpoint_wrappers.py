"""The other ways training code checkpoints activations: FSDP's ``apply_activation_checkpointing`` (layers wrapped
in a ``CheckpointWrapper``, reentrant or not), ``torch.utils.checkpoint.checkpoint_sequential`` over a
``Sequential``, and Hugging Face's ``every_n_layers``. Each plans what a checkpointed step keeps (the figure the
fused model measures) and trains as eager."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.demos import zoo
from opsnn_lab.measuring import activation_bytes
from tests.fusion._reproducible import assert_trains_as_eager

wrapper = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")


# transformers' "use_cache=True is incompatible with checkpointing"
pytestmark = pytest.mark.filterwarnings("ignore")


def _kept(model, run) -> int:
    return activation_bytes(lambda: run(model), exclude=tuple(model.parameters()))


def _plans_what_it_keeps(model, fused, plan, run):
    eager = _kept(model, run)
    assert plan.saved_bytes == eager - _kept(fused, run) > 0
    assert plan.activation_bytes == eager  # the checkpoints' inputs included, the kwargs a closure holds not


def _plans_and_trains_as_eager(model, fused, plan, run):
    _plans_what_it_keeps(model, fused, plan, run)
    _same_gradients(model, fused, run)


def _same_gradients(model, fused, run, rtol=1e-5):
    grads = []
    for m in (model, fused):
        ol.consistency.make_reproducible(m, seed=3)
        m.zero_grad(set_to_none=True)
        run(m).backward()  # reentrant checkpointing takes backward() only
        grads.append([p.grad for p in m.parameters()])
    largest = max(float(g.abs().max()) for g in grads[0] if g is not None)
    for (name, _), a, b in zip(model.named_parameters(), *grads):
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-6 * largest, msg=name)


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_fsdp_checkpoint_wrapped_layers_are_fused_inside_their_checkpoint(impl):
    model, inputs = zoo.build("llama", batch=2, seq=16, dropout=0.1)
    model.train()
    layer = type(model.model.layers[0])
    wrap = functools.partial(wrapper.checkpoint_wrapper, checkpoint_impl=getattr(wrapper.CheckpointImpl, impl))
    wrapper.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer))
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    inside = [d for d in plan.fused if "._checkpoint_wrapped_module" in d.modules[0]]
    assert {d.pattern for d in inside} >= {"qkv", "attention", "add_rms_norm", "gated_mlp_silu"}, plan.summary()
    assert all(d.saved_bytes == 0 and "torch.utils.checkpoint call" in d.reason for d in inside)
    # the residual add of one wrapped layer and the next one's norm run under two checkpoints
    across = [d for d in plan.decisions if d.pattern == "add_rms_norm" and not d.fused]
    assert across and all("different activation checkpoints" in d.reason or "inline" in d.reason for d in across)
    _plans_and_trains_as_eager(model, fused, plan, lambda m: m(**inputs).loss)


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(True)
        self.dw, self.dw_bn, self.dw_act = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c), \
            nn.SiLU()

    def forward(self, x):
        return x + self.dw_act(self.dw_bn(self.dw(self.act(self.bn(self.conv(x))))))


class _Segmented(nn.Module):
    """A stem and three blocks run by ``checkpoint_sequential`` in two segments (the last segment runs as it is)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  *(_Block(8) for _ in range(3)))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint_sequential(self.body, 2, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_sequential_segments_are_analysed_as_they_compute(reentrant):
    torch.manual_seed(0)
    model = _Segmented(reentrant).double().train()
    x = torch.randn(2, 3, 10, 9, dtype=torch.float64, requires_grad=reentrant)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    chains = {d.modules[0]: d for d in plan.decisions if d.pattern.startswith("conv_bn_")}
    assert len(chains) == 7 and all(d.fused for d in chains.values()), plan.summary()
    stem = chains.pop("body.0")  # segment 1 (body.0-2) runs under one checkpoint; segment 2 (the blocks) as it is
    assert stem.saved_bytes == 0 and "torch.utils.checkpoint call" in stem.reason
    assert all(d.saved_bytes > 0 for d in chains.values())
    run = lambda m: m(x).sum()  # noqa: E731
    _plans_what_it_keeps(model, fused, plan, run)
    assert_trains_as_eager(model, fused, x)


def test_wrapping_single_modules_declines_the_chains_they_split():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).double().train()
    wrapper.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.BatchNorm2d))
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    (d,) = plan.decisions
    assert not d.fused and "different activation checkpoints" in d.reason and "outside any checkpoint" in d.reason
    assert plan.saved_bytes == 0
    assert_trains_as_eager(model, fused, x)


def test_every_n_layers_checkpoints_some_layers_and_the_others_save_fused():
    T = pytest.importorskip("transformers")
    if not hasattr(T.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip(f"transformers {T.__version__} has no every_n_layers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, attention_dropout=0.1)
    model = T.LlamaForCausalLM(cfg).train()
    model.activation_checkpointing_enable(every_n_layers=2)
    ids = torch.randint(0, 100, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), inputs)
    mlps = {d.modules[0].split(".")[2]: d.saved_bytes for d in plan.fused if d.pattern == "gated_mlp_silu"}
    assert mlps["0"] == mlps["2"] == 0 and mlps["1"] > 0 and mlps["3"] > 0, mlps
    _plans_and_trains_as_eager(model, fused, plan, lambda m: m(**inputs).loss)


class _Resnet(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.SiLU()

    def forward(self, x):
        return x + self.act(self.bn(self.conv(x)))


class _FlaggedBlock(nn.Module):
    """A block whose flag checkpoints its resnets, not its downsampler (diffusers' down blocks)."""

    def __init__(self, c: int):
        super().__init__()
        self.gradient_checkpointing = False
        self.resnets = nn.ModuleList(_Resnet(c) for _ in range(2))
        self.down = nn.Sequential(nn.Conv2d(c, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())

    def forward(self, x):
        for resnet in self.resnets:
            x = torch.utils.checkpoint.checkpoint(resnet, x, use_reentrant=False) \
                if torch.is_grad_enabled() and self.gradient_checkpointing else resnet(x)
        return self.down(x)


class _FlaggedStack(nn.Module):
    """A flagged stack checkpointing each block it calls (an older Hugging Face encoder, a diffusers transformer),
    with a stem and a head outside; or (``blocks_flagged``) unflagged, its blocks flagged."""

    def __init__(self, blocks_flagged: bool):
        super().__init__()
        self.gradient_checkpointing, self.blocks_flagged = False, blocks_flagged
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.blocks = nn.ModuleList(_FlaggedBlock(8) for _ in range(2))
        self.head = nn.Sequential(nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())

    def enable(self):
        for m in [*self.blocks] if self.blocks_flagged else [self]:
            m.gradient_checkpointing = True

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) \
                if torch.is_grad_enabled() and self.gradient_checkpointing else block(x)
        return self.head(x)


@pytest.mark.parametrize("blocks_flagged", [True, False], ids=["flagged-blocks", "flagged-stack"])
def test_a_flag_checkpoints_what_the_modules_code_checkpoints(blocks_flagged):
    # the flag's meaning is the module's code: only the calls it checkpoints are (the downsamplers, stem and head
    # save across the step), which the record sees as the checkpoint calls they are
    torch.manual_seed(0)
    model = _FlaggedStack(blocks_flagged).double().train()
    model.enable()
    x = torch.randn(2, 3, 12, 10, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    chains = {d.modules[0]: d for d in plan.decisions if d.pattern.startswith("conv_bn_")}
    assert len(chains) == 8 and all(d.fused for d in chains.values()), plan.summary()
    checkpointed = {p for p in chains if ".resnets." in p or (not blocks_flagged and p.startswith("blocks."))}
    assert all(chains[p].saved_bytes == 0 and "torch.utils.checkpoint call" in chains[p].reason for p in checkpointed)
    assert all(chains[p].saved_bytes > 0 for p in set(chains) - checkpointed), {p: d.saved_bytes for p, d in
                                                                              chains.items()}
    run = lambda m: m(x).sum()  # noqa: E731
    _plans_what_it_keeps(model, fused, plan, run)
    assert_trains_as_eager(model, fused, x)


def test_a_flag_set_after_fuse_checkpoints_the_fused_model():
    torch.manual_seed(0)
    model = _FlaggedStack(blocks_flagged=True).double().train()
    x = torch.randn(2, 3, 12, 10, dtype=torch.float64, requires_grad=True)
    fused, _ = ol.fusion.fuse(copy.deepcopy(model), (x,))
    run = lambda m: m(x).sum()  # noqa: E731
    before = _kept(fused, run)
    for m in (model, fused):
        m.enable()
    assert _kept(fused, run) < min(before, _kept(model, run))  # the fused resnets dropped with their checkpoint
    assert_trains_as_eager(model, fused, x)


class _SomeStepsWithoutGradients(nn.Module):
    """A block run three times through its checkpoint, the first two without gradients (a recurrent model bounding
    its memory: only the last steps backpropagate)."""

    def __init__(self):
        super().__init__()
        self.block = _Resnet(8)

    def forward(self, x):
        h = torch.zeros_like(x)
        for step in range(3):
            with torch.no_grad() if step < 2 else contextlib.nullcontext():
                h = torch.utils.checkpoint.checkpoint(self.block, h + x, use_reentrant=False)
        return h


def test_a_checkpoint_run_without_gradients_keeps_nothing():
    torch.manual_seed(0)
    model = _SomeStepsWithoutGradients().double().train()
    x = torch.randn(2, 8, 7, 6, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert [d.fused for d in plan.decisions if d.pattern == "conv_bn_silu"] == [True] * 3  # a decision a call
    run = lambda m: m(x).sum()  # noqa: E731
    assert plan.activation_bytes == _kept(model, run)  # one checkpoint's input, not three
    assert plan.saved_bytes == _kept(model, run) - _kept(fused, run)
    assert_trains_as_eager(model, fused, x)
