"""Reproducible dropout and the consistency checker on many Hugging Face architectures, fused and not.

Per model (built as ``hf_sweep.py`` builds it with every dropout and drop-path probability of its config 0.1, the
inline ``F.dropout`` calls and stochastic depths included, then every ``nn.Dropout`` at p = 0.1, as some hardcode
theirs): ``make_reproducible``;
two identical training steps under one ``ConsistencyChecker``, each from the same buffers (the second must agree
with the first op by op, or the report names where not); then the fused model against
the unfused one under the same seed (outputs and every parameter gradient, relative), and the fused model
against itself (bit for bit). Prints a line per model; ``--out`` writes the details as JSON.

    python scripts/hf_consistency_sweep.py --models Bert,GPT2,Pvt
    python scripts/hf_consistency_sweep.py --models all --out consistency.json
    python scripts/hf_consistency_sweep.py --models all --strict --memory-limit 512MiB
    python scripts/hf_consistency_sweep.py --audio          # audio_sweep.py's speech models instead
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import projected_loss, threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - the builders and comparisons of the fusion sweep

DROPOUT = 0.1


def _step(model, inputs):
    ol.consistency.make_reproducible(model, 7)  # step 0 again: both runs draw the same masks
    model.zero_grad(set_to_none=True)  # Reformer's reversible backward accumulates into .grad itself
    outs = S._run(model, inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(projected_loss(outs), params, allow_unused=True)
    return outs, [g if g is not None else torch.zeros(0) for g in grads]


def check(name: str, r: dict, strict: bool = False, memory_limit=None, running=S.build_running) -> None:
    """Fill ``r``; ``r["stage"]`` is where an exception left it ("build"/"eager": the model itself).
    ``running``: ``hf_sweep.build_running``, or ``audio_sweep.running``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = running(name, torch.float32, r, dropout=DROPOUT)
        drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        for m in drops:
            m.p = DROPOUT
        r["dropouts"] = len(drops)
        r["stage"] = "checker"
        checker = ol.consistency.ConsistencyChecker(precision=1e-12, dump_on_failure=False, memory_limit=memory_limit)
        buffers = [b.detach().clone() for b in model.buffers()]
        for _ in range(2):  # the same step twice: from the same buffers (running statistics, counters, ranges)
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers):
                    b.copy_(saved)
            with checker.trace(model):
                _step(model, inputs)
        r["repeat_consistent"] = bool(checker.report.ok)
        if not checker.report.ok:
            r["divergence"] = str(checker.report.first_divergence)[:300]
        r["stage"] = "fuse"
        fused, plan = ol.fusion.fuse(model, inputs)  # fuse copies; the model stays as it is
        r["fused"] = len(plan.fused)
        r["stage"] = "compare"
        (outs_a, g_a), (outs_b, g_b) = _step(model, inputs), _step(fused, inputs)
        largest = S.largest_finite(g_a)
        r["out_err"], r["grad_err"] = S._rel(outs_b, outs_a), S._rel(g_b, g_a, largest)
        again = _step(fused, inputs)
        r["fused_repeat_equal"] = _equal((outs_b, g_b), again)
        if strict:
            r["stage"] = "strict"
            for key, m in (("strict_threads_bitwise", model), ("strict_fused_threads_bitwise", fused)):
                runs = []
                for n in (1, 2):
                    with threads(n), ol.consistency.strict():
                        runs.append(_step(m, inputs))
                r[key] = _equal(*runs)
    del r["stage"]


def _equal(a, b) -> bool:
    """Outputs and gradients of two steps, bit for bit."""
    return all(torch.equal(x, y) for x, y in zip([*a[0], *a[1]], [*b[0], *b[1]]))


def _line(r: dict) -> str:
    same = {True: "bitwise", False: "DIFFERS"}
    strict = ""
    if "strict_threads_bitwise" in r:
        strict = f"  strict 1|2 threads {same[r['strict_threads_bitwise']]}"
        strict += f", fused {same[r['strict_fused_threads_bitwise']]}"
    return (f"drop {r['dropouts']:3d}  repeat {'same' if r['repeat_consistent'] else 'DIFFERS'}  "
            f"fused {r['fused']:3d}  vs eager {r['out_err']:.0e}/{r['grad_err']:.0e}  "
            f"again {same[r['fused_repeat_equal']]}{strict}")


def main(argv=None) -> None:
    ap = S.argument_parser(__doc__)
    ap.add_argument("--strict", action="store_true", help="also: under ol.consistency.strict(), the same bits "
                    "with 1 and 2 threads, unfused and fused")
    ap.add_argument("--memory-limit", default=None, help="the checker's memory_limit ('1GiB'): traces hold the tensors "
                    "of their first events up to it and statistics after it (large models' steps fit in memory)")
    ap.add_argument("--audio", action="store_true", help="audio_sweep.py's speech and audio models (--models: "
                    "their class names; default: all of them)")
    args = ap.parse_args(argv)
    names, running = S.model_names(args.models), S.build_running
    if args.audio:
        import audio_sweep

        names = args.models.split(",") if args.models else audio_sweep.audio_models()
        running = audio_sweep.running
    S.run_sweep(names, lambda name, r: check(name, r, args.strict, args.memory_limit, running), _line, args.out)


if __name__ == "__main__":
    main()
