"""scripts/vision_tasks_sweep.py, the sweep of Hugging Face's dense vision models, on three of them: UperNet on a small
ResNet backbone (its Conv -> BN -> ReLU chains fuse as modules), DETR with a small Hugging Face ResNet for its timm
backbone (attention and LayerNorms in fx regions; logits and boxes compared, no loss) and DPT for depth (a ViT read at
its layers by a neck, whose first call makes transformers install output-capturing hooks)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vision_tasks_sweep.py"
NAMES = ["UperNetForSemanticSegmentation", "DetrForObjectDetection", "DPTForDepthEstimation"]


def test_the_vision_tasks_sweep_fuses_segmentation_detection_and_depth_models(tmp_path, capsys):
    sweep = runpy.run_path(str(SCRIPT))
    out = tmp_path / "vision.json"
    sweep["main"](["--models", ",".join(NAMES), "--out", str(out)])
    results = json.loads(out.read_text())
    for name in NAMES:
        r = results[name]
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [] and "ran_unfused" not in r, r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-10, r
    assert results["UperNetForSemanticSegmentation"]["fused"].count("conv_bn_relu@module") >= 10
    assert "attention@fx" in results["DetrForObjectDetection"]["fused"]
    assert results["DetrForObjectDetection"]["fx_regions"]
    assert "DPTForDepthEstimation" in capsys.readouterr().out


def test_the_vision_tasks_sweep_lists_every_task(capsys):
    runpy.run_path(str(SCRIPT))["main"](["--list"])
    listed = set(capsys.readouterr().out.split())
    assert {"DetrForObjectDetection", "RTDetrForObjectDetection", "SegformerForSemanticSegmentation",
            "UperNetForSemanticSegmentation", "Mask2FormerForUniversalSegmentation",
            "MaskFormerForInstanceSegmentation", "DPTForDepthEstimation", "DepthAnythingForDepthEstimation",
            "VideoMAEForVideoClassification", "Swin2SRForImageSuperResolution", "SuperPointForKeypointDetection",
            "VitPoseForPoseEstimation", "ViTForMaskedImageModeling"} <= listed
    assert not any(n.startswith("Auto") for n in listed)
