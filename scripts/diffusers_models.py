"""The models of ``diffusers_sweep.py``: one small builder per diffusers class, ``builder(diffusers, dtype) ->
(model, keyword inputs)``, each from a config 1-2 layers deep and 8-64 wide with inputs of 2 samples, a few frames
and 8-16 px (the sizes diffusers' own tests build them at). Grouped: image autoencoders, video autoencoders (Conv3d,
causal convs, GroupNorm or RMSNorm -> SiLU), audio (1-d) models, UNets and ControlNet, image transformers, video
transformers (those two in ``diffusers_transformers.py``). ``MODELS`` maps each sweep name to its builder.
"""

from __future__ import annotations

import torch

BATCH, SIDE, TOKENS, TEXT = 2, 16, 5, 32  # images of SIDE px (latents of 4 channels), 5 text tokens 32 wide
FRAMES = 5  # video frames: 1 + 4k, as the causal video autoencoders take them


def _randn(seed: int, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _steps(dtype=None):
    return torch.tensor([3, 7]) if dtype is None else torch.tensor([0.3, 0.7], dtype=dtype)


def _video(seed: int, channels: int, dtype, frames: int = FRAMES, side: int = SIDE):
    return _randn(seed, BATCH, channels, frames, side, side, dtype=dtype)


def _text(seed: int, width: int, dtype, tokens: int = TOKENS):
    return _randn(seed, BATCH, tokens, width, dtype=dtype)


# image autoencoders


class EncodeDecode(torch.nn.Module):
    """An autoencoder's encoder then decoder, for AutoencoderTiny in float64: its own forward rounds the latents to
    bytes between the two and divides them back into float32, which its float64 decoder does not take."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return self.vae.decode(self.vae.encode(sample).latents).sample


def _autoencoder_tiny(d, dtype):
    model = d.AutoencoderTiny(in_channels=3, out_channels=3, encoder_block_out_channels=(32, 32),
                              decoder_block_out_channels=(32, 32), num_encoder_blocks=(1, 1),
                              num_decoder_blocks=(1, 1), latent_channels=4)
    model = EncodeDecode(model) if dtype == torch.float64 else model
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype)}


def _autoencoder_dc(d, dtype):
    model = d.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=8,
                            encoder_block_types=("ResBlock", "EfficientViTBlock"),
                            decoder_block_types=("ResBlock", "EfficientViTBlock"),
                            encoder_block_out_channels=(16, 32), decoder_block_out_channels=(16, 32),
                            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
                            encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                            downsample_block_type="conv", upsample_block_type="interpolate",
                            decoder_norm_types="rms_norm", decoder_act_fns="silu")
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype)}


def _vq(d, dtype):
    model = d.VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                      norm_num_groups=8, num_vq_embeddings=32, sample_size=SIDE)
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype)}


def _asymmetric_autoencoder_kl(d, dtype):
    model = d.AsymmetricAutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                      down_block_out_channels=(16, 32), up_block_types=("UpDecoderBlock2D",) * 2,
                                      up_block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8,
                                      sample_size=SIDE)
    mask = torch.ones(BATCH, 1, SIDE, SIDE, dtype=dtype)
    mask[:, :, SIDE // 2:] = 0  # the lower half to inpaint
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype), "mask": mask}


def _autoencoder_kl_temporal_decoder(d, dtype):
    model = d.AutoencoderKLTemporalDecoder(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                                           down_block_types=("DownEncoderBlock2D",) * 2, latent_channels=4,
                                           layers_per_block=1, sample_size=SIDE)
    frames = 2  # the batch is BATCH videos of 2 frames each, frames stacked on the batch
    return model, {"sample": _randn(0, BATCH * frames, 3, SIDE, SIDE, dtype=dtype), "num_frames": frames}


# video autoencoders


def _autoencoder_kl_cogvideox(d, dtype):
    model = d.AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 3,
                                     up_block_types=("CogVideoXUpBlock3D",) * 3, block_out_channels=(16, 16, 32),
                                     latent_channels=4, layers_per_block=1, norm_num_groups=4,
                                     temporal_compression_ratio=4)
    return model, {"sample": _video(0, 3, dtype)}


def _autoencoder_kl_wan(d, dtype):
    model = d.AutoencoderKLWan(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                               latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return model, {"sample": _video(0, 3, dtype)}


def _autoencoder_kl_qwenimage(d, dtype):
    model = d.AutoencoderKLQwenImage(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                     temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return model, {"sample": _video(0, 3, dtype)}


def _autoencoder_kl_ltx_video(d, dtype):
    # LTX-Video 0.9.1's: the decoder conditioned on the timestep, noise injected, residual upsamplers
    model = d.AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(16,) * 4,
                                    decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1),
                                    decoder_layers_per_block=(1, 1, 1, 1),
                                    spatio_temporal_scaling=(True, True, True, False),
                                    decoder_spatio_temporal_scaling=(True, True, True),
                                    decoder_inject_noise=(True, True, True, False), upsample_residual=(True,) * 3,
                                    upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=1,
                                    patch_size_t=1)
    return model, {"sample": _video(0, 3, dtype, frames=9), "temb": torch.tensor([0.05, 0.1], dtype=dtype)}


def _autoencoder_kl_hunyuan_video(d, dtype):
    model = d.AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                                        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(16, 16, 32),
                                        layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=4,
                                        temporal_compression_ratio=4)
    return model, {"sample": _video(0, 3, dtype)}


def _autoencoder_kl_mochi(d, dtype):
    model = d.AutoencoderKLMochi(in_channels=15, out_channels=3, latent_channels=4,
                                 encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
                                 layers_per_block=(1, 1, 1, 1, 1))  # its GroupNorms have 32 groups
    return model, {"sample": _video(0, 3, dtype, frames=7)}


def _autoencoder_kl_magvit(d, dtype):
    # EasyAnimate's: spatial then spatio-temporal blocks, GroupNorm over each frame (spatial_group_norm)
    model = d.AutoencoderKLMagvit(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16,) * 4,
                                  down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
                                  up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
                                  layers_per_block=1, norm_num_groups=8, spatial_group_norm=True)
    return model, {"sample": _video(0, 3, dtype, frames=9)}


def _autoencoder_kl_cosmos(d, dtype):
    # Cosmos' tokenizer: Haar wavelet patching, causal convs, factorised spatial / temporal attention
    model = d.AutoencoderKLCosmos(in_channels=3, out_channels=3, latent_channels=4,
                                  encoder_block_out_channels=(16,) * 4, decode_block_out_channels=(16,) * 4,
                                  attention_resolutions=(8,), resolution=64, num_layers=1, patch_size=4,
                                  patch_type="haar", spatial_compression_ratio=4, temporal_compression_ratio=4)
    return model, {"sample": _video(0, 3, dtype)}


# audio (1-d) models


def _autoencoder_oobleck(d, dtype):
    model = d.AutoencoderOobleck(encoder_hidden_size=16, decoder_channels=16, decoder_input_channels=8,
                                 audio_channels=2, downsampling_ratios=[2, 4], channel_multiples=[1, 2])
    return model, {"sample": _randn(0, BATCH, 2, 64, dtype=dtype)}


def _unet1d(d, dtype):
    model = d.UNet1DModel(in_channels=14, out_channels=14, block_out_channels=(16, 16, 32, 32),
                          time_embedding_type="positional", use_timestep_embedding=True, flip_sin_to_cos=False,
                          freq_shift=1.0, out_block_type="OutConv1DBlock", mid_block_type="MidResTemporalBlock1D",
                          down_block_types=("DownResnetBlock1D",) * 4, up_block_types=("UpResnetBlock1D",) * 3,
                          act_fn="swish")
    return model, {"sample": _randn(0, BATCH, 14, 16, dtype=dtype), "timestep": _steps()}


def _unet1d_value(d, dtype):
    # Diffuser's value function (planning in reinforcement learning): a 1-d encoder and an MLP head, Mish
    model = d.UNet1DModel(in_channels=14, out_channels=14, down_block_types=("DownResnetBlock1D",) * 4,
                          up_block_types=(), out_block_type="ValueFunction", mid_block_type="ValueFunctionMidBlock1D",
                          block_out_channels=(16, 32, 32, 64), layers_per_block=1, downsample_each_block=True,
                          use_timestep_embedding=True, freq_shift=1.0, flip_sin_to_cos=False,
                          time_embedding_type="positional", act_fn="mish")
    return model, {"sample": _randn(0, BATCH, 14, 16, dtype=dtype), "timestep": _steps()}


def _stable_audio_dit(d, dtype):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    model = d.StableAudioDiTModel(sample_size=16, in_channels=4, num_layers=2, attention_head_dim=16,
                                  num_attention_heads=2, num_key_value_attention_heads=1, out_channels=4,
                                  cross_attention_dim=16, time_proj_dim=16, global_states_input_dim=16,
                                  cross_attention_input_dim=TEXT)
    length = 16  # audio latents; the global (duration) state is prepended as one more position
    rope = get_1d_rotary_pos_embed(8, length + 1, use_real=True, repeat_interleave_real=False)
    return model, {"hidden_states": _randn(0, BATCH, 4, length, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "global_hidden_states": _randn(2, BATCH, 1, 16, dtype=dtype),
                   "rotary_embedding": tuple(t.to(dtype) for t in rope)}


def _autoencoder_kl_ltx2_audio(d, dtype):
    # LTX-2's audio autoencoder: mel spectrograms (channels, frames, mel bins), causal along time, PixelNorm
    model = d.AutoencoderKLLTX2Audio(in_channels=2, output_channels=2, latent_channels=4, base_channels=16,
                                     ch_mult=(1, 2), resolution=16, num_res_blocks=1, norm_type="pixel",
                                     causality_axis="height", mel_bins=16, is_causal=True, double_z=True)
    return model, {"sample": _randn(0, BATCH, 2, 8, 16, dtype=dtype)}


def _ace_step(d, dtype):
    # ACE-Step 1.5's music DiT: 1-d patches, Qwen-style GQA attention with RMSNorm and SwiGLU
    model = d.AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, in_channels=24,
                                       audio_acoustic_hidden_dim=8, patch_size=2, sliding_window=16)
    return model, {"hidden_states": _randn(0, BATCH, 8, 8, dtype=dtype), "timestep": _steps(dtype),
                   "timestep_r": _steps(dtype), "encoder_hidden_states": _text(1, 32, dtype),
                   "context_latents": _randn(2, BATCH, 8, 16, dtype=dtype)}


# UNets and ControlNet


def _unet3d_condition(d, dtype):
    model = d.UNet3DConditionModel(sample_size=SIDE, in_channels=4, out_channels=4, layers_per_block=1,
                                   block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=TEXT,
                                   down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                                   up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), attention_head_dim=8)
    return model, {"sample": _video(0, 4, dtype, frames=2), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype)}


def _unet_spatiotemporal(d, dtype):
    model = d.UNetSpatioTemporalConditionModel(sample_size=SIDE, in_channels=4, out_channels=4, layers_per_block=1,
                                               block_out_channels=(32, 64), cross_attention_dim=TEXT,
                                               down_block_types=("CrossAttnDownBlockSpatioTemporal",
                                                                 "DownBlockSpatioTemporal"),
                                               up_block_types=("UpBlockSpatioTemporal",
                                                               "CrossAttnUpBlockSpatioTemporal"),
                                               num_attention_heads=(2, 4), addition_time_embed_dim=8,
                                               projection_class_embeddings_input_dim=24, num_frames=2)
    # Stable Video Diffusion's layout: (batch, frames, channels, height, width); fps, motion id, noise augmentation
    return model, {"sample": _randn(0, BATCH, 2, 4, SIDE, SIDE, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype, tokens=1),
                   "added_time_ids": torch.tensor([[6, 127, 0.02]] * BATCH, dtype=dtype)}


def _unet_motion(d, dtype):
    model = d.UNetMotionModel(sample_size=SIDE, in_channels=4, out_channels=4, layers_per_block=1,
                              block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=TEXT,
                              down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
                              up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), num_attention_heads=2)
    frames = 2  # AnimateDiff: the text is given per frame
    return model, {"sample": _video(0, 4, dtype, frames=frames), "timestep": _steps(),
                   "encoder_hidden_states": _randn(1, BATCH * frames, TOKENS, TEXT, dtype=dtype)}


def _controlnet(d, dtype):
    model = d.ControlNetModel(in_channels=4, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                              down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=TEXT,
                              attention_head_dim=8, conditioning_embedding_out_channels=(16, 32))
    return model, {"sample": _randn(0, BATCH, 4, SIDE, SIDE, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "controlnet_cond": _randn(2, BATCH, 3, 2 * SIDE, 2 * SIDE, dtype=dtype)}


def _controlnet_xs(d, dtype):
    # ControlNet-XS: a small control net interleaved with the UNet, block by block
    model = d.UNetControlNetXSModel(sample_size=SIDE, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(16, 32),
                                    cross_attention_dim=TEXT, num_attention_heads=2, norm_num_groups=8,
                                    upcast_attention=False, ctrl_block_out_channels=(8, 16), ctrl_num_attention_heads=2,
                                    ctrl_max_norm_num_groups=4, ctrl_conditioning_embedding_out_channels=(8, 8))
    return model, {"sample": _randn(0, BATCH, 4, SIDE, SIDE, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "controlnet_cond": _randn(2, BATCH, 3, 2 * SIDE, 2 * SIDE, dtype=dtype)}


# SD3's MMDiT as diffusers_sweep.py builds it (two layers there), and its inputs: shared with its ControlNet
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, attention_head_dim=16, num_attention_heads=2,
           joint_attention_dim=TEXT, caption_projection_dim=TEXT, pooled_projection_dim=16, out_channels=4,
           pos_embed_max_size=16)


def sd3_inputs(dtype) -> dict:
    return {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
            "encoder_hidden_states": _text(1, TEXT, dtype), "pooled_projections": _randn(2, BATCH, 16, dtype=dtype)}


def _sd3_controlnet(d, dtype):
    model = d.SD3ControlNetModel(num_layers=1, **SD3)
    return model, {**sd3_inputs(dtype), "controlnet_cond": _randn(3, BATCH, 4, 8, 8, dtype=dtype)}


def _flux_controlnet(d, dtype):
    model = d.FluxControlNetModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    return model, {"hidden_states": _randn(0, BATCH, 16, 16, dtype=dtype), "timestep": _steps(dtype),
                   "controlnet_cond": _randn(3, BATCH, 16, 16, dtype=dtype),
                   "encoder_hidden_states": _text(1, TEXT, dtype),
                   "pooled_projections": _randn(2, BATCH, 16, dtype=dtype),
                   "img_ids": torch.zeros(16, 3, dtype=dtype), "txt_ids": torch.zeros(TOKENS, 3, dtype=dtype)}


def _uvit2d(d, dtype):
    # aMUSEd's masked-token transformer: token ids in, codebook logits out
    model = d.UVit2DModel(hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
                          encoder_hidden_size=TEXT, vocab_size=32, codebook_size=16, in_channels=16,
                          block_out_channels=32, num_res_blocks=1, downsample=True, upsample=True, block_num_heads=2,
                          num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, sample_size=8)
    ids = torch.randint(0, 32, (BATCH, 8, 8), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "encoder_hidden_states": _text(1, TEXT, dtype),
                   "pooled_text_emb": _randn(2, BATCH, 16, dtype=dtype),
                   "micro_conds": torch.tensor([[256, 256, 0, 0, 6]] * BATCH, dtype=dtype)}


MODELS = {
    "autoencoder_tiny": _autoencoder_tiny, "autoencoder_dc": _autoencoder_dc, "vq": _vq,
    "asymmetric_autoencoder_kl": _asymmetric_autoencoder_kl,
    "autoencoder_kl_temporal_decoder": _autoencoder_kl_temporal_decoder,
    "autoencoder_kl_cogvideox": _autoencoder_kl_cogvideox, "autoencoder_kl_wan": _autoencoder_kl_wan,
    "autoencoder_kl_qwenimage": _autoencoder_kl_qwenimage, "autoencoder_kl_ltx_video": _autoencoder_kl_ltx_video,
    "autoencoder_kl_hunyuan_video": _autoencoder_kl_hunyuan_video, "autoencoder_kl_mochi": _autoencoder_kl_mochi,
    "autoencoder_kl_magvit": _autoencoder_kl_magvit, "autoencoder_kl_cosmos": _autoencoder_kl_cosmos,
    "autoencoder_oobleck": _autoencoder_oobleck, "unet1d": _unet1d, "unet1d_value": _unet1d_value,
    "stable_audio_dit": _stable_audio_dit, "autoencoder_kl_ltx2_audio": _autoencoder_kl_ltx2_audio,
    "ace_step": _ace_step, "unet3d_condition": _unet3d_condition, "unet_spatiotemporal": _unet_spatiotemporal,
    "unet_motion": _unet_motion, "controlnet": _controlnet, "controlnet_xs": _controlnet_xs,
    "sd3_controlnet": _sd3_controlnet, "flux_controlnet": _flux_controlnet, "uvit2d": _uvit2d,
}
