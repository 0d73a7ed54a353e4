import json

import torch

from opsnn_lab.bench import soak


def test_small_soak_is_clean():
    s = soak.run_soak(2000, period=300, growth_interval=50, seed=1, progress=False)
    c = s["counts"]
    assert s["ok"], s
    assert all(s["faults"][k] > 0 for k in ("burst", "drought", "nan"))
    assert c["applied"] + c["skipped"] == 2000
    assert c["skipped"] == c["injected_skips"] + c["underflow_skips"] + c["natural_overflows"]
    assert c["injected_skips"] >= s["faults"]["nan"] + s["faults"]["burst"]
    assert c["underflow_skips"] > 0 and s["bursts_recovered"] == s["bursts"] > 0
    assert s["nonfinite_master_checks"] == 0


def test_accounting_catches_a_fault_that_got_through():
    faults = [None, "burst", None]
    hist = {"step": [0, 1, 2], "scale": [2.0**16] * 3, "skipped": [False, False, True],
            "overflow": [False, False, True], "underflow": [False, False, False]}
    c = soak._account(hist, [1.0, 1e6, 0.5], faults, 2.0**-14)
    assert c["injected_applied"] == 1  # the burst step was applied
    assert c["unaccounted"] == 1  # step 2 overflowed although 0.5 * 2**16 fits in fp16


def test_recovery_is_measured_from_the_burst_end():
    schedule = [(2, 2, "burst")]
    scales = [8.0, 8.0, 8.0, 4.0, 2.0, 4.0, 8.0, 8.0]
    assert soak._recoveries(schedule, scales, 8) == [2]
    assert soak._recoveries(schedule, scales[:6] + [4.0, 4.0], 8) == [None]


def test_main_writes_json(tmp_path, capsys):
    torch.set_num_threads(2)
    assert soak.main(["--steps", "600", "--period", "200", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == 2  # its one-thread run ends with the caller's count
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["benchmark"] == "soak" and data["ok"] and data["steps"] == 600
    assert "unaccounted 0" in capsys.readouterr().out
