"""scripts/vision_tasks_sweep.py, the sweep of Hugging Face's dense vision models, on three of them: UperNet on a small
ResNet backbone (its Conv -> BN -> ReLU chains fuse as modules), DETR with a small Hugging Face ResNet for its timm
backbone (attention and LayerNorms in fx regions; logits and boxes compared, no loss) and DPT for depth (a ViT read at
its layers by a neck, whose first call makes transformers install output-capturing hooks)."""

from __future__ import annotations

import pytest

from tests.fusion._sweeps import clean_records, sweep

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NAMES = ["UperNetForSemanticSegmentation", "DetrForObjectDetection", "DPTForDepthEstimation"]


def test_the_vision_tasks_sweep_fuses_segmentation_detection_and_depth_models(tmp_path, capsys):
    results = clean_records("vision_tasks_sweep.py", NAMES, tmp_path)
    assert results["UperNetForSemanticSegmentation"]["fused"].count("conv_bn_relu@module") >= 10
    assert "attention@fx" in results["DetrForObjectDetection"]["fused"]
    assert results["DetrForObjectDetection"]["fx_regions"]
    assert "DPTForDepthEstimation" in capsys.readouterr().out


def test_the_vision_tasks_sweep_lists_every_task(capsys):
    sweep("vision_tasks_sweep.py")["main"](["--list"])
    listed = set(capsys.readouterr().out.split())
    assert {"DetrForObjectDetection", "RTDetrForObjectDetection", "SegformerForSemanticSegmentation",
            "UperNetForSemanticSegmentation", "Mask2FormerForUniversalSegmentation",
            "MaskFormerForInstanceSegmentation", "DPTForDepthEstimation", "DepthAnythingForDepthEstimation",
            "VideoMAEForVideoClassification", "Swin2SRForImageSuperResolution", "SuperPointForKeypointDetection",
            "VitPoseForPoseEstimation", "ViTForMaskedImageModeling"} <= listed
    assert not any(n.startswith("Auto") for n in listed)
