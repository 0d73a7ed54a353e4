"""Fuse one model of every timm family (the smallest each module registers) and check it against eager.

timm is not a dependency of opsnn_lab: install it beside (``pip install timm``; it needs torchvision built for
your torch). For each model: built without weights, 10 classes, no dropout or drop path (an ``nn.Dropout`` a model
keeps whatever it is given, Swin-v2-cr's meta MLP, is set to p = 0 after the build); one training step of the
fused model and of the original (the logits and every parameter gradient of a fixed random projection of them),
then eval and ``inference_mode``, and the fused model pickled. The same records and line as ``hf_sweep.py``; a
model that fails without opsnn_lab ("build", "eager") is reported as such.

    python scripts/timm_sweep.py                        # float64: errors are rounding (<= 1e-10)
    python scripts/timm_sweep.py --models resnet18,vit_tiny_patch16_224 --dtype float32
    python scripts/timm_sweep.py --dtype float32 --autocast   # + a bf16 autocast step, fused and eager vs fp32
    python scripts/timm_sweep.py --list                 # the models the default run takes (built on meta)
"""

from __future__ import annotations

import collections
import sys
import warnings
from pathlib import Path

import torch

import opsnn_lab as ol
from opsnn_lab.testing import projected_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep

MAX_PARAMETERS = 100_000_000  # the smallest of a family above this is left out (three in timm 1.0.31)
SIDE = 64  # image side where the model takes it (img_size=), else its own input size


def _size(name: str) -> int:
    import timm

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return sum(p.numel() for p in timm.create_model(name, pretrained=False, num_classes=10).parameters())


def smallest_per_family() -> list[str]:
    """The model with the fewest parameters of each timm module (family), built on the meta device to count."""
    import timm
    from timm.models import _registry

    families = collections.defaultdict(list)
    for name in timm.list_models():
        families[_registry._model_to_module[name]].append(name)
    picked = []
    for names in families.values():
        sizes = {}
        for n in names:
            try:
                sizes[n] = _size(n)
            except Exception:  # noqa: BLE001 - a variant that needs arguments the sweep does not give
                continue
        if sizes and min(sizes.values()) <= MAX_PARAMETERS:
            picked.append(min(sizes, key=sizes.get))
    return sorted(picked)


def build(name: str, dtype: torch.dtype, small: bool = True):
    """The model (train mode, ``dtype``) and its input: 2 images of ``SIDE`` where ``img_size`` is taken and
    ``small``, else of the model's own input size."""
    import timm

    torch.manual_seed(0)
    model = _create(timm, name, img_size=SIDE) if small else None
    side = SIDE
    if model is None:  # no img_size: its own input size (a CNN at 64 px can fall below its last stride)
        model = _create(timm, name)
        side = min(model.pretrained_cfg.get("input_size", (3, 224, 224))[1:])
    chans = model.pretrained_cfg.get("input_size", (3,))[0]
    x = torch.randn(2, chans, side, side, generator=torch.Generator().manual_seed(0), dtype=dtype)
    return model.to(dtype).train(), x


def _create(timm, name: str, **size):
    """``timm.create_model`` without weights, dropout and drop path, leaving out the arguments the model does not
    take (older families have no ``drop_path_rate``); None where it does not take ``size``."""
    kwargs = dict(pretrained=False, num_classes=10, drop_rate=0.0, drop_path_rate=0.0, **size)
    while True:
        try:
            return timm.create_model(name, **kwargs)
        except TypeError as exc:
            unknown = [k for k in kwargs if f"'{k}'" in str(exc) and k not in ("pretrained", "num_classes")]
            if size and (not unknown or any(k in size for k in unknown)):
                return None  # the size is not taken (or took the model's construction elsewhere): its own size
            if not unknown:
                raise
            for k in unknown:
                del kwargs[k]


def _without_dropout(model, x):
    """``model`` with every ``nn.Dropout`` at p = 0: both sides then compute the same thing in training (the fused
    ops draw counter masks, eager draws torch's). Drop path stays off through the builder's ``drop_path_rate``."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, x


def _outs(model, x):
    torch.manual_seed(123)
    return [t for t in ol.fusion.runtime.flatten_tensors(model(x)) if t.is_floating_point()]


def _train_step(model, x):
    outs = [o.float() for o in _outs(model, x)]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(projected_loss(outs), params, allow_unused=True)
    return outs, [g if g is not None else torch.zeros(0) for g in grads]


def check(name: str, dtype: torch.dtype, r: dict, autocast: bool = False, build=build,
          checkpointing: bool = False) -> None:
    """The checks of the module docstring on ``build(name, dtype, small)``'s model and input (torchvision_sweep.py
    hands its own); ``checkpointing``: as ``hf_sweep.check``'s."""
    with S.unfused_at_run(r):
        r["stage"] = "build"
        model, x = _without_dropout(*build(name, dtype))
        r["stage"] = "eager"
        try:
            _outs(model, x)
        except Exception:  # noqa: BLE001 - too small for it (takes img_size, yet fixes a grid): its own size
            r["stage"] = "build"
            model, x = _without_dropout(*build(name, dtype, small=False))
            r["stage"] = "eager"
            _outs(model, x)
        if checkpointing:
            r["stage"] = "checkpointing"
            S.enable_checkpointing(model)
        fused = S.fuse_recorded(model, (x,), r)
        S.step_bytes(lambda m: sum(o.sum() for o in _outs(m, x)), model, fused, r)
        r["stage"] = "train"
        (outs_a, g_a), (outs_b, g_b) = (_train_step(m, x) for m in (model, fused))
        r["out_err"], r["grad_err"] = S._rel(outs_b, outs_a), S._rel(g_b, g_a, S.largest_finite(g_a))
        r["stage"] = "eval"
        model.eval()
        fused.eval()
        with torch.no_grad():
            r["eval_err"] = S._rel(_outs(fused, x), _outs(model, x))
        with torch.inference_mode():
            r["inference_err"] = S._rel(_outs(fused, x), _outs(model, x))
        if autocast:
            S.autocast_errors(lambda m: _train_step(m, x), model, fused, (outs_a, g_a), r,
                              [lambda m, i=i: _train_step(m, i) for i in S.other_inputs(x)])
    del r["stage"]


def sweep_main(argv, doc: str, default_names, build=build, check=check, running=None) -> None:
    """The command line of this sweep and of the others: ``default_names()`` when no ``--models``; ``check(name,
    dtype, record, autocast, build=build)`` per model, or with ``running`` (a sweep of Hugging Face models that builds
    and runs each itself: audio, dense vision, multimodal) ``hf_sweep.check(..., running=running)``."""
    ap = S.argument_parser(doc)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--list", action="store_true", help="print the default models and stop")
    ap.add_argument("--autocast", action="store_true", help="also a training step under bf16 autocast, eager and "
                    "fused, each against the float32 eager step")
    S.add_checkpointing_flag(ap)
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else default_names()
    if args.list:
        print("\n".join(names))
        return
    if args.autocast and args.dtype != "float32":
        ap.error("--autocast compares with the float32 step: use it with --dtype float32")
    dtype = getattr(torch, args.dtype)
    on = args.checkpointing
    if running is not None:
        S.run_sweep(names, lambda name, r: S.check(name, dtype, r, args.autocast, running=running, checkpointing=on),
                    S._line, args.out)
    else:
        S.run_sweep(names, lambda name, r: check(name, dtype, r, args.autocast, build=build, checkpointing=on),
                    S._line, args.out)


def main(argv=None) -> None:
    sweep_main(argv, __doc__, smallest_per_family)


if __name__ == "__main__":
    main()
