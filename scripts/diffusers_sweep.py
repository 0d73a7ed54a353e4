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


def check(name: str, dtype: torch.dtype, r: dict, autocast: bool = False, build=build) -> None:
    """Fill ``r``; ``r["stage"]`` is where an exception left it ("build"/"eager": the model itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r["stage"] = "build"
        model, inputs = build(name, dtype)
        r["stage"] = "eager"
        S._run(model, inputs)
        fused = S.fuse_recorded(model, inputs, r)
        r["stage"] = "train"
        (outs_a, g_a), (outs_b, g_b) = (S._train_step(m, inputs) for m in (model, fused))
        r["out_err"], r["grad_err"] = S._rel(outs_b, outs_a), S._rel(g_b, g_a, S.largest_finite(g_a))
        r["stage"] = "eval"
        model.eval()
        fused.eval()
        with torch.no_grad():
            r["eval_err"] = S._rel(S._run(fused, inputs), S._run(model, inputs))
        with torch.inference_mode():
            r["inference_err"] = S._rel(S._run(fused, inputs), S._run(model, inputs))
        if autocast:
            S.autocast_errors(lambda m: S._train_step(m, inputs), model, fused, (outs_a, g_a), r)
    del r["stage"]


def main(argv=None) -> None:
    ap = S.argument_parser(__doc__)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--list", action="store_true", help="print the models and stop")
    ap.add_argument("--autocast", action="store_true", help="also a training step under bf16 autocast, eager and "
                    "fused, each against the float32 eager step")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else list(MODELS)
    if args.list:
        print("\n".join(names))
        return
    if args.autocast and args.dtype != "float32":
        ap.error("--autocast compares with the float32 step: use it with --dtype float32")
    dtype = getattr(torch, args.dtype)
    S.run_sweep(names, lambda name, r: check(name, dtype, r, args.autocast), S._line, args.out)


if __name__ == "__main__":
    main()
