"""strict()'s ``_grouped_mm`` (mixture-of-experts layers): aten's results within fp32 tolerance in its four forms,
empty groups included; under strict(), the same bits at 1 and 2 threads, forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from opsnn_lab.consistency.fixed_grouped_mm import grouped_mm
from opsnn_lab.consistency.strict import strict
from opsnn_lab.testing import seeded, threads

OFFS = torch.tensor([3, 3, 10, 16], dtype=torch.int32)  # group 1 is empty


@pytest.mark.parametrize("shapes, offs", [
    (((16, 8), (4, 8, 8)), OFFS),  # tokens sorted by expert @ each expert's weight
    (((4, 8, 8), (8, 16)), OFFS),
    (((8, 16), (16, 8)), OFFS),  # the weight gradient: grouped over the shared axis
    (((4, 8, 8), (4, 8, 8)), None),
], ids=["2d_3d", "3d_2d", "2d_2d", "3d_3d"])
def test_the_four_forms_match_aten(shapes, offs):
    a, b = seeded(*shapes[0], seed=1), seeded(*shapes[1], seed=2)
    want = torch._grouped_mm(a, b, offs)
    got = grouped_mm(a, b, offs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if a.dim() == b.dim() == 2:
        assert not got[1].any()  # the empty group's product is zeros


def test_bias_and_bad_arguments():
    a, b, bias = seeded(16, 8, seed=1), seeded(4, 8, 8, seed=2), seeded(4, 8, seed=3)
    want = torch.cat([a[s:e] @ b[g] + bias[g] for g, (s, e) in enumerate([(0, 3), (3, 3), (3, 10), (10, 16)])])
    torch.testing.assert_close(grouped_mm(a, b, OFFS, bias), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="offs"):
        grouped_mm(a, b)
    with pytest.raises(ValueError, match="2-d or 3-d"):
        grouped_mm(a[None, None], b, OFFS)


def test_experts_keep_their_bits_at_any_thread_count_under_strict():
    # Mixtral's experts at a small width: each expert's weight is stored (out, in) and read transposed, 8 groups
    offs = torch.tensor([3, 8, 11, 12, 20, 23, 27, 32], dtype=torch.int32)
    runs = []
    for n in (1, 2):
        x = seeded(32, 32, seed=4).requires_grad_()
        w = seeded(8, 128, 32, seed=5, scale=0.1).requires_grad_()
        with threads(n), strict():
            y = torch._grouped_mm(x, w.transpose(-2, -1), offs)
            y.backward(seeded(*y.shape, seed=6))
        runs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
