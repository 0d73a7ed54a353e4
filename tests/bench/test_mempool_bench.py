"""The mempool benchmark runs CI-sized and writes its JSON with the pool's figures."""

from __future__ import annotations

import json

from opsnn_lab.bench import mempool


def test_quick_run_writes_json(tmp_path, capsys):
    assert mempool.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mempool.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["torch.empty", "MemoryPool"]
    pool = data["pool"]
    # 20 steps x 6 workspaces; lengths repeat within 16..64, so most requests hit the cache
    assert pool["allocations"] == 120 and 0 < pool["allocations_avoided"] < 120
    assert 0.0 <= pool["fragmentation"] < 1.0
    assert "allocations avoided" in capsys.readouterr().out
