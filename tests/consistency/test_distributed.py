"""Two gloo ranks on 127.0.0.1: the perturbed rank names the perturbed module; only its tensors travel."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from opsnn_lab.demos.consistency import run_rank_check

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]


def test_perturbed_rank_names_the_module_and_others_agree(tmp_path):
    # one job, three ranks: rank 1 is identical to rank 0, rank 2 is perturbed
    r0, r1, r2 = run_rank_check(world_size=3, perturb_rank=2, perturb="layers.0.mlp.fc2", out_dir=tmp_path)
    assert r0["rank"] == 0 and r0["ok"] and r0["exchanged"] == []
    assert r1["rank"] == 1 and r1["ok"] and r1["exchanged"] == [] and all(row["exact"] for row in r1["rows"])
    assert r2["rank"] == 2 and not r2["ok"]
    fwd, bwd = r2["forward_divergence"], r2["backward_divergence"]
    assert (fwd["module_path"], fwd["op"], fwd["origin"]) == ("layers.0.mlp.fc2", "aten.addmm", "input")
    assert (bwd["module_path"], bwd["op"]) == ("layers.0.mlp.fc2", "aten.mm")
    assert 0 < fwd["max_abs_err"] < 1e-2        # measured elementwise from rank 0's fetched tensor
    # hashes and statistics for everything, tensors only for the diverging ops
    assert 1 <= len(r2["exchanged"]) <= 4 < len(r2["rows"]) // 10
    assert any("layers.0.mlp.fc2 aten.addmm" in e for e in r2["exchanged"])
    # the dump lands under the rank's own folder inside dump_dir
    assert r2["dump_path"].startswith(str(tmp_path / "dumps" / "rank2"))
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["rank2"]


def test_past_the_memory_limit_statistics_name_the_rank_and_no_tensor_travels(tmp_path):
    r0, r1 = run_rank_check(world_size=2, perturb_rank=1, perturb="layers.0.mlp.fc2", out_dir=tmp_path,
                            memory_limit=0)
    assert r0["ok"] and r1["rank"] == 1 and not r1["ok"] and r1["exchanged"] == []
    fwd = r1["forward_divergence"]
    assert (fwd["module_path"], fwd["op"], fwd["measured"]) == ("layers.0.mlp.fc2", "aten.addmm", "statistics")
    assert 0 < fwd["max_abs_err"] < 1e-2  # a lower bound, from the extremes rank 0 sent
    assert all(row["measured"] in ("hash", "statistics") for row in r1["rows"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_rank_check(world_size=1)
    with pytest.raises(ValueError, match="perturb_rank"):
        run_rank_check(world_size=2, perturb_rank=2)
    with pytest.raises(ValueError, match="memory_limit"):
        run_rank_check(world_size=2, memory_limit="plenty")
