"""The inputs ``multimodal_sweep.py`` gives each family: images laid out as a forward asks (patch grids, tiles,
frames, packed strips), a prompt holding as many image tokens as the model's own image features, what a forward
reads beside its prompt, and a time series with its time features."""

from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - flatten_tensors

SIZE, PATCH, BATCH, TEXT = 32, 8, 2, 8  # image side and patch (pixels): a 4 x 4 grid; prompt text tokens
V, SPECIAL = 128, 32  # vocabulary; its top SPECIAL ids hold the special tokens, the text is drawn below them


def _first(cfg, *keys):
    """The first of ``keys`` set on ``cfg`` or its text config."""
    for c in (cfg, cfg.get_text_config()):
        for k in keys:
            if isinstance(getattr(c, k, None), int):
                return getattr(c, k)
    return None


def _vision_config(cfg):
    """The vision tower's config (a vision-encoder-decoder's encoder), or ``cfg`` where it has none of its own."""
    return next((getattr(cfg, k) for k in ("vision_config", "encoder") if hasattr(getattr(cfg, k, None), "to_dict")),
                cfg)


def _channels(vc) -> int:
    return next((getattr(vc, k) for k in ("num_channels", "in_channels", "in_chans") if hasattr(vc, k)), 3)


def _grid(side: int) -> torch.Tensor:
    """The (x, y) places of a ``side`` x ``side`` grid of patches, row by row."""
    return torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(-1, 2)


