"""Fuse Hugging Face diffusers' denoisers and autoencoders (built from small configs) and check them against eager.

diffusers is not a dependency of opsnn_lab: install it beside (``pip install diffusers``). The models: Stable
Diffusion's UNet2DModel, UNet2DConditionModel and AutoencoderKL, DiT, PixArt, SD3 and Flux (below), and from
``diffusers_models.py`` and ``diffusers_transformers.py``: image autoencoders (Tiny, DC-AE, VQ, asymmetric, SVD's
temporal decoder), video autoencoders (CogVideoX, Wan, Qwen-Image, LTX-Video, HunyuanVideo, Mochi, EasyAnimate's
MagVit, Cosmos: Conv3d, causal convs, GroupNorm or RMSNorm -> SiLU), audio models (Oobleck, UNet1D and its value
function, Stable Audio's DiT, LTX-2's audio autoencoder, ACE-Step), video UNets (UNet3D, Stable Video Diffusion's,
AnimateDiff's motion UNet), ControlNet, ControlNet-XS, the SD3 and Flux ControlNets, aMUSEd's UVit2D, and image and
video transformers (Transformer2DModel, the unCLIP prior, Sana, AuraFlow, Lumina2, HunyuanDiT, CogView3-Plus,
CogView4, Qwen-Image, Chroma, Flux.2, Z-Image, HiDream, CogVideoX, Wan, Wan-VACE, SkyReels-V2, LTX-Video,
HunyuanVideo, Mochi, Latte, Allegro, Cosmos, EasyAnimate, Sana-Video). Each is built from a config 1-2 layers deep
and 8-64 wide, with its own defaults otherwise (DiT keeps its class-label dropout, a ``torch.rand`` draw; LTX-
Video's decoder its noise injection: both sides draw the same, from one seed); then ``hf_sweep.py``'s checks: one
training step of the fused model and of the original (the outputs and every parameter gradient of a fixed random
projection of them), eval, ``inference_mode``, the fused model pickled. The same records and line as
``hf_sweep.py``.

    python scripts/diffusers_sweep.py                    # float64: errors are rounding (<= 1e-12)
    python scripts/diffusers_sweep.py --models dit,unet2d_condition --dtype float32 --autocast
    python scripts/diffusers_sweep.py --list
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import diffusers_models as DM  # noqa: E402 - the other models' builders
import diffusers_transformers as DT  # noqa: E402 - the image and video transformers' builders
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep
import timm_sweep as TS  # noqa: E402 - the command line, shared
from diffusers_models import BATCH, SIDE, TEXT, TOKENS, _randn, _steps  # noqa: E402 - shared with those builders


def _unet2d(d, dtype):
    model = d.UNet2DModel(sample_size=SIDE, in_channels=3, out_channels=3, layers_per_block=1,
                          block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                          up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype), "timestep": _steps()}


def _unet2d_condition(d, dtype):
    model = d.UNet2DConditionModel(sample_size=SIDE, in_channels=4, out_channels=4, layers_per_block=1,
                                   block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=TEXT,
                                   down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                   up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8)
    return model, {"sample": _randn(0, BATCH, 4, SIDE, SIDE, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _randn(1, BATCH, TOKENS, TEXT, dtype=dtype)}


def _autoencoder_kl(d, dtype):
    model = d.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
                            norm_num_groups=8, sample_size=SIDE)
    return model, {"sample": _randn(0, BATCH, 3, SIDE, SIDE, dtype=dtype)}


def _dit(d, dtype):
    model = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                    num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "class_labels": torch.tensor([1, 2])}


def _pixart(d, dtype):
    model = d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                       num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=TEXT,
                                       caption_channels=24)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _randn(1, BATCH, TOKENS, 24, dtype=dtype),
                   "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def _sd3(d, dtype):
    return d.SD3Transformer2DModel(num_layers=2, **DM.SD3), DM.sd3_inputs(dtype)


def _flux(d, dtype):
    model = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                     pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    return model, {"hidden_states": _randn(0, BATCH, 16, 16, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _randn(1, BATCH, TOKENS, TEXT, dtype=dtype),
                   "pooled_projections": _randn(2, BATCH, 16, dtype=dtype),
                   "img_ids": torch.zeros(16, 3, dtype=dtype), "txt_ids": torch.zeros(TOKENS, 3, dtype=dtype)}


MODELS = {"unet2d": _unet2d, "unet2d_condition": _unet2d_condition, "autoencoder_kl": _autoencoder_kl, "dit": _dit,
          "pixart": _pixart, "sd3": _sd3, "flux": _flux, **DM.MODELS, **DT.MODELS}


def build(name: str, dtype: torch.dtype):
    """The model (train mode, ``dtype``) and its keyword inputs."""
    import diffusers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers warns that a .to(dtype) skips its fp32-kept modules: none here
        model, inputs = MODELS[name](diffusers, dtype)
        return model.to(dtype).train(), inputs


def _running(name: str, dtype: torch.dtype, r: dict, build=build):
    """``build`` and one eager forward (stages "build", "eager"), for ``hf_sweep.check``."""
    r["stage"] = "build"
    model, inputs = build(name, dtype)
    r["stage"] = "eager"
    S._run(model, inputs)
    return model, inputs


def check(name: str, dtype: torch.dtype, r: dict, autocast: bool = False, build=build,
          checkpointing: bool = False) -> None:
    """``hf_sweep.check`` on ``build``'s model (its eval step asks for hidden states where a model takes them)."""
    S.check(name, dtype, r, autocast, running=lambda n, d, rec: _running(n, d, rec, build),
            checkpointing=checkpointing)


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, lambda: list(MODELS), build=build, check=check)


if __name__ == "__main__":
    main()
