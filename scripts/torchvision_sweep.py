"""Fuse every torchvision image and video classification model (up to 100M parameters) and check it against eager.

torchvision is not a dependency of opsnn_lab: install the build made for your torch beside it. The checks are
``timm_sweep.py``'s: built without weights, 10 classes, every dropout and stochastic depth at 0 where the
constructor takes one; 2 images of 64 px, or of the model's own crop size (its weights' transform: 224, Inception
299) for a model that fails at 64 (ViT's fixed grid, MaxViT's windows, Inception's auxiliary head); a video model
takes 2 clips of 8 frames at 64 px, or of 16 frames at its crop size (S3D's pooling, MViT's fixed grid); one training
step of the fused model and of the original (the logits and every parameter gradient of a fixed random projection
of them), eval, ``inference_mode``, the fused model pickled.

    python scripts/torchvision_sweep.py                   # float64: errors are rounding (<= 1e-10)
    python scripts/torchvision_sweep.py --models resnet18,mobilenet_v3_small --dtype float32 --autocast
    python scripts/torchvision_sweep.py --list            # the models the default run takes (built on meta)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timm_sweep as TS  # noqa: E402 - the checks and the command line, shared

MAX_PARAMETERS = 100_000_000  # larger ones (ViT-L/H, RegNet-Y 16-128GF, VGG) are left out
SIDE = 64
FRAMES = 8  # a video clip's frames; 16 at the model's own size (MViT's fixed temporal grid)
# what torchvision constructors call their random steps; each model takes some of them
_NO_RANDOM = {"dropout": 0.0, "attention_dropout": 0.0, "stochastic_depth_prob": 0.0, "drop_rate": 0.0,
              "dropout_aux": 0.0}


def _create(name: str):
    """``torchvision.models.get_model`` without weights, with every random step the constructor takes at 0."""
    import torchvision

    kwargs = dict(weights=None, num_classes=10, **_NO_RANDOM)
    while True:
        try:
            return torchvision.models.get_model(name, **kwargs)
        except (TypeError, KeyError) as exc:  # a builder that also sets one names it twice: a KeyError at times
            unknown = [k for k in _NO_RANDOM if k in kwargs and f"'{k}'" in str(exc)]
            if not unknown:
                raise
            for k in unknown:
                del kwargs[k]


def video_models() -> list[str]:
    """torchvision's video classification models (they take clips: batch, channels, frames, height, width)."""
    import torchvision

    video = getattr(torchvision.models, "video", None)
    return torchvision.models.list_models(module=video) if video is not None else []


def classification_models() -> list[str]:
    """torchvision's image, then video, classification models of at most ``MAX_PARAMETERS``, counted on the meta
    device."""
    import torchvision

    names = []
    listed = [*torchvision.models.list_models(module=torchvision.models), *video_models()]
    for name in dict.fromkeys(listed):
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            try:
                size = sum(p.numel() for p in _create(name).parameters())
            except Exception:  # noqa: BLE001 - a constructor that cannot run on meta (initialises from data)
                continue
        if size <= MAX_PARAMETERS:
            names.append(name)
    return names


def own_side(name: str) -> int:
    """The crop size of the model's weights' transform (no download), 224 where it names none."""
    import torchvision

    try:
        return int(torchvision.models.get_model_weights(name).DEFAULT.transforms().crop_size[0])
    except Exception:  # noqa: BLE001 - a model without registered weights or transform
        return 224


def build(name: str, dtype: torch.dtype, small: bool = True):
    """The model (train mode, ``dtype``) and 2 images of ``SIDE`` px (of :func:`own_side` unless ``small``), or 2
    clips of ``FRAMES`` such images (16 frames unless ``small``)."""
    torch.manual_seed(0)
    model = _create(name)
    side = SIDE if small else own_side(name)
    clip = (FRAMES if small else 16,) if name in video_models() else ()
    x = torch.randn(2, 3, *clip, side, side, generator=torch.Generator().manual_seed(0), dtype=dtype)
    return model.to(dtype).train(), x


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, classification_models, build=build)


if __name__ == "__main__":
    main()
