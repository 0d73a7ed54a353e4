"""scripts/multimodal_sweep.py, the sweep of Hugging Face's multimodal and time-series models, on three of them: CLIP
(a dual encoder: two towers and a contrastive loss), LLaVA (a CLIP vision tower, a projector and a Llama whose
prompt holds as many image tokens as the tower's features) and PatchTST forecasting (a time series cut into patches,
BatchNorm inside)."""

from __future__ import annotations

import pytest

from tests.fusion._sweeps import clean_records, sweep

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NAMES = ["CLIPModel", "LlavaForConditionalGeneration", "PatchTSTForPrediction"]


def test_the_multimodal_sweep_fuses_a_dual_encoder_a_vlm_and_a_forecaster(tmp_path, capsys):
    results = clean_records("multimodal_sweep.py", NAMES, tmp_path)
    assert {"qkv@module", "linear_quick_gelu_linear@module"} <= set(results["CLIPModel"]["fused"])
    assert "attention@fx" in results["PatchTSTForPrediction"]["fused"]
    llava = results["LlavaForConditionalGeneration"]
    assert {"gated_mlp_silu@module", "linear_quick_gelu_linear@module"} <= set(llava["fused"])  # both towers
    assert llava["image_tokens"] == 16  # a 32 px image in 8 px patches, the CLS token dropped
    assert "does not pickle" not in llava.get("pickled", "")  # counting image tokens on a copy: no hooks left
    assert "PatchTSTForPrediction" in capsys.readouterr().out


def test_the_multimodal_sweep_lists_the_mapped_classes(capsys):
    sweep("multimodal_sweep.py")["main"](["--list"])
    listed = capsys.readouterr().out.split()
    assert {"LlavaForConditionalGeneration", "PaliGemmaForConditionalGeneration", "Idefics3ForConditionalGeneration",
            "Qwen2VLForConditionalGeneration", "Blip2ForConditionalGeneration", "CLIPModel", "SiglipModel",
            "AlignModel", "PatchTSTForClassification", "PatchTSMixerForRegression", "InformerForPrediction",
            "AutoformerForPrediction", "TimeSeriesTransformerForPrediction"} <= set(listed)
    assert len(listed) == len(set(listed))
    assert not any(n.startswith(("AutoModel", "AutoConfig")) for n in listed)
