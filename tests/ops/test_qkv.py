import pytest
import torch
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.ops import FusedQKV
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, seeded


def _linears(k=16, outs=(16, 8, 8), biases=(True, True, True), dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Linear(k, o, bias=b).to(dtype) for o, b in zip(outs, biases)]


def _params(lins):
    return [p for lin in lins for p in (lin.weight, lin.bias) if p is not None]


def _fwd_bwd(fn, x, params, seed=50):
    outs = fn(x)
    grads_out = [seeded(*o.shape, seed=seed + i, dtype=o.dtype, device=o.device) for i, o in enumerate(outs)]
    for t in [x, *params]:
        t.grad = None
    torch.autograd.backward(list(outs), grads_out)
    return [o.detach() for o in outs], [t.grad.clone() for t in [x, *params]]


def _eager(lins):
    return lambda x: tuple(lin(x) for lin in lins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("outs, biases", [((16, 16, 16), (True, True, True)), ((16, 8, 8), (True, False, True)),
                                          ((5, 7, 3), (False, False, False))])
def test_forward_and_every_gradient_match_three_linears(dtype, outs, biases):
    lins = _linears(outs=outs, biases=biases, dtype=dtype)
    fused = FusedQKV.from_modules(*lins)
    x = seeded(3, 5, 16, seed=1, dtype=dtype, requires_grad=True)
    outs_f, grads_f = _fwd_bwd(fused, x, _params(lins))
    outs_e, grads_e = _fwd_bwd(_eager(lins), x, _params(lins))
    for a, b in zip(outs_f + grads_f, outs_e + grads_e):
        assert_close_dtype(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(dtype):
    lins, lins64 = _linears(dtype=dtype), _linears(dtype=torch.float64)
    x64 = seeded(4, 16, seed=2, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref = _fwd_bwd(_eager(lins64), x64, _params(lins64))
    eager = _fwd_bwd(_eager(lins), x, _params(lins))
    fused = _fwd_bwd(FusedQKV.from_modules(*lins), x, _params(lins))
    for i, (f, e, r) in enumerate(zip(fused[0] + fused[1], eager[0] + eager[1], ref[0] + ref[1])):
        assert_within_eager_error(f, e, r, name=f"tensor {i}")


def test_non_contiguous_empty_and_unused_outputs():
    lins = _linears()
    fused = FusedQKV.from_modules(*lins)
    x = non_contiguous(seeded(6, 16, seed=3)).requires_grad_(True)
    for a, b in zip(_fwd_bwd(fused, x, _params(lins))[1], _fwd_bwd(_eager(lins), x, _params(lins))[1]):
        assert_close_dtype(a, b)
    q, k, v = fused(torch.zeros(0, 16))
    assert q.shape == (0, 16) and k.shape == v.shape == (0, 8)
    for t in _params(lins):
        t.grad = None
    q, _, _ = fused(x)
    q.sum().backward()  # k and v unused: their gradients are zero, q's is the eager one
    assert not lins[1].weight.grad.any() and not lins[2].bias.grad.any()


def test_packing_keeps_parameters_and_follows_optimizer_updates():
    lins = _linears()
    before = [p.detach().clone() for p in _params(lins)]
    ids = [id(p) for p in _params(lins)]
    fused = FusedQKV.from_modules(*lins)
    assert fused.packed and [id(p) for p in _params(lins)] == ids
    assert all(torch.equal(a, b) for a, b in zip(before, _params(lins)))
    x = seeded(3, 16, seed=4)
    opt = torch.optim.SGD(_params(lins), lr=0.5)
    sum(o.sum() for o in fused(x)).backward()
    opt.step()  # writes into the packed buffer through the original Parameters
    for a, b in zip(fused(x), _eager(lins)(x)):
        assert_close_dtype(a, b)
    lins[1].weight.data = lins[1].weight.data.clone()  # someone re-points one weight
    assert not fused.packed
    for a, b in zip(fused(x), _eager(lins)(x)):  # torch.cat fallback: still correct
        assert_close_dtype(a, b)
    fused.repack()
    assert fused.packed and [id(p) for p in _params(lins)] == ids


def test_registration_and_state_dict_keys():
    lins = _linears()
    assert list(FusedQKV.from_modules(*lins).state_dict()) == ["q.weight", "q.bias", "k.weight", "k.bias",
                                                              "v.weight", "v.bias"]
    ref = FusedQKV.from_modules(*lins, register=False)
    assert list(ref.state_dict()) == [] and ref.linears[0] is lins[0]


def test_saves_no_more_than_eager():
    lins = _linears()
    x = seeded(8, 16, seed=5, requires_grad=True)
    assert activation_bytes(lambda: FusedQKV.from_modules(*lins)(x * 1)) <= activation_bytes(
        lambda: _eager(lins)(x * 1))


def test_bad_arguments_name_the_argument():
    q, k, v = _linears()
    with pytest.raises(ValueError, match="k"):
        FusedQKV.from_modules(q, nn.Linear(15, 8), v)
    with pytest.raises(TypeError, match="v"):
        FusedQKV.from_modules(q, k, nn.Linear(16, 8).double())
    with pytest.raises(TypeError, match="q"):
        FusedQKV.from_modules(nn.ReLU(), k, v)
    fused = FusedQKV.from_modules(q, k, v)
    with pytest.raises(ValueError, match="x"):
        fused(torch.zeros(2, 15))
    with pytest.raises(TypeError, match="x"):
        fused(torch.zeros(2, 16, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_three_linears():
    lins = [lin.cuda() for lin in _linears(k=768, outs=(768, 768, 768))]
    fused = FusedQKV.from_modules(*lins)
    x = seeded(1151, 768, seed=6, device="cuda", requires_grad=True)
    for a, b in zip(*[_fwd_bwd(f, x, _params(lins))[0] for f in (fused, _eager(lins))]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