def _patches(vc, takes, layout: str, g) -> dict | None:
    """The patch layouts ``takes`` (the forward's parameters) asks for: Qwen-VL's flattened patches with their grid,
    MiniCPM-V's packed strips, SigLIP2's patches with their shapes, Gemma 4's with their places, Pix2Struct's with
    their row and column; None where it takes images."""
    chans = _channels(vc)
    patch = getattr(vc, "model_patch_size", None) or (vc.patch_size if isinstance(getattr(vc, "patch_size", None),
                                                                                   int) else PATCH)
    side = SIZE // patch
    flat = (BATCH, side * side, chans * patch * patch)  # a batch of images, each one row of patches
    grid = next((k for k in ("image_grid_thw", "image_grid_hw") if k in takes), None)
    if grid and layout == "tokens_last":  # Inkling 2: a merged block of patches a row, channels last
        merge = vc.spatial_merge_size
        return {"pixel_values": torch.randn(BATCH * (side // merge) ** 2, patch * merge, patch * merge, chans,
                                            generator=g),
                grid: torch.tensor([[1, side // merge, side // merge]] * BATCH)}
    if grid:
        t = getattr(vc, "temporal_patch_size", None) or getattr(vc, "patch_temporal", 1)
        shape = (chans, patch, patch) if layout == "patches" else (chans * t * patch * patch,)
        return {"pixel_values": torch.randn(BATCH * side * side, *shape, generator=g),
                grid: torch.tensor([[1, side, side] if grid.endswith("thw") else [side, side]] * BATCH)}
    if "target_sizes" in takes:
        return {"pixel_values": torch.randn(1, chans, patch, BATCH * side * side * patch, generator=g),
                "target_sizes": torch.tensor([[side, side]] * BATCH)}
    if "spatial_shapes" in takes:
        return {"pixel_values": torch.randn(*flat, generator=g), "spatial_shapes": torch.tensor([[side, side]] * BATCH),
                "pixel_attention_mask": torch.ones(BATCH, side * side, dtype=torch.long)}
    if "image_position_ids" in takes:
        return {"pixel_values": torch.randn(*flat, generator=g),
                "image_position_ids": _grid(side).expand(BATCH, -1, -1)}
    if "flattened_patches" in takes:  # 1-based row and column first
        rows_cols = (_grid(side).flip(-1) + 1).expand(BATCH, -1, -1).float()
        out = {"flattened_patches": torch.cat([rows_cols, torch.randn(*flat, generator=g)], -1)}
        return out | ({"width": torch.tensor([SIZE] * BATCH), "height": torch.tensor([SIZE] * BATCH)}
                      if "width" in takes else {})
    if layout == "flat":
        return {"pixel_values": torch.randn(*flat, generator=g)}
    return None


def _images(cfg, vc, takes, layout: str, g) -> dict:
    """The image layouts: video frames, images per sample (tiles), Mllama's tiles with their aspect ratios,
    LLaVA-NeXT's tiles, or a batch of images."""
    image = (_channels(vc), SIZE, SIZE)
    if "pixel_values" not in takes and "pixel_values_videos" not in takes:
        return {}
    if "pixel_values" not in takes or layout == "video":
        key = "pixel_values" if "pixel_values" in takes else "pixel_values_videos"
        return {key: torch.randn(BATCH, getattr(vc, "num_frames", 4), *image, generator=g)}
    if "pixel_attention_mask" in takes or "image_attention_mask" in takes:
        out = {"pixel_values": torch.randn(BATCH, 1, *image, generator=g)}
        return out | ({"pixel_attention_mask": torch.ones(BATCH, 1, dtype=torch.bool)} if layout == "tiles" else {})
    if "aspect_ratio_ids" in takes:  # one image a sample, of one tile (aspect ratio 1:1, id 1) and padding tiles
        tiles = vc.max_num_tiles
        return {"pixel_values": torch.randn(BATCH, 1, tiles, *image, generator=g),
                "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long),
                "aspect_ratio_mask": (torch.arange(tiles) < 1).long().expand(BATCH, 1, -1)}
    if getattr(cfg, "image_grid_pinpoints", None):  # one tile of the image's own size, after the whole image
        return {"pixel_values": torch.randn(BATCH, 2, *image, generator=g),
                "image_sizes": torch.tensor([[SIZE, SIZE]] * BATCH)}
    out = {"pixel_values": torch.randn(BATCH, *image, generator=g)}
    if "image_sizes" in takes and (getattr(vc, "model_type", "") == "pixtral" or "image_sizes!" in takes):
        out["image_sizes"] = torch.tensor([[SIZE, SIZE]] * BATCH)  # images at their own sizes
    return out


def _pixels(cfg, takes, layout: str, g) -> dict:
    """The images ``takes`` asks for, and what the vision side reads besides (a Q-Former's prompt, a second
    resolution, a merge size)."""
    vc = _vision_config(cfg)
    out = _patches(vc, takes, layout, g)
    out = _images(cfg, vc, takes, layout, g) if out is None else out
    if "qformer_input_ids" in takes:
        out["qformer_input_ids"] = torch.randint(3, V - SPECIAL, (BATCH, 4), generator=g)
        out["qformer_attention_mask"] = torch.ones(BATCH, 4, dtype=torch.long)
    if "high_res_pixel_values" in takes:
        high = cfg.high_res_vision_config.image_size
        out["high_res_pixel_values"] = torch.randn(BATCH, 3, high, high, generator=g)
    if "image_merge_sizes" in takes:
        out["image_merge_sizes"] = torch.tensor([getattr(vc, "spatial_merge_size", 1)] * BATCH)
    return out


def _features_owner(model):
    """The module whose ``get_image_features`` has the explicit signature (the inner model's, where it has one)."""
    return next((m for m in (getattr(model, "model", None), model) if hasattr(m, "get_image_features")), None)


def _image_tokens(model, pixels: dict, width: int) -> int:
    """How many image tokens a sample's prompt needs: the model's own image features, counted."""
    owner = _features_owner(model)
    if owner is None or not pixels:
        return 0
    get = copy.deepcopy(owner).get_image_features  # on a copy: a first call installs output-capturing hooks
    takes = inspect.signature(get).parameters
    with torch.no_grad():
        out = get(**{k: v for k, v in pixels.items() if k in takes})
    feats = getattr(out, "pooler_output", None) if not torch.is_tensor(out) else out
    feats = out if feats is None else feats
    return sum(t.numel() for t in S.flatten_tensors(feats)) // width // BATCH


def image_id(cfg, takes) -> int | None:
    """The image token's id; where the config names none and the forward marks image tokens with a mask
    (Kosmos-2), one below the special tokens, above the text; None for a dual encoder."""
    image = _first(cfg, "image_token_id", "image_token_index")
    return V - SPECIAL if image is None and "image_embeds_position_mask" in takes else image


def _prompt(image, start, end, n_image: int, g) -> torch.Tensor:
    """``BATCH`` prompts: text, the image's start token, ``n_image`` image tokens, its end token, text."""
    rows = []
    for _ in range(BATCH):
        text = torch.randint(3, V - SPECIAL, (TEXT,), generator=g).tolist()
        middle = [start] * (start is not None) + [image] * n_image + [end] * (end is not None) if n_image else []
        rows.append(text[:3] + middle + text[3:])
    return torch.tensor(rows)


def vlm_inputs(model, cfg, takes, fixes: dict, g) -> dict:
    """A dual encoder's texts and images; a generation model's prompts (and labels) with their images, as many
    image tokens as its features (or ``fixes["_image_tokens"]``), a placeholder id where its config names none
    (Kosmos-2 marks them with a mask)."""
    owner = _features_owner(model)
    needs = {f"{k}!" for k, p in inspect.signature(owner.get_image_features).parameters.items()
             if p.default is p.empty} if owner else set()  # "name!": its image features need it
    pixels = _pixels(cfg, takes | needs, fixes.get("_layout", ""), g)
    pixels = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in pixels.items()}
    image = image_id(cfg, takes)
    n = 0 if image is None else fixes.get("_image_tokens") or _image_tokens(
        model, pixels, cfg.get_text_config().hidden_size)
    ids = _prompt(image, _first(cfg, "boi_token_id", "boi_token_index", "vision_start_token_id",
                                "image_start_token_id"),
                  _first(cfg, "eoi_token_id", "eoi_token_index", "vision_end_token_id", "image_end_token_id"), n, g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if "input_ids" in takes else {}
    inputs.update(pixels)
    for k in ("mm_token_type_ids", "token_type_ids", "image_embeds_position_mask"):
        if k in takes and n:
            inputs[k] = (ids == image).long()
    return inputs | _beside_prompt(model, cfg, takes, ids, inputs, g)


def _beside_prompt(model, cfg, takes, ids, inputs: dict, g) -> dict:
    """What a forward reads beside its prompt: which image (tile) each token attends to, a protein, each token's
    box on a page, its labels (a language model's: the prompt) or decoder prompt, a dual encoder's loss."""
    out = {}
    if "image_attention_mask" in takes:  # IDEFICS: every token attends to the sample's image
        out["image_attention_mask"] = torch.ones(*ids.shape, 1, dtype=torch.long)
    if "cross_attention_mask" in takes:  # Mllama: every token attends to the sample's image's first tile
        tiles = inputs["aspect_ratio_mask"].shape[-1]
        out["cross_attention_mask"] = (torch.arange(tiles) < 1).long().expand(*ids.shape, 1, -1)
    if "protein_input_ids" in takes:  # Evolla
        protein = torch.randint(3, cfg.protein_encoder_config.vocab_size, (BATCH, TEXT), generator=g)
        out.update(protein_input_ids=protein, protein_attention_mask=torch.ones_like(protein))
    if "bbox" in takes:  # UDOP: in thousandths of the page
        corner = torch.randint(0, 500, (*ids.shape, 2), generator=g)
        out["bbox"] = torch.cat([corner, corner + 100], -1)
    if "labels" in takes and model.get_output_embeddings() is not None:
        out["labels"] = ids.clone()
    elif "decoder_input_ids" in takes:
        out["decoder_input_ids"] = ids[:, :TEXT].clone()
    if "return_loss" in takes:
        out["return_loss"] = True
    return out


def series_inputs(model, cfg, takes, g) -> dict:
    """A context of past values (with the lags the model reads before it), its time features and observed mask,
    the horizon's values as targets; a classifier's or regressor's targets."""
    chans = getattr(cfg, "num_input_channels", None) or getattr(cfg, "input_size", 1)
    past = cfg.context_length + max(getattr(cfg, "lags_sequence", None) or [0])
    horizon = getattr(cfg, "prediction_length", None) or getattr(cfg, "horizon_length", 4)
    shape = (BATCH, past, chans) if hasattr(cfg, "num_input_channels") or chans > 1 else (BATCH, past)
    inputs = {"past_values": torch.randn(*shape, generator=g)}
    for k in ("past_observed_mask", "observed_mask"):
        if k in takes:
            inputs[k] = torch.ones(*shape)
    times = getattr(cfg, "num_time_features", 0)
    if "past_time_features" in takes:
        inputs["past_time_features"] = torch.randn(BATCH, past, times, generator=g)
        inputs["future_time_features"] = torch.randn(BATCH, horizon, times, generator=g)
    if "future_values" in takes:
        inputs["future_values"] = torch.randn(BATCH, horizon, *shape[2:], generator=g)
    if "target_values" in takes and "Classification" in type(model).__name__:
        inputs["target_values"] = torch.randint(cfg.num_targets, (BATCH,), generator=g)
    elif "target_values" in takes:
        inputs["target_values"] = torch.randn(BATCH, cfg.num_targets, generator=g)
    return inputs
