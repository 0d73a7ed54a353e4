import math

import pytest
import torch
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import Dropout
from opsnn_lab.testing import assert_close_dtype, non_contiguous, run_fwd_bwd, seeded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_forward_and_gradient_use_the_counter_mask(dtype):
    drop = Dropout(0.3, seed=5)
    drop.set_rng(5, 2)
    x = seeded(4, 9, seed=1, dtype=dtype, requires_grad=True)
    out, (grad,) = run_fwd_bwd(drop, [x])
    keep = rng.dropout_mask(5, 2 * rng.MAX_NUMEL, x.shape, 0.3)
    ref = x.detach() * keep / 0.7
    assert_close_dtype(out, ref)
    assert_close_dtype(grad, seeded(4, 9, seed=123, dtype=dtype) * keep / 0.7)
    assert drop.rng_step == 3


def test_p0_p1_eval_and_empty():
    x = seeded(3, 5, seed=2, requires_grad=True)
    assert Dropout(0.0)(x) is x
    assert Dropout(0.7).eval()(x) is x
    out, (grad,) = run_fwd_bwd(Dropout(1.0), [x])
    assert not out.any() and not grad.any()
    assert Dropout(0.5)(torch.zeros(0, 3)).shape == (0, 3)


def test_non_contiguous_uses_row_major_element_index():
    x = non_contiguous(seeded(6, 7, seed=3))
    out = Dropout(0.5, seed=9)(x)
    keep = rng.dropout_mask(9, 0, (6, 7), 0.5)
    assert torch.equal(out != 0, keep & (x != 0))


def test_keep_fraction_and_mean_preserved():
    x = torch.ones(100_000)
    out = Dropout(0.2, seed=1)(x)
    kept = (out != 0).double().mean().item()
    assert abs(kept - 0.8) < 4 * math.sqrt(0.16 / 1e5)
    assert abs(out.double().mean().item() - 1.0) < 0.01


def test_saves_nothing_for_backward():
    x = seeded(64, 64, seed=4, requires_grad=True)
    assert activation_bytes(lambda: Dropout(0.1)(x * 2)) == 0
    assert activation_bytes(lambda: nn.Dropout(0.1)(x * 2)) > 0


def test_from_module_and_reproducibility():
    torch.manual_seed(0)
    a = Dropout.from_module(nn.Dropout(0.4))
    torch.manual_seed(0)
    b = Dropout.from_module(nn.Dropout(0.4))
    assert a.p == 0.4 and a.rng_seed == b.rng_seed  # seeds follow torch.manual_seed
    x = seeded(5, 5, seed=5)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), Dropout(0.4, seed=a.rng_seed + 1)(x))
    c = Dropout.from_module(nn.Dropout(0.4).eval(), seed=3)
    assert not c.training and c.rng_seed == 3
    assert "p=0.4" in repr(c)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="p"):
        Dropout(1.2)
    with pytest.raises(ValueError, match="seed"):
        Dropout(0.1, seed=-1)
    with pytest.raises(TypeError, match="dropout"):
        Dropout.from_module(nn.ReLU())
    with pytest.raises(TypeError, match="x"):
        Dropout(0.1)("x")
    with pytest.raises(TypeError, match="step"):
        Dropout(0.1).set_rng(0, 1.5)
