"""``ol.ops.lm_head_loss`` against each installed language model's own loss.

For every causal or masked LM class of the installed transformers (``hf_sweep.every_text_lm`` plus its text
list, built by ``hf_sweep.build`` from tiny configs), in eval mode without gradients: the model's own
``model(input_ids, attention_mask=..., labels=...).loss`` and ``lm_head_loss`` on the same batch (a few labels
ignored). Each class ends as ``same`` (to the dtype's rounding; which way ``lm_head_loss`` took, see
``ops.lm_head``), ``refused`` (its own check found no way to the model's loss: a ``ValueError``), ``declined``
(``lm_head_kind`` turns it down up front), ``differs`` (a loss other than the model's: a defect),
``model fails`` (the model's own forward raises at this size) or ``build fails``.

    python scripts/lm_head_sweep.py --dtype float32 --out build/lm_head_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import opsnn_lab as ol
from opsnn_lab.ops.lm_head import _VERIFIED as VERIFIED  # where lm_head_loss keeps the way it took
from opsnn_lab.ops.lm_head import describe

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as H  # noqa: E402 - the builders of the fusion sweep


def check(name: str, dtype: torch.dtype) -> tuple[str, str]:
    try:
        model, inputs = H.build(name, dtype)
    except Exception as e:  # the installed transformers cannot build it from the small config
        return "build fails", f"{type(e).__name__}: {str(e)[:120]}"
    model.eval()
    kind, why = ol.ops.lm_head_kind(model)
    if kind is None:
        return "declined", why
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        try:
            want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        except Exception as e:
            return "model fails", f"{type(e).__name__}: {str(e)[:120]}"
        try:
            got = ol.ops.lm_head_loss(model, ids, labels, attention_mask=mask)
        except ValueError as e:
            return "refused", str(e)[:200]
    err = float((got - want).abs() / want.abs())
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    verdict = model.__dict__.get(VERIFIED, {}).get((kind, model.get_output_embeddings().weight.dtype))
    way = describe(verdict) if isinstance(verdict, tuple) else verdict
    return ("same" if err <= tol else "differs"), f"{type(model).__name__} as {way}: relative {err:.1e}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--out", default="", help="write every class's verdict here as JSON")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    names = sorted(set(H.every_text_lm()) | set(H.TEXT))
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in tqdm(names, desc="language models"):
            results[name] = check(name, dtype)
    for name, (status, detail) in results.items():
        if status not in ("same", "declined"):
            print(f"{name:24s} {status:12s} {detail}")
    counts = {s: sum(v[0] == s for v in results.values()) for s in sorted({v[0] for v in results.values()})}
    print(f"{len(results)} classes: {counts}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "counts": counts, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
