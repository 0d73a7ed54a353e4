"""The image and video transformers of ``diffusers_sweep.py`` (the other models: ``diffusers_models.py``), one
small builder per diffusers class as there: ``builder(diffusers, dtype) -> (model, keyword inputs)``, 1-2 layers,
heads 8-16 wide, latents of 8-16 px, a few frames, 5 text tokens.
"""

from __future__ import annotations

import torch
from diffusers_models import BATCH, TEXT, TOKENS, _randn, _steps, _text, _video

# image transformers


def _transformer2d(d, dtype):
    # Stable Diffusion 1/2's spatial transformer: GroupNorm, 1x1 conv in, self and cross attention, GEGLU
    model = d.Transformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=1,
                                 norm_num_groups=8, cross_attention_dim=TEXT)
    return model, {"hidden_states": _randn(0, BATCH, 32, 8, 8, dtype=dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _prior(d, dtype):
    # unCLIP / Kandinsky's image-embedding prior
    model = d.PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=2, embedding_dim=16,
                               num_embeddings=TOKENS, additional_embeddings=4)
    return model, {"hidden_states": _randn(0, BATCH, 16, dtype=dtype), "timestep": _steps(),
                   "proj_embedding": _randn(1, BATCH, 16, dtype=dtype),
                   "encoder_hidden_states": _text(2, 16, dtype)}


def _sana(d, dtype):
    model = d.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                     num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                     cross_attention_dim=16, caption_channels=TEXT, sample_size=8, patch_size=1)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _aura_flow(d, dtype):
    model = d.AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                         num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
                                         caption_projection_dim=TEXT, joint_attention_dim=TEXT, out_channels=4,
                                         pos_embed_max_size=64)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _lumina2(d, dtype):
    model = d.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                        num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2,
                                        axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=TEXT)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    mask[1, -2:] = False  # the second caption is 2 tokens shorter
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "encoder_attention_mask": mask}


def _hunyuan_dit(d, dtype):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model = d.HunyuanDiT2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                num_attention_heads=2, cross_attention_dim=16, cross_attention_dim_t5=16,
                                pooled_projection_dim=8, hidden_size=16, text_len=TOKENS, text_len_t5=TOKENS,
                                activation_fn="gelu-approximate")
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), output_type="pt")  # the pipeline's, 4x4 patches
    meta = torch.tensor([[1024, 1024, 64, 64, 0, 0]] * BATCH, dtype=dtype)  # original size, target size, crop
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, 16, dtype), "text_embedding_mask": torch.ones(BATCH, TOKENS),
                   "encoder_hidden_states_t5": _text(2, 16, dtype),
                   "text_embedding_mask_t5": torch.ones(BATCH, TOKENS), "image_meta_size": meta,
                   "style": torch.zeros(BATCH, dtype=torch.long), "image_rotary_emb": [t.to(dtype) for t in rope]}


def _cogview_inputs(dtype) -> dict:
    """CogView3-Plus' and CogView4's inputs: latents, text, and the SDXL-style size and crop conditions."""
    size = torch.tensor([[64, 64]] * BATCH)
    return {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
            "encoder_hidden_states": _text(1, TEXT, dtype), "original_size": size, "target_size": size,
            "crop_coords": torch.zeros(BATCH, 2, dtype=torch.long)}


# CogView3-Plus' and CogView4's settings (the same names in both)
COGVIEW = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
               text_embed_dim=TEXT, time_embed_dim=16, condition_dim=4, sample_size=8)


def _cogview4(d, dtype):
    return d.CogView4Transformer2DModel(pos_embed_max_size=16, **COGVIEW), _cogview_inputs(dtype)


def _qwenimage(d, dtype):
    model = d.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                          axes_dims_rope=(8, 4, 4))
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, -2:] = 0  # the second prompt is 2 tokens shorter
    return model, {"hidden_states": _randn(0, BATCH, 16, 16, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "encoder_hidden_states_mask": mask,
                   "img_shapes": [(1, 4, 4)] * BATCH}


def _chroma(d, dtype):
    model = d.ChromaTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                       axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
                                       approximator_hidden_dim=16, approximator_layers=1)
    return model, {"hidden_states": _randn(0, BATCH, 16, 4, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "img_ids": _randn(2, 16, 3, dtype=dtype),
                   "txt_ids": torch.zeros(TOKENS, 3, dtype=dtype)}


def _flux2(d, dtype):
    model = d.Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                      timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
    img = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1))  # (t, h, w, l)
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TOKENS))
    return model, {"hidden_states": _randn(0, BATCH, 16, 4, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "img_ids": img.expand(BATCH, -1, -1),
                   "txt_ids": txt.expand(BATCH, -1, -1), "guidance": torch.tensor([1.0, 3.5], dtype=dtype)}


def _z_image(d, dtype):
    # a list of images (channels, frames, height, width) and a list of captions, one per sample
    model = d.ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=1,
                                       n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT,
                                       axes_dims=(8, 4, 4), axes_lens=(64, 16, 16))
    return model, {"x": [_randn(i, 16, 1, 8, 8, dtype=dtype) for i in range(BATCH)],
                   "cap_feats": [_randn(10 + i, TOKENS + i, TEXT, dtype=dtype) for i in range(BATCH)],
                   "t": _steps(dtype)}


def _cogview3plus(d, dtype):
    return d.CogView3PlusTransformer2DModel(pos_embed_max_size=8, **COGVIEW), _cogview_inputs(dtype)


