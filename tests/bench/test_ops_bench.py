import json

import pytest
import torch

from opsnn_lab.bench import activation_bytes, gpu_check, ops
from opsnn_lab.models import EncoderConfig, EncoderLayer
from opsnn_lab.testing import assert_close_dtype, seeded


def test_quick_run_writes_every_chain_to_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ops, "emulated_note", lambda dtype: None)  # every row, whatever this CPU emulates
    # the steady allocator's settings would outlive the test in this process (tests/bench/test_allocator.py
    # checks them in a fresh one); here: that every row gets its headroom
    monkeypatch.setattr(ops, "steady", lambda: "steady (glibc: stand-in)")
    touched = []
    monkeypatch.setattr(ops, "prefault", touched.append)
    code = ops.main(["--quick", "--no-compile", "--warmup", "0", "--repeat", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "ops.json").read_text())
    assert data["benchmark"] == "ops" and data["quick"] and "machine" in data
    names = [r["chain"] for r in data["rows"]]
    expected = [c for c in ops.CHAINS if c != "conv_bn_relu_maxpool" or not data["skipped"]]
    assert names == expected
    for row in data["rows"]:
        assert row["eager_ms"] > 0 and row["fused_ms"] > 0 and row["time_fused_vs_eager"] > 0
        # every fused chain saves less than eager; QKV and LayerNorm save the same (x; x + stats): their gain is time
        same = ("qkv", "layer_norm", "add_layer_norm", "layer_norm[save_output]")
        assert 0 < row["bytes_fused_vs_eager"] <= (1 if row["chain"] in same else 0.99), row
    by = {r["chain"]: r for r in data["rows"]}
    # x + h against eager's x, h, dropout noise and dropout output: (1 + 4) / (1 + 3 * 4) with 4x expansion
    assert by["mlp"]["bytes_fused_vs_eager"] <= 0.45
    faults = [r[f"{k}_faults"] for r in data["rows"] for k in ("eager", "fused")]
    assert all(isinstance(f, int) and f >= 0 for f in faults)
    assert data["allocator"] == "steady (glibc: stand-in)" and data["headroom_bytes"] == ops.HEADROOM // 16
    # every quick row peaks under half the floor
    assert touched == [ops.HEADROOM // 16] * len(names) == [r["headroom_bytes"] for r in data["rows"]]
    out = capsys.readouterr().out
    assert "time_fused_vs_eager" in out and f"allocator: {data['allocator']}" in out


@pytest.mark.slow
def test_quick_run_with_torch_compile(tmp_path):
    assert ops.main(["--quick", "--chains", "qkv", "--warmup", "0", "--repeat", "1", "--allocator", "system",
                     "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "ops.json").read_text())["rows"][0]
    assert row["compile_first_call_s"] > 0 and row["time_compile_vs_eager"] > 0


def test_rows_in_an_emulated_dtype_run_only_when_named(tmp_path, capsys, monkeypatch):
    note = "bf16 emulated on this CPU: no AVX512-BF16/AMX"
    monkeypatch.setattr(ops, "emulated_note", lambda dtype: note if dtype == torch.bfloat16 else None)
    assert ops.emulated_rows("cpu") == {"add_rms_norm+linear[bf16]": note, "add_rms_norm[bf16]": note,
                                        "linear_cross_entropy[bf16]": note}
    assert ops.emulated_rows("meta") == {}  # not a CPU: nothing is emulated there
    # a run over two rows, one of them bf16
    monkeypatch.setattr(ops, "CHAINS", ("rms_norm", "add_rms_norm[bf16]"))
    monkeypatch.setattr(ops, "ROW_DTYPES", {"add_rms_norm[bf16]": torch.bfloat16})
    args = ["--quick", "--no-compile", "--warmup", "0", "--repeat", "1", "--allocator", "system", "--out",
            str(tmp_path)]
    assert ops.main(args) == 0
    data = json.loads((tmp_path / "ops.json").read_text())
    assert [r["chain"] for r in data["rows"]] == ["rms_norm"]
    why = f"add_rms_norm[bf16] skipped: {note}; name it in --chains to time it anyway"
    assert data["skipped"] == [why] and why in capsys.readouterr().out
    assert ops.main([*args, "--chains", "add_rms_norm[bf16]"]) == 0
    data = json.loads((tmp_path / "ops.json").read_text())
    assert [r["chain"] for r in data["rows"]] == ["add_rms_norm[bf16]"] and data["skipped"] == []


def test_page_faults_count_the_timed_steps_not_the_warm_up(monkeypatch):
    touched = {"faults": 0, "calls": 0}

    def faults_on_second_call(x):  # call 1 makes the upstream gradients; call 2 faults 900 pages
        touched["calls"] += 1
        touched["faults"] += 900 if touched["calls"] == 2 else 0
        return x * 2

    monkeypatch.setattr(ops, "page_faults", lambda: touched["faults"])
    chain = ops.Chain("double", faults_on_second_call, lambda x: x * 2, (torch.ones(3, requires_grad=True),))
    row = ops.measure(chain, compile_=False, repeat=3, warmup=1, device="cpu")  # call 2 is the warm-up
    assert row["eager_faults"] == 0 and row["fused_faults"] == 0
    touched["calls"] = 0
    row = ops.measure(chain, compile_=False, repeat=3, warmup=0, device="cpu")  # call 2 is timed: 900 / 3
    assert row["eager_faults"] == 300 and row["fused_faults"] == 0


def test_headroom_is_made_resident_after_the_warm_up(monkeypatch):
    events = []
    monkeypatch.setattr(ops, "prefault", lambda n: events.append(("prefault", n)))
    chain = ops.Chain("double", lambda x: events.append("eager") or x * 2, lambda x: x * 2,
                      (torch.ones(3, requires_grad=True),))
    ops.measure(chain, compile_=False, repeat=2, warmup=1, device="cpu", headroom=7 << 20)
    # the upstream gradients, the warm-up, the step's peak, the headroom, two timed rounds, then activation bytes
    assert events[:6] == ["eager", "eager", "eager", ("prefault", 7 << 20), "eager", "eager"]
    events.clear()
    ops.measure(chain, compile_=False, repeat=1, warmup=1, device="cpu")
    assert not any(isinstance(e, tuple) for e in events)  # headroom=0: nothing touched


def test_a_row_that_peaks_past_the_headroom_gets_twice_its_peak(monkeypatch):
    touched = []
    monkeypatch.setattr(ops, "prefault", touched.append)
    big = 1 << 20  # 4 MB of fp32 alive in the eager step, the fused one keeps less
    chain = ops.Chain("wide", lambda x: (x * torch.ones(big)).sum() * x, lambda x: x * 2,
                      (torch.ones(1, requires_grad=True),))
    row = ops.measure(chain, compile_=False, repeat=1, warmup=0, device="cpu", headroom=1 << 20)
    assert 2 * 4 * big <= row["headroom_bytes"] <= 2 * 3 * 4 * big and touched == [row["headroom_bytes"]]
    row = ops.measure(chain, compile_=False, repeat=1, warmup=0, device="cpu", headroom=64 << 20)
    assert row["headroom_bytes"] == 64 << 20  # the floor, where the step peaks lower


def test_bad_chain_name_is_rejected():
    with pytest.raises(ValueError, match="only"):
        ops.build_chains(ops.QUICK, only=["nope"])


def test_fused_encoder_layer_matches_eager_without_dropout():
    layer = EncoderLayer(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    fused = ops.FusedEncoderLayer(layer)
    x = seeded(2, 9, 64, seed=1, requires_grad=True)
    mask = torch.zeros(2, 1, 1, 9)
    mask[0, ..., -3:] = torch.finfo(torch.float32).min
    out = fused(x, mask)
    g = seeded(*out.shape, seed=2)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    ref = layer(x, mask)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()], g)
    assert_close_dtype(out, ref)
    for a, b in zip(grads, ref_grads):
        assert_close_dtype(a, b)


def test_fused_encoder_layer_at_bert_base_saves_at_most_half():
    torch.manual_seed(0)
    cfg = EncoderConfig.bert_base(dropout=0.1, attn_dropout=0.1)
    layer = EncoderLayer(cfg)
    fused = ops.FusedEncoderLayer(layer)
    x = torch.randn(8, 128, 768, requires_grad=True)
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: layer(x))
    assert ratio <= 0.5, ratio


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_check_without_cuda_exits_zero(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "gpu_check.json").exists()


def test_kernel_bandwidth_rows_under_the_interpreter(interpreted):
    rows = gpu_check.kernel_bandwidth("cpu", shapes=((3, 8),), dtypes=(torch.float32,), warmup=0, repeat=1)
    assert [r["kernel"] for r in rows] == ["gelu_dropout_fwd(bias)", "gelu_dropout_bwd(bias,out)", "rng_bits16"]
    assert all(r["bytes"] > 0 and r["gbs"] > 0 for r in rows)


def test_gpu_check_collects_every_test_marked_gpu():
    """``bench gpu_check`` runs ``pytest -m gpu`` over GPU_TEST_PATHS only (a bare CUDA image lacks the notebook
    and widget stack): every test marked gpu must live there."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    ids = [ln.split("::")[0] for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids, proc.stdout[-2000:]
    outside = sorted({i for i in ids if not i.startswith(gpu_check.GPU_TEST_PATHS)})
    assert not outside, f"tests marked gpu outside GPU_TEST_PATHS: {outside}"


def test_batch_scale_multiplies_every_batch_and_the_head_tokens():
    big = ops.scaled(ops.QUICK, 3)
    assert big["batch"] == 3 * ops.QUICK["batch"] and big["hidden"] == ops.QUICK["hidden"]
    assert ops.scaled(ops.QUICK, 1)["batch"] == ops.QUICK["batch"]
    (conv, lce), _ = ops.build_chains(big, only=["conv_bn_silu", "linear_cross_entropy"])
    (conv1, lce1), _ = ops.build_chains(ops.QUICK, only=["conv_bn_silu", "linear_cross_entropy"])
    assert conv.inputs[0].shape[0] == 3 * conv1.inputs[0].shape[0]
    assert lce.inputs[0].shape[0] == 3 * lce1.inputs[0].shape[0]
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="batch_scale"):
            ops.scaled(ops.QUICK, bad)


def test_kernel_profile_counts_calls_and_time_per_step():
    (chain,), _ = ops.build_chains(ops.QUICK, only=["gated_mlp_silu"])
    (row,) = gpu_check.kernel_profile([chain], "cpu", steps=2, top=3)
    assert row["chain"] == "gated_mlp_silu"
    for variant in ("eager", "fused"):
        assert row[f"{variant}_kernels"] >= 3  # three GEMMs forward at least
        assert 0 < row[f"{variant}_busy_ms"] and 0 < row[f"{variant}_wall_ms"]
    assert row["fused_kernels"] < row["eager_kernels"]  # one packed gate/up GEMM and one activation op
    assert 1 <= len(row["fused_top"]) <= 3 and all(ms > 0 for _, ms in row["fused_top"])


def test_model_rows_time_bytes_and_loss_per_precision():
    """gpu_check's whole-model rows, on the zoo's tiny models and a CPU: fused/eager for fp32 and bf16 autocast."""
    pytest.importorskip("transformers")
    from opsnn_lab.bench.models import model_rows

    rows = model_rows("cpu", names=("llama", "mobilenet_v2"), quick=True, repeat=1)
    assert [(r["model"], r["precision"]) for r in rows] == [
        ("llama", "fp32"), ("llama", "bf16 autocast"), ("mobilenet_v2", "fp32"), ("mobilenet_v2", "bf16 autocast")]
    for r in rows:
        assert r["fused"] > 0 and 0 < r["bytes fused/eager"] < 1 and r["time fused/eager"] > 0, r
        # the step's peak, .grad included: the tiny decoder's is its gradients (~0.1 MB), the CNN's its activations
        assert 0 < r["peak fused/eager"] < (1 if r["model"] == "mobilenet_v2" else 1.2) and r["eager peak MB"] > 0, r
        assert r["loss rel diff"] < (1e-5 if r["precision"] == "fp32" else 2e-2), r
    (bad,) = model_rows("cpu", names=("no_such_model",), quick=True)
    assert bad["model"] == "no_such_model" and "ValueError" in bad["error"]


def test_model_profile_names_the_added_work_and_the_host_functions():
    """gpu_check's whole-model profile on a tiny model and a CPU (aten calls stand for kernels): eager and fused
    counts, what the fused step adds, and its costliest Python functions; a bad model name gets an error row."""
    pytest.importorskip("transformers")
    from opsnn_lab.bench.model_profile import model_profile

    (row, bad) = model_profile("cpu", names=("mobilenet_v2", "no_such_model"), quick=True, steps=1, top=4,
                               bf16=False)
    assert (row["model"], row["precision"]) == ("mobilenet_v2", "fp32") and bad["model"] == "no_such_model"
    assert "ValueError" in bad["error"]
    for variant in ("eager", "fused"):
        assert row[f"{variant}_kernels"] > 50 and 0 < row[f"{variant}_busy_ms"] and 0 < row[f"{variant}_wall_ms"]
        assert row[f"{variant}_syncs"] == 0 and row[f"{variant}_waits"] == 0  # waits are counted on CUDA only
    assert row["fused_kernels"] < row["eager_kernels"]  # a fused Conv->BN->act is one call where eager makes three
    # on a CPU the fused Function's own call is its top-level aten event: it is what the fused step adds
    assert any("ConvBNAct" in name for name, _ in row["kernels_grown"]), row["kernels_grown"]
    assert 1 <= len(row["host_top"]) <= 4
    assert all(isinstance(where, str) and ms >= 0 and calls > 0 for where, ms, calls in row["host_top"])


def test_model_profile_main_writes_its_rows_and_refuses_bad_arguments(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    from opsnn_lab.bench import model_profile

    argv = ["--device", "cpu", "--quick", "--models", "gpt2", "--steps", "1", "--no-bf16", "--out", str(tmp_path)]
    assert model_profile.main(argv) == 0
    (row,) = json.loads((tmp_path / "model_profile.json").read_text())["rows"]
    assert (row["model"], row["precision"]) == ("gpt2", "fp32") and row["fused_kernels"] > 0
    assert "host:" in capsys.readouterr().out
    for bad in (["--models", "gpt2"], ["--quick", "--models", "gpt2", "--steps", "0"]):
        with pytest.raises(SystemExit):
            model_profile.main(["--device", "cpu", *bad])


def test_gpu_check_runs_its_stages_in_order_and_keeps_each_result(tmp_path, monkeypatch):
    """The stages as a GPU run takes them (stubbed here): the JSON holds every stage that ran, a failing test
    run or a timed-out one makes the exit code 1."""
    import json

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "machine_line", lambda: "machine")
    monkeypatch.setattr(gpu_check, "_copy_gbs", lambda device: 1000.0)
    outcome = {"returncode": 0}
    monkeypatch.setattr(gpu_check, "_pytest", lambda timeout: ran.append("tests") or dict(outcome))
    monkeypatch.setattr(gpu_check, "_bandwidth", lambda gbs: ran.append("kernels") or [])
    monkeypatch.setattr(gpu_check, "_ops_bench", lambda nc, scale=1: ran.append(f"ops x{scale}") or
                        {"returncode": 0, "rows": [], "skipped": []})
    monkeypatch.setattr(gpu_check, "_models", lambda: ran.append("models") or [{"model": "llama"}])
    monkeypatch.setattr(gpu_check, "_model_profile", lambda: ran.append("model profile") or [])
    monkeypatch.setattr(gpu_check, "_profile", lambda scale: ran.append(f"profile x{scale}") or [])
    assert gpu_check.main(["--out", str(tmp_path), "--no-base-ops", "--batch-scale", "8"]) == 0
    assert ran == ["tests", "kernels", "ops x8", "models", "model profile", "profile x8"]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["device"] == "NVIDIA H200" and data["ops_scaled"]["batch_scale"] == 8 and "ops" not in data
    assert data["models"] == [{"model": "llama"}]
    for code in (1, None):
        outcome["returncode"] = code
        assert gpu_check.main(["--out", str(tmp_path), "--no-models", "--no-profile", "--batch-scale", "1"]) == 1


def test_models_benchmark_writes_its_rows(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    from opsnn_lab.bench import models

    assert models.main(["--device", "cpu", "--quick", "--models", "gpt2", "--repeat", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "models.json").read_text())
    assert {r["model"] for r in data["rows"]} == {"gpt2"} and data["rows"][0]["precision"] == "fp32"
    assert "time fused/eager" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        models.main(["--models", "gpt2"])  # a zoo model, but not one of the sized ones
