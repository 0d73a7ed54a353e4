"""scripts/multimodal_sweep.py, the sweep of Hugging Face's multimodal and time-series models, on three of them: CLIP
(a dual encoder: two towers and a contrastive loss), LLaVA (a CLIP vision tower, a projector and a Llama whose
prompt holds as many image tokens as the tower's features) and PatchTST forecasting (a time series cut into patches,
BatchNorm inside)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "multimodal_sweep.py"
NAMES = ["CLIPModel", "LlavaForConditionalGeneration", "PatchTSTForPrediction"]


def test_the_multimodal_sweep_fuses_a_dual_encoder_a_vlm_and_a_forecaster(tmp_path, capsys):
    sweep = runpy.run_path(str(SCRIPT))
    out = tmp_path / "multimodal.json"
    sweep["main"](["--models", ",".join(NAMES), "--out", str(out)])
    results = json.loads(out.read_text())
    for name in NAMES:
        r = results[name]
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [] and "ran_unfused" not in r, r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-10, r
    assert {"qkv@module", "linear_quick_gelu_linear@module"} <= set(results["CLIPModel"]["fused"])
    assert "attention@fx" in results["PatchTSTForPrediction"]["fused"]
    llava = results["LlavaForConditionalGeneration"]
    assert {"gated_mlp_silu@module", "linear_quick_gelu_linear@module"} <= set(llava["fused"])  # both towers
    assert llava["image_tokens"] == 16  # a 32 px image in 8 px patches, the CLS token dropped
    assert "does not pickle" not in llava.get("pickled", "")  # counting image tokens on a copy: no hooks left
    assert "PatchTSTForPrediction" in capsys.readouterr().out


def test_the_multimodal_sweep_lists_the_mapped_classes(capsys):
    runpy.run_path(str(SCRIPT))["main"](["--list"])
    listed = capsys.readouterr().out.split()
    assert {"LlavaForConditionalGeneration", "PaliGemmaForConditionalGeneration", "Idefics3ForConditionalGeneration",
            "Qwen2VLForConditionalGeneration", "Blip2ForConditionalGeneration", "CLIPModel", "SiglipModel",
            "AlignModel", "PatchTSTForClassification", "PatchTSMixerForRegression", "InformerForPrediction",
            "AutoformerForPrediction", "TimeSeriesTransformerForPrediction"} <= set(listed)
    assert len(listed) == len(set(listed))
    assert not any(n.startswith(("AutoModel", "AutoConfig")) for n in listed)
