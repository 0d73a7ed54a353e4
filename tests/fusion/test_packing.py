"""Packed projection weights (FusedQKV, FusedGatedMLP) stay packed when the fused model is converted."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.patch import fused_ops
from opsnn_lab.ops.qkv import pack
from opsnn_lab.testing import seeded


class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(d, 2 * d, bias=False),
                                                        nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Attention with q/k/v Linears (module:qkv) and a SwiGLU MLP, a module of its own (module:whole); with
    ``inline=True`` the MLP's Linears are the block's and its code is in this forward (the block's fx region)."""

    def __init__(self, d=16, inline=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in range(3))
        self.mlp = MLP(d)
        if inline:
            self.gate_proj, self.up_proj, self.down_proj = self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj
            del self.mlp
        self.inline = inline

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (2, -1)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        h = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return h + (self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) if self.inline else self.mlp(h))


class Model(nn.Module):
    def __init__(self, inline=False):
        super().__init__()
        self.block = Block(inline=inline)

    def forward(self, x):
        return self.block(x)


def _fused(inline=False):
    torch.manual_seed(0)
    model, x = Model(inline).train(), seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    routes = {d.pattern: d.route for d in plan.fused}
    assert routes["qkv"] == "module:qkv"
    assert routes["gated_mlp_silu"] == ("fx:<model>" if inline else "module:whole"), routes
    ops = [op for op in fused_ops(fused) if hasattr(op, "repack")]
    assert {type(op).__name__ for op in ops} == {"FusedQKV", "FusedGatedMLP"}, plan.decisions
    assert all(op.packed for op in ops)
    return model, fused, ops, x


CONVERSIONS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "double()": lambda m: m.double(),
    "half()": lambda m: m.half(),
    "to(dtype=float64) of a wrapper": lambda m: nn.Sequential(m).to(dtype=torch.float64)[0],
}


@pytest.mark.parametrize("inline", [False, True], ids=["module routes", "fx region"])
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_a_converted_fused_model_reads_its_weights_packed_and_computes_what_the_converted_model_does(conversion,
                                                                                                   inline):
    """Before, every Parameter got a tensor of its own and each forward and backward concatenated the weights
    again (1.055x the step time: patch.RepackAfterApply)."""
    model, fused, ops, x = _fused(inline)
    convert = CONVERSIONS[conversion]
    fused, model = convert(fused), convert(model)
    dtype = next(model.parameters()).dtype
    assert all(op.packed for op in ops), [(type(op).__name__, op.packed) for op in ops]
    assert all(p.dtype == dtype for p in fused.parameters())
    # the packed buffers hold the converted values of the model's own Parameters, and compute what it computes
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters()):
        assert torch.equal(p, q), name
    x = x.to(dtype)
    want, got = model(x), fused(x)
    tol = {torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    got.float().square().sum().backward()
    want.float().square().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), rtol=4 * tol, atol=4 * tol, msg=name)


def test_an_update_after_conversion_reaches_the_packed_buffer():
    model, fused, ops, x = _fused()
    fused.double(), model.double()
    x = x.double()
    for m in (model, fused):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).square().sum().backward()
        opt.step()
    assert all(op.packed for op in ops)
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)


def test_copies_convert_their_own_weights_and_revert_drops_the_repack():
    _, fused, ops, x = _fused()
    for twin in (copy.deepcopy(fused), torch.load(_saved(fused), weights_only=False)):
        twin.to(torch.bfloat16)
        twin_ops = [op for op in fused_ops(twin) if hasattr(op, "repack")]
        assert all(op.packed for op in twin_ops) and not set(map(id, twin_ops)) & set(map(id, ops))
        assert all(p.dtype == torch.float32 for p in fused.parameters()) and all(op.packed for op in ops)
    ol.fusion.revert(fused)
    assert "_apply" not in fused.__dict__
    fused.double()  # the class's own _apply: nothing repacks (nothing reads the packed buffers any more)
    assert not any(op.packed for op in ops)


@pytest.mark.parametrize("inline", [False, True], ids=["module routes", "fx region"])
def test_a_state_dict_loaded_with_assign_is_packed_again(inline):
    """``load_state_dict(sd, assign=True)`` gives every Parameter the checkpoint's own tensor; the fused model packs
    them again (``patch.repack_after_load``)."""
    model, fused, ops, x = _fused(inline)
    torch.manual_seed(3)
    checkpoint = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    for m in (model, fused):
        m.load_state_dict({k: v.clone() for k, v in checkpoint.items()}, assign=True)
    assert all(op.packed for op in ops)
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # random-normal weights give attention logits in the tens, whose softmax amplifies the packed GEMM's rounding
    # (another summation order; an AMD EPYC's GEMM blocking put it at 5e-5 of the largest output): scaled to it. A
    # weight left unpacked would be off by the output's own size
    want = model(x)
    torch.testing.assert_close(fused(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    fused.load_state_dict(model.state_dict())  # in place: still packed, and the hook leaves them as they are
    assert all(op.packed for op in ops)
    assert ol.fusion.revert(fused)._load_state_dict_post_hooks == {}


def test_a_submodule_converted_alone_falls_back_until_repack():
    _, fused, ops, x = _fused()
    fused.block.to(torch.float64)  # not through the fused model's _apply
    assert not any(op.packed for op in ops)
    fused.block(x.double())  # the copying fallback is correct meanwhile
    assert ol.fusion.repack(fused) == len(ops) and all(op.packed for op in ops)
    assert ol.fusion.repack(fused) == 0


def test_swapping_conversion_is_repacked_too():
    _, fused, ops, x = _fused()
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        fused.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert all(op.packed for op in ops)


def test_pack_leaves_mixed_dtypes_and_adjacent_tensors_alone():
    a, b = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    pack([a, b])  # a conversion half done: concatenating would make `a` float64
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    b.data = b.data.float()
    pack([a, b])
    assert b.data_ptr() == a.data_ptr() + a.numel() * 4 and torch.equal(b, torch.zeros(4, 3))
    ptr = a.data_ptr()
    pack([a, b])  # adjacent already: no new buffer
    assert a.data_ptr() == ptr
    pack([a, None])


def _saved(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return buf
