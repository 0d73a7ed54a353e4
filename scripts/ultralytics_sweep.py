"""Fuse every Ultralytics model configuration (YOLOv3 to YOLO26, RT-DETR) at its first scale; check it against eager.

Ultralytics is not a dependency of opsnn_lab: install it beside (``pip install ultralytics``; it needs torchvision
built for your torch). Each ``.yaml`` under its ``cfg/models`` is built without weights at the first scale it lists
(``yolov8.yaml`` -> ``yolov8n.yaml``; RT-DETR's, YOLOv9-C's and YOLOv3's have none and are built as they are), in
training mode with every parameter taking gradients; the input is 2 images of 64 px (128 for a model whose largest
stride is 64, the P6 heads). The checks are ``timm_sweep.py``'s: one training step of the fused model and of the
original (every output of the training forward: boxes, scores, masks, keypoints, and every parameter gradient of a
fixed random projection of them), eval, ``inference_mode``, the fused model pickled, the plan's bytes against the
step's. A configuration that fails without opsnn_lab ("build", "eager": one fetching weights) is reported as such.

    python scripts/ultralytics_sweep.py                        # float64: errors are rounding
    python scripts/ultralytics_sweep.py --models yolo11n.yaml,rtdetr-l.yaml --dtype float32 --autocast
    python scripts/ultralytics_sweep.py --list                 # the configurations the default run takes
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timm_sweep as TS  # noqa: E402 - the checks and the command line, shared

SIDE = 64


def configurations() -> list[str]:
    """Every model configuration the installed Ultralytics ships, named at its first scale."""
    import ultralytics
    import yaml

    names = []
    for path in sorted((Path(ultralytics.__file__).parent / "cfg" / "models").rglob("*.yaml")):
        scales = (yaml.safe_load(path.read_text()) or {}).get("scales") or {}
        scale = next(iter(scales), "")
        if not scale or re.match(r"^yolo(?:e-)?v?\d+[a-z]", path.stem):  # none, or the file is one scale (yolov10n)
            names.append(path.name)
        else:  # the scale goes after the family's version, as Ultralytics reads it back: yolov8-seg -> yolov8n-seg
            names.append(re.sub(r"^(yolo(?:e-)?v?\d+)", rf"\g<1>{scale}", path.stem, count=1) + path.suffix)
    return names


def build(name: str, dtype: torch.dtype, small: bool = True):
    """The model of configuration ``name`` (train mode, ``dtype``, every parameter taking gradients) and its input."""
    from ultralytics import RTDETR, YOLO

    logging.getLogger("ultralytics").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = (RTDETR if name.startswith("rtdetr") or "-rtdetr" in name else YOLO)(name).model
    for p in model.parameters():
        p.requires_grad_(True)
    stride = int(torch.as_tensor(getattr(model, "stride", 32)).max())
    side = max(SIDE, 2 * stride)
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0), dtype=dtype)
    return model.to(dtype).train(), x


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, configurations, build=build)


if __name__ == "__main__":
    main()
