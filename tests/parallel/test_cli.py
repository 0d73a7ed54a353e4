"""``python -m opsnn_lab.train`` across gloo ranks: DDP/FSDP2 train, world sizes agree, ranks skip together.

Three torchrun launches in all: one of 4 ranks and one of 2 ranks, each running several CLI runs on one
process group (``_many.py``: imports and fusion analysis paid once per launch), and the launch whose rank
is killed. World size 1 runs in this process (a process group of one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.parallel._launch import TINY, env, metrics, rank_state, torchrun_cmd, train_many

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FP16 = ["--fuse", "--precision", "fp16-master"]
STRICT = {f"{model}-{parallel}": ["--model", model, *FP16, "--strict", "--parallel", parallel, "--steps", "3"]
          for model in ("encoder", "cnn") for parallel in ("ddp", "fsdp")}  # cnn: BatchNorm, conv-bn-relu, 10-row fc
TRAIN_STEPS = 40  # the tiny encoder leaves chance (log(64) = 4.16) slowly: 32 rows a step, lr 1e-2
TWO_RANKS = {
    **STRICT,
    **{f"train-{p}": [*FP16, "--parallel", p, "--steps", str(TRAIN_STEPS), "--lr", "1e-2", "--global-batch-size", "32"]
       for p in ("ddp", "fsdp")},
    # an inf on rank 1 only: DDP before the sync (it crosses the fp16 hook), FSDP after it (rank 1's shard)
    **{f"overflow-{p}": [*FP16, "--parallel", p, "--steps", "4", "--inject-overflow", "1:1,2"]
       for p in ("ddp", "fsdp")},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def one_rank(root, world_of_one):
    """The strict runs on a world of one, in this process."""
    import torch

    from opsnn_lab.parallel.cli import parser, run

    threads = torch.get_num_threads()
    try:
        for name, args in STRICT.items():
            run(parser().parse_args([*TINY, *args, "--out", str(root / "w1" / name)]))
    finally:
        torch.set_num_threads(threads)
    return {name: metrics(root / "w1" / name) for name in STRICT}


@pytest.fixture(scope="module")
def two_ranks(root):
    ckpt = root / "w2" / "ckpt"
    common = ["--precision", "fp16-master", "--parallel", "fsdp"]  # dropout on, scaler state
    runs = {**TWO_RANKS, "ckpt-whole": [*common, "--steps", "4"],
            "ckpt-first": [*common, "--steps", "2", "--save", str(ckpt)],
            "ckpt-resumed": [*common, "--steps", "2", "--resume", str(ckpt)]}
    return train_many(2, root / "w2", runs)


@pytest.fixture(scope="module")
def four_ranks(root):
    return train_many(4, root / "w4", STRICT)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_fused_fp16_master(two_ranks, root, parallel):
    m = two_ranks[f"train-{parallel}"]
    out = root / "w2" / f"train-{parallel}"
    losses = [s["loss"] for s in m["steps"]]
    assert m["world_size"] == 2 and len(losses) == TRAIN_STEPS
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.04  # the loss falls (0.08 in a world of one)
    assert all(s["scale"] == 65536.0 and not s["skipped"] and s["samples_per_s"] > 0 for s in m["steps"])
    assert (out / "state.sha256").read_text().strip() == m["state_sha256"]
    assert {"cpus", "torch", "platform"} <= set(m["machine"])
    if parallel == "ddp":  # the fp16 hook sends half the bytes of an fp32 all-reduce, and nothing else
        assert m["comm"]["bytes_fp16_per_step"] / m["comm"]["bytes_fp32_per_step"] == 0.5
    else:
        assert m["comm"] is None
    assert rank_state(out, 0)["losses"] == rank_state(out, 1)["losses"] == losses


@pytest.mark.parametrize("model", ["encoder", "cnn"])
def test_strict_state_is_identical_for_world_sizes_1_2_4(one_rank, two_ranks, four_ranks, model):
    """One tree over the global batch's row blocks: the same bits for 1, 2, 4 ranks, DDP and FSDP alike."""
    hashes = {(n, p): runs[f"{model}-{p}"]["state_sha256"] for n, runs in ((1, one_rank), (2, two_ranks),
                                                                           (4, four_ranks)) for p in ("ddp", "fsdp")}
    assert {runs[f"{model}-ddp"]["world_size"] for runs in (one_rank, two_ranks, four_ranks)} == {1, 2, 4}
    assert len(set(hashes.values())) == 1, hashes


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_overflow_on_one_rank_skips_on_every_rank(two_ranks, root, parallel):
    """An inf in rank 1's gradient only: both ranks skip, both scalers back off the same way."""
    m, out = two_ranks[f"overflow-{parallel}"], root / "w2" / f"overflow-{parallel}"
    r0, r1 = rank_state(out, 0), rank_state(out, 1)
    assert r0["skipped"] == r1["skipped"] == [False, True, True, False]
    assert r0["scaler"] == r1["scaler"]
    assert r0["scaler"]["scale"] == 65536.0 / 4
    assert [s["scale"] for s in m["steps"]] == [65536.0, 65536.0, 32768.0, 16384.0]
    assert m["skipped_steps"] == 2


def test_fsdp_checkpoint_resumes_bit_identically(two_ranks, root):
    """4 steps in one go == 2 steps, torch.distributed.checkpoint, 2 more steps (dropout on, scaler state)."""
    whole, resumed = two_ranks["ckpt-whole"], two_ranks["ckpt-resumed"]
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in whole["steps"][2:]]
    assert resumed["state_sha256"] == whole["state_sha256"]
    assert rank_state(root / "w2" / "ckpt-resumed", 0)["scaler"] == rank_state(root / "w2" / "ckpt-whole", 0)["scaler"]


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_killing_one_rank_ends_every_rank_with_an_error(tmp_path):
    """SIGKILL rank 1 once rank 0's bar shows a finished step: torchrun ends rank 0 within 60 s, with an error."""
    pytest.importorskip("psutil")
    import psutil

    cmd = torchrun_cmd(2, [*TINY, "--steps", "100000", "--parallel", "ddp", "--out", str(tmp_path)])
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read1(4096), b"")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not re.search(rb"[1-9][0-9]*/100000", b"".join(chunks)):
            time.sleep(0.2)  # rank 0's tqdm bar counts a finished step: both ranks are in the loop
        workers = [p for p in _children(proc.pid) if "opsnn_lab.train" in " ".join(psutil.Process(p).cmdline())]
        assert len(workers) == 2, "the two ranks did not start"
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        assert time.monotonic() - t0 < 60
        reader.join(timeout=10)
        err = b"".join(chunks).decode(errors="replace")
        assert proc.returncode != 0
        assert "FAILED" in err or "failed" in err
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
