"""state.sha256 and the max relative difference between runs."""

from __future__ import annotations

import torch

from opsnn_lab.parallel.state import master_weights, max_relative_difference, state_sha256
from opsnn_lab.precision import MasterWeightOptimizer


def test_hash_changes_with_one_bit_and_with_names():
    w = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    h = state_sha256(w)
    assert h == state_sha256({k: v.clone() for k, v in w.items()})
    flipped = w["a"].clone()
    flipped.view(torch.int32)[0, 1] ^= 1  # one ulp
    assert state_sha256({"a": flipped, "b": w["b"]}) != h
    assert state_sha256({"x": w["a"], "b": w["b"]}) != h
    assert state_sha256({"a": w["a"].view(3, 2), "b": w["b"]}) != h


def test_master_weights_reads_the_fp32_masters_not_the_low_precision_params():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = MasterWeightOptimizer(model)
    opt.masters[0].add_(1e-4)  # below bf16 resolution at 1: only the master has it
    w = master_weights(model, opt)
    assert list(w) == ["weight", "bias"] and w["weight"].dtype == torch.float32
    assert torch.equal(w["weight"], opt.masters[0])
    plain = master_weights(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert torch.equal(plain["weight"], model.weight.float())


def test_max_relative_difference():
    a = {"w": torch.tensor([1.0, -4.0])}
    assert max_relative_difference(a, {"w": a["w"].clone()}) == 0.0
    assert max_relative_difference(a, {"w": torch.tensor([1.0, -3.0])}) == 0.25
    try:
        max_relative_difference(a, {"v": a["w"]})
    except ValueError as e:
        assert "different parameters" in str(e)
    else:
        raise AssertionError("expected ValueError")
