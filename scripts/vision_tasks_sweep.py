"""Fuse Hugging Face's dense vision models (built from small configs) and check them against eager.

Every object detection, semantic / universal / instance segmentation, depth estimation, video classification,
super-resolution, keypoint detection / matching, pose estimation and masked image modeling class of the installed
transformers, each from its default config made small: 1-2 layers 16-64 wide, nested backbone configs too (a timm
backbone swapped for a small Hugging Face one: nothing is downloaded), dropouts 0; 64 px images, batch 2, 4 video
frames; the text-grounded detectors (Grounding DINO, OWL-ViT, OmDet-Turbo) get random 8-token prompts. Then
``hf_sweep.py``'s checks: one training step of the fused model and of the original (the outputs and every parameter
gradient of a fixed random projection of them: a detector's logits and boxes, no loss), eval, ``inference_mode``, the
fused model pickled (where the original pickles: one holding a transformers backbone does not). The same records and
line as ``hf_sweep.py``; ``dtype`` where a model runs in another than asked (DAB-DETR makes float32 tensors itself).

    python scripts/vision_tasks_sweep.py              # float64: errors are rounding (<= 1e-12)
    python scripts/vision_tasks_sweep.py --models DetrForObjectDetection,UperNetForSemanticSegmentation
    python scripts/vision_tasks_sweep.py --list
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep
import timm_sweep as TS  # noqa: E402 - the command line, shared

SIZE, FRAMES = 64, 4  # image side (pixels), video frames
TASKS = ("ForObjectDetection", "ForSemanticSegmentation", "ForUniversalSegmentation", "ForInstanceSegmentation",
         "ForDepthEstimation", "ForVideoClassification", "ForImageSuperResolution", "ForKeypointDetection",
         "ForPoseEstimation", "ForMaskedImageModeling", "ForKeypointMatching")
# every config field of these names (nested configs too) takes the small value
SCALARS = dict(vocab_size=100, projection_dim=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, d_model=32, image_size=SIZE, crop_size=SIZE, frames_per_clip=FRAMES,
               aspp_out_channels=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, embed_dim=16,
               embedding_size=16, encoder_hidden_dim=32, fusion_hidden_size=32, feature_size=32, mask_feature_size=32,
               hidden_dim=32, encoder_feedforward_dim=64, dim_feedforward=64, auxiliary_channels=16,
               reassemble_hidden_size=32, head_hidden_size=16, fpn_feature_size=32, decoder_hidden_size=32,
               conv_dim=32, mask_dim=32, pooler_output_size=32, bottleneck_features=32, bin_embedding_dim=16,
               decoder_num_hidden_layers=1, decoder_intermediate_size=64, decoder_num_attention_heads=4,
               num_detection_tokens=4, num_denoising=0, text_encoder_width=32, text_encoder_num_layers=1,
               text_encoder_vocab_size=100, task_seq_len=8, text_encoder_context_length=8, text_encoder_n_ctx=2,
               num_frames=FRAMES, lqe_hidden_dim=16, num_pooler_layers=1, pred_hidden_size=32,
               pred_num_hidden_layers=1, pred_num_attention_heads=4, num_spatial_layers=1, num_temporal_layers=1,
               num_auxiliary_layers=1, group_detr=1, num_blocks=1, decoder_self_attention_heads=4,
               decoder_cross_attention_heads=4, projector_out_channels=32)
# list fields: one block a stage, widths doubling from 16, one head a stage
LISTS = dict(depths=lambda v: [1] * len(v), hidden_sizes=lambda v: [16 << i for i in range(len(v))],
             num_heads=lambda v: [1] * len(v), neck_hidden_sizes=lambda v: [16] * len(v),
             num_attention_heads=lambda v: [1] * len(v), post_process_channels=lambda v: [16] * len(v),
             image_size=lambda v: [SIZE] * len(v), tubelet_size=lambda v: [1, 8, 8],
             decoder_in_channels=lambda v: [32] * len(v))
RESNET = dict(model_type="resnet", embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
              layer_type="basic")
HGNET = dict(stem_channels=[3, 8, 16], stage_in_channels=[16, 16, 32, 64], stage_mid_channels=[16, 16, 32, 64],
             stage_out_channels=[16, 32, 64, 128], stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[1, 1, 1, 1])
RT_DETR = dict(backbone_config=HGNET, encoder_in_channels=[32, 64, 128])  # the last three stages' widths
_K = {"long": 7, "mid": 5, "short": 3}  # the PP-OCR text detectors' intra-class blocks: kernel, stride, padding
INTRACLASS = {"reduce_channel": [1, 1, 0], "return_channel": [1, 1, 0],
              **{f"vertical_long_to_small_conv_{n}ratio": [[k, 1], [1, 1], [k // 2, 0]] for n, k in _K.items()},
              **{f"horizontal_small_to_long_conv_{n}ratio": [[1, k], [1, 1], [0, k // 2]] for n, k in _K.items()},
              **{f"symmetric_conv_long_{n}ratio": [[k, k], [1, 1], [k // 2, k // 2]] for n, k in _K.items()}}
LCNET = dict(stem_channels=[3, 16, 16], out_indices=[1, 2, 3, 4], block_configs=[  # 4 stages, 16 wide
    [[3, 16, 16, 1, False]], [[3, 16, 16, 2, False]], [[3, 16, 16, 2, False]], [[3, 16, 16, 2, False]]])
CLIP_TEXT = dict(bos_token_id=1, eos_token_id=2)  # token ids inside the small vocabulary: the largest id pools
SUPERPOINT = dict(encoder_hidden_sizes=[16, 16, 32, 32], decoder_hidden_size=32, descriptor_decoder_dim=32)
SMALL_VIT = dict(patch_size=4, image_size=8)
# per class: config fields (a nested config's dict changes its fields; one with "model_type" replaces it);
# "_float32": its own forward makes float32 tensors, so float64 runs as float32
FIXES: dict[str, dict] = {
    "DetrForObjectDetection": dict(backbone_config=RESNET),
    "ConditionalDetrForObjectDetection": dict(backbone_config=RESNET),
    "DabDetrForObjectDetection": dict(backbone_config=RESNET, _float32=True),
    "TableTransformerForObjectDetection": dict(backbone_config=RESNET),
    "DeformableDetrForObjectDetection": dict(backbone_config=RESNET, disable_custom_kernels=True),
    "DFineForObjectDetection": RT_DETR, "Deimv2ForObjectDetection": RT_DETR,
    "PPDocLayoutV2ForObjectDetection": dict(RT_DETR, class_thresholds=[0.5, 0.5], class_order=[0, 1]),
    "PPDocLayoutV3ForObjectDetection": dict(RT_DETR, x4_feat_dim=16),
    "PPDocLayoutV4ForObjectDetection": RT_DETR,
    "BeitForSemanticSegmentation": dict(num_hidden_layers=4, out_indices=[1, 2, 3, 4]),
    "CHMv2ForDepthEstimation": dict(backbone_config=dict(return_class_token=True)),
    "DepthProForDepthEstimation": dict(
        patch_size=8, intermediate_hook_ids=[1, 0], intermediate_feature_dims=[16, 16], scaled_images_ratios=[0.5, 1.0],
        scaled_images_overlap_ratios=[0.0, 0.2], scaled_images_feature_dims=[16, 16], image_model_config=SMALL_VIT,
        patch_model_config=SMALL_VIT, fov_model_config=SMALL_VIT),
    "LwDetrForObjectDetection": dict(projector_scale_factors=[0.5, 2.0], backbone_config=dict(
        num_hidden_layers=4, window_block_indices=[0, 2], out_indices=[1, 3])),
    "PPOCRV5ServerDetForObjectDetection": dict(
        backbone_config=HGNET, neck_out_channels=32, intraclass_block_config=INTRACLASS, scale_factor_list=[1, 2, 4, 8],
        kernel_list=[3, 2, 2]),
    "PPOCRV6MediumDetForObjectDetection": dict(
        neck_out_channels=16, intraclass_block_config=INTRACLASS, scale_factor_list=[1, 2, 4, 8], kernel_list=[3, 2, 2],
        backbone_config=LCNET),
    "PPOCRV6SmallDetForObjectDetection": dict(neck_out_channels=16, layer_list_out_channels=[16] * 4,
                                              backbone_config=LCNET),
    "Sapiens2ForPoseEstimation": dict(num_first_full_attention_layers=1, num_last_full_attention_layers=1,
                                      num_key_value_heads_per_layer=[4, 4], head_config=dict(
                                          upsample_out_channels=[16, 16], upsample_kernel_sizes=[4, 4],
                                          conv_out_channels=[16], conv_kernel_sizes=[1])),
    "OwlViTForObjectDetection": dict(text_config=CLIP_TEXT), "Owlv2ForObjectDetection": dict(text_config=CLIP_TEXT),
    "OmDetTurboForObjectDetection": dict(  # a Swin backbone for its timm one; its class embedding the text width
        backbone_config=dict(model_type="swin", out_indices=[2, 3, 4]), apply_layernorm_after_vision_backbone=False,
        encoder_in_channels=[32, 64, 128], text_config=CLIP_TEXT, text_projection_in_dim=32, text_projection_out_dim=32,
        class_embed_dim=32, task_encoder_hidden_dim=64, decoder_hidden_dim=64, d_model=64, decoder_num_heads=4,
        decoder_dim_feedforward=64, encoder_dim_feedforward=64, vision_features_channels=[64] * 3),
    "SuperPointForKeypointDetection": SUPERPOINT,
    "SuperGlueForKeypointMatching": dict(keypoint_detector_config=SUPERPOINT, keypoint_encoder_sizes=[16, 32],
                                         gnn_layers_types=["self", "cross"], sinkhorn_iterations=10),
    "LightGlueForKeypointMatching": dict(keypoint_detector_config=SUPERPOINT, descriptor_dim=32),
    "EfficientLoFTRForKeypointMatching": dict(
        stage_num_blocks=[1, 1, 1, 1], out_features=[16, 16, 32, 32], stage_in_channels=[1, 16, 16, 32],
        stage_block_stride=[[2], [1], [2], [2]], stage_block_out_channels=[[16], [16], [32], [32]],
        stage_block_in_channels=[[1], [16], [16], [32]], fine_fusion_dims=[32, 32, 16], num_attention_layers=2,
        num_attention_heads=8, num_key_value_heads=8),  # its rotary embedding takes 8 heads
    "SwinForMaskedImageModeling": dict(patch_size=2, window_size=4, encoder_stride=16),
    "MobileNetV2ForSemanticSegmentation": dict(depth_multiplier=0.35),
    "PPOCRV5MobileDetForObjectDetection": dict(backbone_config=dict(scale=0.25)),
    "MobileViTV2ForSemanticSegmentation": dict(width_multiplier=0.25, n_attn_blocks=[1, 1, 1]),
}
FIXES["Sapiens2ForSemanticSegmentation"] = FIXES["Sapiens2ForPoseEstimation"]


def vision_task_models() -> list[str]:
    """Every class of the installed transformers whose name ends in one of ``TASKS``."""
    import transformers as T

    return sorted(n for n in dir(T) if n.endswith(TASKS) and not n.startswith("Auto"))


def _is_config(v) -> bool:
    return hasattr(v, "to_dict") and hasattr(v, "model_type")


def _small(cfg, fixes: dict):
    """A config of ``type(cfg)`` like ``cfg`` with the small sizes, its nested configs small too, then ``fixes``."""
    import transformers as T

    if "model_type" in fixes:  # a replacement: that model type's defaults made small
        fixes = dict(fixes)
        cfg = T.AutoConfig.for_model(fixes.pop("model_type"))
    params = set(inspect.signature(type(cfg).__init__).parameters) - {"self", "transformers_version", "architectures"}
    kw = {}
    for k in params:
        v = getattr(cfg, k, None)
        if k in SCALARS and isinstance(v, int) and not isinstance(v, bool):
            kw[k] = SCALARS[k]
        elif k in LISTS and isinstance(v, (list, tuple)):
            kw[k] = LISTS[k](v)
        elif _is_config(v):
            kw[k] = _small(v, fixes.get(k, {}))
        elif v is not None and not k.startswith("_"):
            kw[k] = v
    layers = kw.get("num_hidden_layers")
    outs = getattr(cfg, "out_indices", None)
    if outs and layers and max(outs) > layers:  # a ViT backbone: its last layers, as many as it had
        kw["num_hidden_layers"] = layers = max(layers, len(outs))
        kw["out_indices"] = list(range(layers - len(outs) + 1, layers + 1))
    elif outs:
        kw["out_indices"] = list(outs)
    hooks = getattr(cfg, "backbone_out_indices", None)  # DPT: the layers the neck reads
    if hooks and layers and max(hooks) >= layers:
        kw["num_hidden_layers"] = layers = max(layers, len(hooks))
        kw["backbone_out_indices"] = list(range(layers - len(hooks), layers))
    for k, v in fixes.items():
        if _is_config(getattr(cfg, k, None)) or k.startswith("_"):  # done above
            continue
        kw[k] = _small(None, v) if isinstance(v, dict) and "model_type" in v else v
    return type(cfg)(**kw)


@contextlib.contextmanager
def _no_losses(cls):
    """The segmentation models build their Hungarian-matching loss at construction, which asks for scipy: without
    scipy it is built anyway (the sweep passes no labels, so the matching never runs)."""
    module = sys.modules[cls.__module__]
    if importlib.util.find_spec("scipy") is not None or not hasattr(module, "requires_backends"):
        yield
        return
    asks = module.requires_backends
    module.requires_backends = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.requires_backends = asks


def build(name: str, dtype: torch.dtype, dropout: float = 0.0):
    """The model (train mode, ``dtype``) and its keyword inputs: images, video frames or image pairs, and the prompts
    a text-grounded detector takes."""
    import transformers as T

    cls = getattr(T, name)
    fixes = FIXES.get(name, {})
    cfg = S.eager_with_dropout(_small(cls.config_class(), fixes), dropout)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    with _no_losses(cls):
        model = cls(cfg)
    key = model.main_input_name if str(model.main_input_name).startswith("pixel_values") else "pixel_values"
    frames = getattr(cfg, "num_frames", None) or getattr(cfg, "frames_per_clip", FRAMES)
    shape = (2, frames, 3, SIZE, SIZE) if "Video" in name else (2, 2, 3, SIZE, SIZE) if "Matching" in name else (
        2, 3, SIZE, SIZE)  # a matcher: pairs of images
    inputs = {key: torch.randn(*shape, generator=g)}
    takes = inspect.signature(model.forward).parameters
    if "task_inputs" in takes:  # OneFormer: the task prompt's token ids
        inputs["task_inputs"] = torch.randint(cfg.text_encoder_vocab_size, (2, cfg.task_seq_len), generator=g)
    if "input_ids" in takes:  # the text-grounded detectors: one query of 8 tokens an image
        inputs["input_ids"] = torch.randint(3, cfg.text_config.vocab_size, (2, 8), generator=g)
    if "classes_input_ids" in takes:  # OmDet-Turbo: 2 class prompts and a task prompt an image
        inputs.update(classes_input_ids=torch.randint(3, 100, (4, 8), generator=g), tasks_input_ids=torch.randint(
            3, 100, (2, 8), generator=g), classes_structure=torch.tensor([2, 2]))
        inputs.update(classes_attention_mask=torch.ones(4, 8, dtype=torch.long),
                      tasks_attention_mask=torch.ones(2, 8, dtype=torch.long))
    if fixes.get("_float32") and dtype == torch.float64:
        dtype = torch.float32
    model = model.to(dtype).train()
    return model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def running(name: str, dtype: torch.dtype, r: dict, dropout: float = 0.0):
    """``hf_sweep.build_running`` for these models: built (stage "build") and run once (stage "eager")."""
    r["stage"] = "build"
    model, inputs = build(name, dtype, dropout)
    if model.dtype != dtype:
        r["dtype"] = str(model.dtype).removeprefix("torch.")
    r["stage"] = "eager"
    # run on a copy: a model that asks its encoder for hidden states (DPT) has transformers install output-capturing
    # hooks (local functions, which do not pickle) at its first call
    S._run(copy.deepcopy(model), inputs)
    return model, inputs


def main(argv=None) -> None:
    # a model holding a transformers backbone has output-capturing hooks from its construction on (local functions):
    # it does not pickle, and ``hf_sweep.fuse_recorded`` records that instead of a fusion failure
    TS.sweep_main(argv, __doc__, vision_task_models, running=running)


if __name__ == "__main__":
    main()
