"""Fuse Hugging Face diffusers' denoisers and autoencoders (built from small configs) and check them against eager.

diffusers is not a dependency of opsnn_lab: install it beside (``pip install diffusers``). Each model is built
from a config a few layers deep and 32-64 wide, with its own defaults otherwise (DiT keeps its class-label
dropout, a ``torch.rand`` draw; both sides draw the same, from one seed); then ``hf_sweep.py``'s checks: one
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
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep
import timm_sweep as TS  # noqa: E402 - the command line, shared

BATCH, SIDE, TOKENS, TEXT = 2, 16, 5, 32  # images of SIDE px (latents of 4 channels), 5 text tokens 32 wide


def _randn(seed: int, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _steps(dtype=None):
    return torch.tensor([3, 7]) if dtype is None else torch.tensor([0.3, 0.7], dtype=dtype)


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
    model = d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=TEXT, caption_projection_dim=TEXT,
                                    pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    return model, {"hidden_states": _randn(0, BATCH, 4, 8, 8, dtype=dtype), "timestep": _steps(),
                   "encoder_hidden_states": _randn(1, BATCH, TOKENS, TEXT, dtype=dtype),
                   "pooled_projections": _randn(2, BATCH, 16, dtype=dtype)}


def _flux(d, dtype):
    model = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT,
                                     pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    return model, {"hidden_states": _randn(0, BATCH, 16, 16, dtype=dtype), "timestep": _steps(dtype),
                   "encoder_hidden_states": _randn(1, BATCH, TOKENS, TEXT, dtype=dtype),
                   "pooled_projections": _randn(2, BATCH, 16, dtype=dtype),
                   "img_ids": torch.zeros(16, 3, dtype=dtype), "txt_ids": torch.zeros(TOKENS, 3, dtype=dtype)}


MODELS = {"unet2d": _unet2d, "unet2d_condition": _unet2d_condition, "autoencoder_kl": _autoencoder_kl, "dit": _dit,
          "pixart": _pixart, "sd3": _sd3, "flux": _flux}


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


def check(name: str, dtype: torch.dtype, r: dict, autocast: bool = False, build=build) -> None:
    """``hf_sweep.check`` on ``build``'s model (its eval step asks for hidden states where a model takes them)."""
    S.check(name, dtype, r, autocast, running=lambda n, d, rec: _running(n, d, rec, build))


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, lambda: list(MODELS), build=build, check=check)


if __name__ == "__main__":
    main()