def _hidream(d, dtype):
    # HiDream-I1: dual- and single-stream blocks whose feed-forwards are mixtures of SwiGLU experts
    model = d.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                             num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                             caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
                                             num_activated_experts=2, axes_dims_rope=(4, 2, 2),
                                             max_resolution=(16, 16), llama_layers=(0, 1),
                                             force_inference_output=True)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timesteps": _steps(),
                   "encoder_hidden_states_t5": _text(1, 8, dtype),
                   "encoder_hidden_states_llama3": _randn(2, 2, BATCH, TOKENS, 4, dtype=dtype),  # 2 llama layers
                   "pooled_embeds": _randn(3, BATCH, 8, dtype=dtype)}


# video transformers


def _cogvideox(d, dtype):
    model = d.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                          time_embed_dim=8, text_embed_dim=TEXT, num_layers=2, sample_width=8,
                                          sample_height=8, sample_frames=5, patch_size=2, max_text_seq_length=TOKENS)
    return model, {"hidden_states": _randn(0, BATCH, 2, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _wan(d, dtype, cls="WanTransformer3DModel"):
    model = getattr(d, cls)(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                            out_channels=4, text_dim=TEXT, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _skyreels_v2(d, dtype):
    return _wan(d, dtype, "SkyReelsV2Transformer3DModel")


def _ltx_video(d, dtype):
    model = d.LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                         cross_attention_dim=16, num_layers=2, caption_channels=TEXT)
    frames, side = 2, 4  # patchified latents: (batch, frames * height * width, channels)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    mask[1, -2:] = False
    return model, {"hidden_states": _randn(0, BATCH, frames * side * side, 4, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "encoder_attention_mask": mask,
                   "num_frames": frames, "height": side, "width": side}


def _hunyuan_video(d, dtype):
    model = d.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                             attention_head_dim=10, num_layers=1, num_single_layers=1,
                                             num_refiner_layers=1, patch_size=1, patch_size_t=1,
                                             guidance_embeds=True, text_embed_dim=TEXT, pooled_projection_dim=8,
                                             rope_axes_dim=(2, 4, 4))
    mask = torch.ones(BATCH, TOKENS)
    mask[1, -2:] = 0
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=4), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "encoder_attention_mask": mask,
                   "pooled_projections": _randn(2, BATCH, 8, dtype=dtype),
                   "guidance": torch.tensor([1.0, 3.5], dtype=dtype)}


def _mochi(d, dtype):
    model = d.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                                      pooled_projection_dim=16, in_channels=4, qk_norm="rms_norm", text_embed_dim=TEXT,
                                      time_embed_dim=4, activation_fn="swiglu", max_sequence_length=TOKENS)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "encoder_attention_mask": torch.ones(BATCH, TOKENS, dtype=torch.bool)}


def _latte(d, dtype):
    model = d.LatteTransformer3DModel(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
                                      num_attention_heads=2, caption_channels=TEXT, in_channels=4,
                                      cross_attention_dim=16, out_channels=8, attention_bias=True,
                                      activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                                      norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                                      video_length=2)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "enable_temporal_attentions": True}


def _allegro(d, dtype):
    model = d.AllegroTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                        num_layers=1, cross_attention_dim=16, sample_width=8, sample_height=8,
                                        sample_frames=8, caption_channels=TEXT)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _wan_vace(d, dtype):
    model = d.WanVACETransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=4, out_channels=4, text_dim=TEXT, freq_dim=32, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32, vace_layers=[0], vace_in_channels=12)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "control_hidden_states": _video(2, 12, dtype, frames=2, side=8)}


def _cosmos(d, dtype):
    # no padding-mask channel (resized with torchvision, not installed beside) and no learnable positions (their
    # norm is taken in float32 only, which fails on float64 inputs)
    model = d.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
                                       num_layers=2, mlp_ratio=2, text_embed_dim=TEXT, adaln_lora_dim=4,
                                       max_size=(4, 16, 16), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
                                       concat_padding_mask=False, extra_pos_embed_type=None)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype), "attention_mask": torch.ones(BATCH, TOKENS),
                   "fps": 30}


def _easyanimate(d, dtype):
    model = d.EasyAnimateTransformer3DModel(attention_head_dim=16, num_attention_heads=2, in_channels=4,
                                            mmdit_layers=2, num_layers=2, out_channels=4, patch_size=2,
                                            sample_height=8, sample_width=8, text_embed_dim=TEXT, time_embed_dim=8,
                                            time_position_encoding_type="3d_rope", timestep_activation_fn="silu")
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _sana_video(d, dtype):
    model = d.SanaVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                          num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                          cross_attention_dim=16, caption_channels=TEXT, sample_size=8,
                                          patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    return model, {"hidden_states": _video(0, 4, dtype, frames=2, side=8), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


MODELS = {
    "transformer2d": _transformer2d, "prior": _prior, "sana": _sana, "aura_flow": _aura_flow, "lumina2": _lumina2,
    "hunyuan_dit": _hunyuan_dit, "cogview3plus": _cogview3plus, "cogview4": _cogview4, "qwenimage": _qwenimage,
    "chroma": _chroma, "flux2": _flux2, "z_image": _z_image, "hidream": _hidream, "cogvideox": _cogvideox,
    "wan": _wan, "wan_vace": _wan_vace, "skyreels_v2": _skyreels_v2, "ltx_video": _ltx_video,
    "hunyuan_video": _hunyuan_video, "mochi": _mochi, "latte": _latte, "allegro": _allegro, "cosmos": _cosmos,
    "easyanimate": _easyanimate, "sana_video": _sana_video,
}
