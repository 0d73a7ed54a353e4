import pytest
import torch

from opsnn_lab.demos.precision import allreduce_demo

pytestmark = pytest.mark.distributed
NAN = float("nan")


@pytest.fixture(scope="module")
def demo():
    return allreduce_demo(magnitudes=(1e-9, 1.0, 1e5, NAN), numel=1000, world_size=2, seed=0)


@pytest.mark.parametrize("mag", [1e-9, 1.0, 1e5])
def test_fp16_allreduce_matches_fp32_within_fp16_precision(demo, mag):
    r = demo[mag]
    exact = r["exact"]
    torch.testing.assert_close(r["fp32"].double(), exact, rtol=1e-6, atol=mag * 1e-7)
    # fp16 keeps 11 significant bits of each rank's (scaled) value and of their sum: at most 2**-11 of
    # each operand's magnitude per rounding, so 2**-10 of amax bounds the error where ranks cancel
    amax = exact.abs().max().item()
    torch.testing.assert_close(r["opsnn_fp16"].double(), exact, rtol=2**-10, atol=amax * 2**-10)
    assert (r["opsnn_fp16"] != 0).sum() >= 0.99 * exact.numel()  # nothing flushed
    assert r["opsnn_fp16"].dtype == torch.float32 and r["ranks_agree"]


def test_stock_fp16_hook_flushes_tiny_and_overflows_large(demo):
    assert (demo[1e-9]["stock_fp16"] == 0).all()  # 1e-9 is below fp16's smallest subnormal (6e-8)
    assert not torch.isfinite(demo[1e5]["stock_fp16"]).all()  # 1e5 > 65504
    torch.testing.assert_close(demo[1.0]["stock_fp16"].double(), demo[1.0]["exact"], rtol=2**-9, atol=1e-3)


def test_bytes_on_the_wire_are_half_of_fp32(demo):
    for mag in (1e-9, 1.0, 1e5):
        fp16_bytes, fp32_bytes, scales = demo[mag]["bytes"]
        assert fp16_bytes * 2 == fp32_bytes == 4 * 1000
        assert len(scales) == 1 and scales[0] == 2.0 ** round(torch.tensor(scales[0]).log2().item())


def test_a_nan_on_one_rank_reaches_every_rank(demo):
    r = demo[NAN]
    assert torch.isnan(r["opsnn_fp16"]).all() and r["ranks_agree"]  # every rank's scaler skips the step
    assert torch.isnan(r["fp32"][0]) and torch.isfinite(r["fp32"][1:]).all()
