"""scripts/hf_sweep.py, the sweep behind the notes' figures, on two models: it fuses, compares with eager and
writes its JSON; a model it cannot build is reported with the stage, and the sweep goes on. And
scripts/hf_consistency_sweep.py, which runs the same models with reproducible dropout and the checker."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hf_sweep.py"
CONSISTENCY = SCRIPT.with_name("hf_consistency_sweep.py")


def test_the_sweep_fuses_checks_and_reports(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "sweep.json"
    main(["--models", "Llama,ViT,Gemma3,NoSuchModel", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in ("Llama", "ViT", "Gemma3"):  # Gemma3ForCausalLM is built from its text config
        r = results[name]
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [], r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
        assert r["bytes"] == r["plan_bytes"] and r["bytes"]["saved"] > 0, r  # the plan's figures are the step's
    assert "add_layer_norm@fx" in results["ViT"]["fused"] and "vit.layers.0" in results["ViT"]["fx_regions"]
    assert results["NoSuchModel"]["error"].startswith("build: AttributeError")
    assert "NoSuchModel" in capsys.readouterr().out


def test_the_plans_bytes_are_the_steps_where_a_forward_drops_rebases_or_copies(tmp_path):
    # Mamba and RWKV drop a state with its graph (counted or not by the step, by where the allocator put what came
    # next); Funnel's einsums return views that an in-place write through another view re-bases; Longformer's packed
    # QKV output is copied by the reshape that views eager's own q and k; Nystromformer adds into its attention
    # output in place, which its fx-traced region computes out of place. Each planned other bytes than its step
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "sweep.json"
    main(["--models", "Mamba,Rwkv,Funnel,Longformer,Nystromformer", "--out", str(out)])
    for name, r in json.loads(out.read_text()).items():
        assert "error" not in r and r["bytes"] == r["plan_bytes"], (name, r.get("error"), r.get("plan_bytes"))


def test_all_means_every_text_only_lm_and_image_classifier_installed():
    sweep = runpy.run_path(str(SCRIPT))
    names = sweep["every_text_lm"]()
    assert {"Llama", "Gemma3", "Bert", "DeepseekV3"} <= set(names)
    assert not set(names) & sweep["NOT_TEXT_ONLY"] and "ViT" not in names
    images = sweep["every_image_classifier"]()
    assert {"CLIP", "MobileNetV1", "HGNetV2", "ViT"} <= set(images) and not set(images) & set(names)
    everything = sweep["model_names"]("all")
    assert len(everything) == len(set(everything)) and {"CLIP", "MobileNetV1", "Llama"} <= set(everything)


def test_an_image_classifier_too_small_at_64_px_is_built_at_its_own_size(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "vision.json"
    main(["--models", "MobileNetV1,ViTMSN", "--dtype", "float32", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["ViTMSN"].get("full_size") and "full_size" not in results["MobileNetV1"], results
    for r in results.values():
        # float32 rounding through MobileNetV1's 27 Conv -> BN -> ReLU6 layers: 1.5e-5 of the largest gradient
        assert "error" not in r and r["fused"] and max(r["out_err"], r["grad_err"]) < 1e-4, r


def test_autocast_compares_the_bf16_steps_with_the_fp32_one(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "amp.json"
    main(["--models", "Llama", "--dtype", "float32", "--autocast", "--out", str(out)])
    r = json.loads(out.read_text())["Llama"]
    # the config's use_cache=True: each layer traces from the cache as its call found it, and fuses its residual add
    assert "add_rms_norm@fx" in r["fused"] and "model.layers.0" in r["fx_regions"] and r["rewrite_failed"] == [], r
    for key in ("amp_out_err", "amp_grad_err"):  # bf16's own error, and the fused model's within 2x of it
        assert 1e-4 < r[key]["eager"] < 0.1 and r[key]["fused"] <= 2 * r[key]["eager"], r
    with pytest.raises(SystemExit):
        main(["--models", "Llama", "--autocast"])  # float64 has no bf16 step to compare with


@pytest.mark.parametrize("fused_errors, median, rechecked", [
    ((0.5, 0.1, 0.1, 0.1), 1.0, True),  # over on the first input only (a router's flip): the median of four
    ((0.5, 0.5, 0.1, 0.5), 5.0, True),  # over on most: still over
    ((0.15, 9.0, 9.0, 9.0), 1.5, False),  # within on the first: no other input is run
])
def test_autocast_rechecks_a_model_over_the_criterion_on_other_inputs(fused_errors, median, rechecked):
    import torch

    sweep = runpy.run_path(str(SCRIPT))
    model, fused = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    ran = []

    def step_on(i):
        def step(m):  # eager's bf16 error 0.1 on every input, the fused model's fused_errors[i]
            ran.append((i, m is fused, torch.is_autocast_enabled("cpu")))
            err = 0.0 if not torch.is_autocast_enabled("cpu") else fused_errors[i] if m is fused else 0.1
            return [torch.tensor([1.0 + err])], [torch.tensor([2.0 + 2 * err])]
        return step

    r = {}
    sweep["autocast_errors"](step_on(0), model, fused, step_on(0)(model), r, [step_on(i) for i in (1, 2, 3)])
    assert r["amp_ratio"] == pytest.approx(median)
    assert ("amp_ratios" in r) == rechecked and "amp_no_precision" not in r
    assert {i for i, *_ in ran} == ({0, 1, 2, 3} if rechecked else {0})
    assert r["amp_out_err"]["fused"] == pytest.approx(fused_errors[0])  # the first input's figures as they were
    line = sweep["_line"]({"fused": [], "out_err": 0, "grad_err": 0, "eval_err": 0, "inference_err": 0, **r})
    assert (f"(median of 4 inputs x{median:.2f})" in line) == rechecked, line


def test_other_inputs_draw_values_and_token_ids_again_and_keep_the_rest():
    import torch

    other_inputs = runpy.run_path(str(SCRIPT))["other_inputs"]
    ids = torch.tensor([[3, 7, 1, 9]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones(1, 4, dtype=torch.long), "labels": ids,
              "pixel_values": torch.randn(2, 3, 4, 4, dtype=torch.float64) * 3 + 1, "timestep": torch.tensor([5.0])}
    others = other_inputs(inputs)
    assert len(others) == 3 and len({tuple(o["input_ids"].flatten().tolist()) for o in others}) == 3
    for o in others:
        assert o["input_ids"].max() <= 9 and o["input_ids"].dtype == ids.dtype and o["labels"] is ids
        assert o["attention_mask"] is inputs["attention_mask"] and o["timestep"] is inputs["timestep"]
        assert o["pixel_values"].dtype == torch.float64 and not torch.equal(o["pixel_values"], inputs["pixel_values"])
        assert abs(float(o["pixel_values"].std()) - 3) < 1.0
    x = torch.randn(2, 3, 8, 8)
    assert [t.shape for t in other_inputs(x, n=2)] == [x.shape] * 2


def test_the_consistency_sweep_reports_each_model(tmp_path, capsys):
    main = runpy.run_path(str(CONSISTENCY))["main"]
    out = tmp_path / "consistency.json"
    main(["--models", "Bert,GPT2,Bart,NoSuchModel", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in ("Bert", "GPT2", "Bart"):  # Bart's dropouts are all inline F.dropout calls its config sets
        r = results[name]
        assert "error" not in r and (r["dropouts"] > 0 or name == "Bart") and r["fused"] > 0, r
        assert r["repeat_consistent"] and r["fused_repeat_equal"], r
        assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r  # the fused model draws the unfused one's masks
    assert results["NoSuchModel"]["error"].startswith("build: AttributeError")
    assert "NoSuchModel" in capsys.readouterr().out


def test_configs_that_need_their_own_settings_build_run_and_fuse(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "fixed.json"
    models = ["GPTNeo", "Mamba2", "Zamba", "Reformer", "DeepseekV3"]  # attention types, heads x head_dim, hybrids,
    # axial positions, grouped expert routing
    main(["--models", ",".join(models), "--dtype", "float32", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in models:
        r = results[name]
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [], r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-5, r


def test_the_consistency_sweep_repeats_a_model_that_reseeds_torch_and_takes_a_memory_limit(tmp_path):
    # Reformer calls torch.seed() in its forward and accumulates into .grad in its own backward
    main = runpy.run_path(str(CONSISTENCY))["main"]
    out = tmp_path / "consistency.json"
    main(["--models", "Reformer", "--memory-limit", "0", "--out", str(out)])
    r = json.loads(out.read_text())["Reformer"]
    assert "error" not in r and r["repeat_consistent"] and r["fused_repeat_equal"], r


def test_errors_count_matching_nan_and_inf_as_equal_and_others_as_infinite():
    import math

    import torch

    sweep = runpy.run_path(str(SCRIPT))
    rel, largest = sweep["_rel"], sweep["largest_finite"]
    want = torch.tensor([1.0, float("nan"), float("inf"), -4.0])
    assert rel([want.clone()], [want]) == 0.0
    assert rel([want + torch.tensor([0.5, 0, 0, 0])], [want]) == 0.5 / 4  # over the largest finite magnitude
    assert rel([torch.tensor([1.0, 2.0, float("inf"), -4.0])], [want]) == math.inf  # a NaN lost
    assert rel([torch.tensor([1.0, float("nan"), 3.0, -4.0])], [want]) == math.inf  # an Inf lost
    assert largest([want, torch.tensor([float("nan")]), torch.zeros(0)]) == 4.0


def test_the_consistency_sweep_repeats_a_batch_norm_model_from_the_same_buffers(tmp_path):
    main = runpy.run_path(str(CONSISTENCY))["main"]
    out = tmp_path / "consistency.json"
    main(["--models", "MobileNetV2", "--out", str(out)])  # its BatchNorms count steps in a buffer
    r = json.loads(out.read_text())["MobileNetV2"]
    assert "error" not in r and r["repeat_consistent"] and "divergence" not in r, r


def test_checker_memory_prints_the_traced_peaks_per_limit(capsys):
    main = runpy.run_path(str(SCRIPT.with_name("checker_memory.py")))["main"]
    unlimited, limited = main(["Bert", "--limits", "none", "0"])
    assert unlimited["ok"] and limited["ok"] and unlimited["compared_ratio"] > 2 * limited["compared_ratio"]
    assert limited["summarised"].split("/")[0] == limited["summarised"].split("/")[1]  # limit 0: every event
    assert "memory_limit 0" in capsys.readouterr().out


def test_the_records_are_on_disk_after_each_model(tmp_path):
    """A process that dies inside a model (a native kernel's segfault) keeps the records before it and names it."""
    run_sweep = runpy.run_path(str(SCRIPT))["run_sweep"]
    out = tmp_path / "sweep.json"
    seen = []

    def check_one(name, r):
        seen.append(json.loads(out.read_text()))
        r["fused"], r["stage"] = [name], "fuse"
        del r["stage"]

    run_sweep(["a", "b"], check_one, lambda r: "ok", str(out))
    assert seen[0] == {"a": {"stage": "started; the process ended inside this model"}}
    assert seen[1]["a"]["fused"] == ["a"] and seen[1]["b"]["stage"].startswith("started")
    final = json.loads(out.read_text())
    assert final["b"]["fused"] == ["b"] and "stage" not in final["b"] and not list(tmp_path.glob("*.part"))


def test_checkpointing_checks_the_plans_bytes_against_the_steps(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "checkpointed.json"
    main(["--models", "MegatronBert,Yoso", "--checkpointing", "--out", str(out)])
    results = json.loads(out.read_text())
    for r in results.values():  # a whole-model trace around checkpointed layers; an autograd Function in a layer
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [], r
        assert r["bytes"] == r["plan_bytes"] and r["bytes"]["eager"] > 0, r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert capsys.readouterr().out.count("plan = step") == 2
