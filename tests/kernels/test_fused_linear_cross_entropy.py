import pytest
import torch
import torch.nn.functional as F

from opsnn_lab.kernels import fused_linear_cross_entropy as K
from opsnn_lab.testing import seeded, triton_interpreter_ready


def _case(c, v, ignore_rows=(), seed=0):
    logits = seeded(c, v, seed=seed, scale=3.0)
    target = torch.randint(0, v, (c,), generator=torch.Generator().manual_seed(seed))
    target[list(ignore_rows)] = -100
    return logits, target


def _eager(logits, target, smoothing, row_scale):
    z = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(z, target, ignore_index=-100, reduction="none", label_smoothing=smoothing)
    (loss * row_scale).sum().backward()
    return loss.detach(), torch.logsumexp(logits, -1), z.grad


def _check(fn, c, v, smoothing, ignore_rows=(), tol=1e-5):
    logits, target = _case(c, v, ignore_rows)
    row_scale = seeded(c, seed=9).abs() * (target != -100)
    want_loss, want_lse, want_grad = _eager(logits, target, smoothing, row_scale)
    loss, lse = fn(logits.clone(), target, -100, smoothing)  # no row_scale: the logits are left alone
    torch.testing.assert_close(loss, want_loss, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)
    work = logits.clone()
    fn(work, target, -100, smoothing, row_scale)
    torch.testing.assert_close(work, want_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reference_matches_f_cross_entropy(smoothing):
    _check(K.cross_entropy_chunk_reference, 9, 37, smoothing, ignore_rows=(0, 4))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_scratch_logits_give_the_same_loss_and_hold_the_probabilities(smoothing):
    logits, target = _case(9, 37, ignore_rows=(0, 4))
    want_loss, want_lse, _ = _eager(logits, target, smoothing, torch.ones(9))
    kept = logits.clone()
    K.cross_entropy_chunk(kept, target, -100, smoothing)
    assert torch.equal(kept, logits)  # no scratch: left alone
    work = logits.clone()
    loss, lse = K.cross_entropy_chunk(work, target, -100, smoothing, scratch=True)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(work, torch.softmax(logits, -1))


def test_public_entry_rejects_what_it_would_corrupt():
    with pytest.raises(ValueError, match="logits"):
        K.cross_entropy_chunk(torch.zeros(3, 4, dtype=torch.float16), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        K.cross_entropy_chunk(torch.zeros(4, 3).t(), torch.zeros(3, dtype=torch.long))
    loss, lse = K.cross_entropy_chunk(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert loss.shape == lse.shape == (0,)


# 4099 columns: two 4096-wide tiles, the second almost empty; rows 1 and 5 ignored.
@pytest.mark.parametrize("c, v, smoothing", [(6, 37, 0.0), (6, 37, 0.2), (3, 4099, 0.1)])
def test_triton_interpreter_matches_eager(monkeypatch, c, v, smoothing):
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    _check(K.cross_entropy_chunk, c, v, smoothing, ignore_rows=(1,) if c < 6 else (1, 5), tol=2e-5)


def test_reference_loss_where_the_target_probability_underflows():
    # target logits 200 and 120 below the row's largest: softmax gives the target 0 (or a denormal) in fp32,
    # so the loss must come from the log-sum-exp, not from the gradient's probabilities
    logits, target = _case(4, 37, ignore_rows=(3,))
    logits[0, target[0]] = logits[0].max() - 200.0
    logits[1, target[1]] = logits[1].max() - 120.0
    row_scale = torch.tensor([1.0, 0.5, 2.0, 0.0])
    want_loss, want_lse, want_grad = _eager(logits, target, 0.0, row_scale)
    work = logits.clone()
    loss, lse = K.cross_entropy_chunk_reference(work, target, -100, 0.0, row_scale)
    assert want_loss[0] > 199 and want_loss[1] > 119
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(work, want_grad, atol=1e-6, rtol=1e-5)


# The logit map: z = scale * l, or softcap * tanh(scale * l / softcap); the loss is of z, the gradient w.r.t. l.
MAPS = [(0.0625, None), (1.0, 4.0), (0.5, 2.0)]


def _eager_mapped(logits, target, smoothing, row_scale, scale, softcap):
    raw = logits.clone().requires_grad_(True)
    z = raw * scale if softcap is None else softcap * torch.tanh(raw * scale / softcap)
    loss = F.cross_entropy(z, target, ignore_index=-100, reduction="none", label_smoothing=smoothing)
    (loss * row_scale).sum().backward()
    return loss.detach(), torch.logsumexp(z.detach(), -1), raw.grad


def _check_mapped(fn, c, v, smoothing, scale, softcap, ignore_rows=(), tol=1e-5, dtype=torch.float32):
    logits, target = _case(c, v, ignore_rows)
    logits = logits.to(dtype)
    row_scale = (seeded(c, seed=9).abs() * (target != -100)).to(dtype)
    want_loss, want_lse, want_grad = _eager_mapped(logits, target, smoothing, row_scale, scale, softcap)
    kept = logits.clone()
    loss, lse = fn(kept, target, -100, smoothing, scale=scale, softcap=softcap)
    assert torch.equal(kept, logits)  # no row_scale, no scratch: the caller's logits are left alone
    torch.testing.assert_close(loss, want_loss, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)
    work = logits.clone()
    fn(work, target, -100, smoothing, row_scale, scale=scale, softcap=softcap)
    torch.testing.assert_close(work, want_grad, atol=tol, rtol=tol)
    assert not bool(work[list(ignore_rows)].any())  # ignored rows: no gradient through the map either


@pytest.mark.parametrize("scale, softcap", MAPS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reference_maps_the_logits_and_differentiates_through_the_map(scale, softcap, smoothing):
    _check_mapped(K.cross_entropy_chunk, 9, 37, smoothing, scale, softcap, ignore_rows=(0, 4))


@pytest.mark.parametrize("scale, softcap", MAPS)
def test_float64_chunk_through_the_map(scale, softcap):
    _check_mapped(K.cross_entropy_chunk, 5, 23, 0.1, scale, softcap, ignore_rows=(2,), tol=1e-12, dtype=torch.float64)


def test_capped_scratch_chunk_holds_the_probabilities_of_the_capped_logits():
    logits, target = _case(4, 19)
    work = logits.clone()
    K.cross_entropy_chunk(work, target, -100, 0.0, scratch=True, softcap=2.0)
    torch.testing.assert_close(work, torch.softmax(2.0 * torch.tanh(logits / 2.0), -1))


# 4099 columns with a cap: the second tile's masked lanes must stay out of the log-sum-exp (a capped -inf is -cap)
@pytest.mark.parametrize("c, v, smoothing, scale, softcap", [(6, 37, 0.0, 0.0625, None), (6, 37, 0.1, 0.5, 2.0),
                                                             (3, 4099, 0.1, 1.0, 4.0)])
def test_triton_interpreter_maps_the_logits_as_the_reference(monkeypatch, c, v, smoothing, scale, softcap):
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    _check_mapped(K.cross_entropy_chunk, c, v, smoothing, scale, softcap, ignore_rows=(1,), tol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale, softcap", [(1.0, None), *MAPS])
def test_gpu_kernel_matches_float64_through_the_map(scale, softcap):
    # a Gemma-sized vocabulary tile count: 256 rows x 50,001 columns (13 tiles, the last one almost empty)
    c, v = 256, 50_001
    logits = seeded(c, v, seed=3, scale=3.0).cuda()
    target = torch.randint(0, v, (c,), generator=torch.Generator().manual_seed(3)).cuda()
    target[::5] = -100
    row_scale = (target != -100).float() / c
    want_loss, want_lse, want_grad = _eager_mapped(logits.double(), target, 0.1, row_scale.double(), scale, softcap)
    work = logits.clone()
    loss, lse = K.cross_entropy_chunk(work, target, -100, 0.1, row_scale, scale=scale, softcap=softcap)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)
    # GPU exp / division are approximate: gradients to 1e-5 of their largest entry (the CPU paths reach ~2e-6)
    torch.testing.assert_close(work.double(), want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=1e-4)
