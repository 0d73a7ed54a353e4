"""``python -m opsnn_lab.train`` across gloo ranks: DDP/FSDP2 train, world sizes agree, ranks skip together."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.parallel._launch import env, rank_state, torchrun_cmd, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_fused_fp16_master(tmp_path, parallel):
    m = train(2, tmp_path, "--fuse", "--precision", "fp16-master", "--parallel", parallel, "--steps", "30",
              "--lr", "1e-2")
    losses = [s["loss"] for s in m["steps"]]
    assert m["world_size"] == 2 and len(losses) == 30
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.05  # the loss falls (from chance, log(64) = 4.16)
    assert all(s["scale"] == 65536.0 and not s["skipped"] and s["samples_per_s"] > 0 for s in m["steps"])
    assert (tmp_path / "state.sha256").read_text().strip() == m["state_sha256"]
    assert {"cpus", "torch", "platform"} <= set(m["machine"])
    if parallel == "ddp":  # the fp16 hook sends half the bytes of an fp32 all-reduce
        assert m["comm"]["bytes_fp16_per_step"] / m["comm"]["bytes_fp32_per_step"] == 0.5
    else:
        assert m["comm"] is None
    assert rank_state(tmp_path, 0)["losses"] == rank_state(tmp_path, 1)["losses"] == losses


@pytest.mark.parametrize("model", ["encoder", "cnn"])
def test_strict_state_is_identical_for_world_sizes_1_2_4(tmp_path, model):
    """One tree over the global batch's row blocks: the same bits for 1, 2, 4 ranks, DDP and FSDP alike."""
    hashes = {}
    runs = [("ddp", 1), ("ddp", 4), ("fsdp", 2), ("fsdp", 4)]  # every world size and both wrappings, 4 launches
    if model == "cnn":  # BatchNorm, fused conv-bn-relu and shards with scalar tails (10-row fc over 4 ranks)
        runs = [("ddp", 1), ("fsdp", 4)]
    for parallel, n in runs:
        out = tmp_path / f"{parallel}{n}"
        m = train(n, out, "--model", model, "--fuse", "--precision", "fp16-master", "--strict", "--parallel",
                  parallel, "--steps", "3")
        hashes[(parallel, n)] = m["state_sha256"]
    assert len(set(hashes.values())) == 1, hashes


def test_overflow_on_one_rank_skips_on_every_rank(tmp_path):
    """An inf injected after the gradient sync in rank 1's shard only: both ranks skip, both scalers back off."""
    m = train(2, tmp_path, "--precision", "fp16-master", "--parallel", "fsdp", "--steps", "4",
              "--inject-overflow", "1:1,2")
    r0, r1 = rank_state(tmp_path, 0), rank_state(tmp_path, 1)
    assert r0["skipped"] == r1["skipped"] == [False, True, True, False]
    assert r0["scaler"] == r1["scaler"]
    assert r0["scaler"]["scale"] == 65536.0 / 4
    assert [s["scale"] for s in m["steps"]] == [65536.0, 65536.0, 32768.0, 16384.0]
    assert m["skipped_steps"] == 2


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_killing_one_rank_ends_every_rank_with_an_error(tmp_path):
    pytest.importorskip("psutil")
    import psutil

    cmd = torchrun_cmd(2, ["--model", "encoder", "--size", "tiny", "--global-batch-size", "8", "--steps", "100000",
                           "--parallel", "ddp", "--out", str(tmp_path)])
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        workers = []
        while time.monotonic() < deadline and len(workers) < 2:
            workers = [p for p in _children(proc.pid) if "opsnn_lab.train" in " ".join(psutil.Process(p).cmdline())]
            time.sleep(0.5)
        assert len(workers) == 2, "the two ranks did not start"
        time.sleep(8)  # let them get into the loop (imports, fusion, first collectives)
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
        assert proc.returncode != 0
        assert "FAILED" in err or "failed" in err
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_fsdp_checkpoint_resumes_bit_identically(tmp_path):
    """4 steps in one go == 2 steps, torch.distributed.checkpoint, 2 more steps (dropout on, scaler state)."""
    common = ("--precision", "fp16-master", "--parallel", "fsdp")
    whole = train(2, tmp_path / "whole", *common, "--steps", "4")
    train(2, tmp_path / "first", *common, "--steps", "2", "--save", str(tmp_path / "ckpt"))
    resumed = train(2, tmp_path / "resumed", *common, "--steps", "2", "--resume", str(tmp_path / "ckpt"))
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in whole["steps"][2:]]
    assert resumed["state_sha256"] == whole["state_sha256"]
    assert rank_state(tmp_path / "resumed", 0)["scaler"] == rank_state(tmp_path / "whole", 0)["scaler"]
