"""``python -m opsnn_lab.bench ops [--quick]``: fused chains vs eager vs torch.compile.

Per chain (MLP, Linear+GELU+Dropout, Conv+BN+ReLU+MaxPool stem, QKV, attention core, one BERT encoder
layer fused by hand): forward+backward time ratio (interleaved medians, one process), activation bytes
saved for backward (``activation_bytes``), for rows that give their parameters the peak bytes of forward+backward
(``peak_bytes``, the parameters' ``.grad`` included), and first-call latency (torch.compile compiles there; the
fused ops do not). BERT-base shapes by default (8 x 128 tokens, 768 -> 3072, 12 heads; stem 8 x 3 x 224 x
224); ``--quick`` uses CI-sized shapes; ``--batch-scale K`` multiplies every row's batch (and the head +
cross-entropy's tokens) by K, for a GPU, where the CPU-sized steps of 0.1-1 ms measure launch overhead rather
than the kernels. Writes ``build/bench/ops.json``.

The run keeps freed memory in the process and makes 512 MB of free heap resident (32 MB with ``--quick``)
before each row's timed rounds (``--allocator steady``, :mod:`opsnn_lab.bench.allocator`) unless ``--allocator
system`` is given; each row reports the minor page faults per timed step of each variant (the warm-up, which
pages the heap in, is not counted). A timed round repeats a step until the fastest variant has run
``--min-round-ms`` (20 ms), so the norms' 1-10 ms rows are timed over as many calls as the 50-500 ms rows take
time.

Rows in a reduced precision (``[bf16]``) are left out of a run that names no ``--chains`` on a CPU whose GEMMs
emulate that dtype (AVX2 only: ~25x fp32, so one row with torch.compile runs for over 25 minutes, and its
timings say nothing about the CPUs people train in bf16 on); the run prints why and records it under
``"skipped"``. Naming a row in ``--chains`` times it anyway.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from opsnn_lab.bench import chains_mlp
from opsnn_lab.bench.allocator import page_faults, prefault, steady
from opsnn_lab.bench.chains_conv import CONV_BUILDERS, CONV_CHAINS
from opsnn_lab.bench.chains_norm import NORM_BUILDERS, NORM_CHAINS
from opsnn_lab.bench.common import (
    format_table,
    interleaved_medians,
    keeps_threads,
    machine_line,
    step_peak_bytes,
    sync,
    write_json,
)
from opsnn_lab.bench.machine import emulated_note
from opsnn_lab.measuring import activation_bytes

__all__ = ["main", "build_chains", "measure", "emulated_rows", "scaled", "FusedEncoderLayer", "CHAINS", "ROW_DTYPES",
           "FULL", "QUICK"]

FULL = dict(batch=8, tokens=128, hidden=768, inter=3072, heads=12, image=224, channels=64, p=0.1)
QUICK = dict(batch=2, tokens=16, hidden=64, inter=256, heads=4, image=32, channels=8, p=0.1)
TARGETS = {"time_fused_vs_eager": 1.05, "time_fused_vs_eager[qkv]": 1.0, "bytes_fused_vs_eager[mlp]": 0.45,
           "bytes_fused_vs_eager[conv_bn_relu_maxpool]": 0.6, "bytes_fused_vs_eager[encoder_layer]": 0.5}


@dataclass
class Chain:
    """One benchmark case: the eager callable, its fused twin, inputs, and upstream gradients."""

    name: str
    eager: Callable
    fused: Callable
    inputs: tuple
    note: str = ""
    params: tuple = ()  # given: the row also reports peak memory of forward+backward (``peak_bytes``), .grad included


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _step(fn: Callable, inputs: tuple, grads: list[torch.Tensor]) -> Callable[[], None]:
    def run():
        torch.autograd.backward(_outputs(fn(*inputs)), grads)
    return run


# --------------------------------------------------------------------------- the fused encoder layer
class FusedEncoderLayer(nn.Module):
    """``models.EncoderLayer`` with every chain fused by hand through ``from_modules`` (shared parameters)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        from opsnn_lab import ops

        att, mlp = layer.attention, layer.mlp
        self.heads, self.head_dim = att.heads, att.head_dim
        self.qkv = ops.FusedQKV.from_modules(att.query, att.key, att.value)
        self.core = ops.FusedAttention.from_modules(att.attn_dropout, scale=1.0 / math.sqrt(att.head_dim))
        self.output = att.output
        self.attn_out_dropout = ops.Dropout.from_module(layer.attn_out_dropout)
        self.attn_norm = layer.attn_norm
        self.mlp = ops.FusedLinearGELUDropoutLinear.from_modules(mlp.fc1, mlp.act, mlp.dropout, mlp.fc2)
        self.mlp_out_dropout = ops.Dropout.from_module(layer.mlp_out_dropout)
        self.mlp_norm = layer.mlp_norm

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (self._split(t) for t in self.qkv(x))
        ctx = self.core(q, k, v, mask).transpose(1, 2).flatten(2)
        x = self.attn_norm(x + self.attn_out_dropout(self.output(ctx)))
        return self.mlp_norm(x + self.mlp_out_dropout(self.mlp(x)))


# --------------------------------------------------------------------------- chains
def _mlp_chains(s, device, dtype):
    from opsnn_lab import ops

    fc1, fc2 = nn.Linear(s["hidden"], s["inter"]), nn.Linear(s["inter"], s["hidden"])
    gelu, drop = nn.GELU(), nn.Dropout(s["p"])
    for m in (fc1, fc2):
        m.to(device, dtype)
    x = torch.randn(s["batch"], s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    mlp = ops.FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, fc2)
    single = ops.FusedLinearGELUDropout.from_modules(fc1, gelu, drop)
    return [Chain("mlp", nn.Sequential(fc1, gelu, drop, fc2), mlp, (x,)),
            Chain("linear_gelu_dropout", nn.Sequential(fc1, gelu, drop), single, (x,))]


def _stem_chain(s, device, dtype):
    from opsnn_lab import ops

    try:
        fused_cls = ops.FusedConvBNReLU
    except (ImportError, AttributeError) as exc:
        return None, f"conv_bn_relu_maxpool skipped: ol.ops.FusedConvBNReLU unavailable ({exc})"
    conv, bn = nn.Conv2d(3, s["channels"], 7, 2, 3, bias=False), nn.BatchNorm2d(s["channels"])
    relu, pool = nn.ReLU(), nn.MaxPool2d(3, 2, 1)
    eager = nn.Sequential(conv, bn, relu, pool).to(device, dtype)
    try:
        fused = fused_cls.from_modules(conv, bn, relu, pool)
    except Exception as exc:  # the op belongs to another chain's owner: report, don't crash the bench
        return None, f"conv_bn_relu_maxpool skipped: from_modules failed ({type(exc).__name__}: {exc})"
    x = torch.randn(s["batch"], 3, s["image"], s["image"], device=device, dtype=dtype, requires_grad=True)
    return Chain("conv_bn_relu_maxpool", eager, fused, (x,)), ""


def _qkv_chain(s, device, dtype):
    from opsnn_lab import ops

    lins = [nn.Linear(s["hidden"], s["hidden"]).to(device, dtype) for _ in range(3)]
    x = torch.randn(s["batch"], s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    fused = ops.FusedQKV.from_modules(*lins)

    def eager(x):
        return tuple(lin(x) for lin in lins)
    return Chain("qkv", eager, fused, (x,))


def _heads(s, device, dtype):
    """The attention rows' ``(q, k, v)``, each (batch, heads, tokens, head width), and their ``1 / sqrt(d)`` scale."""
    b, t, h = s["batch"], s["tokens"], s["heads"]
    d = s["hidden"] // h
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, 1.0 / math.sqrt(d)


def _causal(t, device, dtype):
    """A decoder's additive causal mask, (1, 1, t, t)."""
    return torch.full((t, t), torch.finfo(dtype).min, device=device, dtype=dtype).triu(1)[None, None]


def _attention_chain(s, device, dtype):
    from opsnn_lab import ops

    b, t = s["batch"], s["tokens"]
    q, k, v, scale = _heads(s, device, dtype)
    keep = torch.ones(b, t, device=device, dtype=dtype)
    keep[0, -t // 4:] = 0  # some padding, as in a real batch
    mask = (1.0 - keep[:, None, None, :]) * torch.finfo(dtype).min
    drop = nn.Dropout(s["p"])

    def eager(q, k, v, mask):
        probs = drop(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + mask, dim=-1))
        return torch.matmul(probs, v)
    return Chain("attention", eager, ops.FusedAttention.from_modules(drop, scale=scale), (q, k, v, mask))


def _t5_attention_chain(s, device, dtype):
    """T5's decoder self-attention core: the scores plus a learned ``(1, H, T, T)`` position bias, then the causal
    mask (``FusedAttention(q, k, v, mask, bias)``: each term saved as it is)."""
    from opsnn_lab import ops

    t, h = s["tokens"], s["heads"]
    q, k, v, scale = _heads(s, device, dtype)
    bias = (0.1 * torch.randn(1, h, t, t, device=device, dtype=dtype)).requires_grad_(True)
    causal, drop = _causal(t, device, dtype), nn.Dropout(s["p"])

    def eager(q, k, v, bias):
        probs = drop(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + bias + causal, dim=-1))
        return torch.matmul(probs, v)

    att = ops.FusedAttention.from_modules(drop, scale=scale)
    return Chain("attention[t5]", eager, lambda q, k, v, bias: att(q, k, v, bias, causal), (q, k, v, bias),
                 note="+ position bias, + causal mask")


def _softcap_attention_chain(s, device, dtype):
    """Gemma 2's eager attention core: the scaled scores capped to ``50 * tanh(s / 50)`` before the causal mask, the
    softmax in fp32 and cast back, dropout (``FusedAttention(softcap=50)``: the tanh recomputed in backward)."""
    from opsnn_lab import ops

    q, k, v, scale = _heads(s, device, dtype)
    causal, drop, cap = _causal(s["tokens"], device, dtype), nn.Dropout(s["p"]), 50.0

    def eager(q, k, v):
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap + causal
        probs = drop(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype))
        return torch.matmul(probs, v)

    att = ops.FusedAttention(scale, s["p"], softcap=cap, fp32_softmax=True)
    return Chain("attention[softcap]", eager, lambda q, k, v: att(q, k, v, causal), (q, k, v),
                 note="Gemma 2: 50 tanh(s / 50), + causal mask")


def _encoder_chain(s, device, dtype):
    from opsnn_lab.models import EncoderConfig, EncoderLayer

    cfg = EncoderConfig(vocab_size=128, hidden=s["hidden"], heads=s["heads"], intermediate=s["inter"],
                        max_len=s["tokens"], dropout=s["p"], attn_dropout=s["p"])
    layer = EncoderLayer(cfg).to(device, dtype)
    fused = FusedEncoderLayer(layer)
    x = torch.randn(s["batch"], s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    return Chain("encoder_layer", layer, fused, (x,), note="QKV+attention+MLP+dropouts fused by hand")


CHAINS = ("mlp", "linear_gelu_dropout", "conv_bn_relu_maxpool", "qkv", "attention", "attention[t5]",
          "attention[softcap]", "encoder_layer",
          *CONV_CHAINS,
          *NORM_CHAINS, *chains_mlp.CHAINS)  # the order build_chains() produces them in


# free heap made resident before each row's timed rounds (steady allocator), at least: twice the largest eager
# buffer of the full-size rows, the head's 256 MB logits (a sixteenth with --quick); a row whose step peaks
# higher gets twice its peak (the head + cross-entropy's eager step: 750 MB)
HEADROOM = 512 << 20
# rows built in a reduced precision (every other row runs in fp32)
ROW_DTYPES = {name: torch.bfloat16 for name in CHAINS if name.endswith("[bf16]")}


def emulated_rows(device) -> dict[str, str]:
    """``{row: why}`` for the rows whose dtype this CPU's GEMMs emulate; empty on a GPU or a CPU running them."""
    if torch.device(device).type != "cpu":
        return {}
    notes = {name: emulated_note(dtype) for name, dtype in ROW_DTYPES.items()}
    return {name: note for name, note in notes.items() if note}


def build_chains(shapes: dict, device="cpu", dtype=torch.float32, only: list[str] | None = None):
    """``(chains, skipped)``: the benchmark cases for ``shapes`` (``FULL`` or ``QUICK``), optionally ``only`` some."""
    wanted = list(only or CHAINS)
    unknown = [c for c in wanted if c not in CHAINS]
    if unknown:
        raise ValueError(f"only must name chains from {CHAINS}, got {unknown}")
    torch.manual_seed(0)
    chains, skipped = [], []
    if "mlp" in wanted or "linear_gelu_dropout" in wanted:
        chains += [c for c in _mlp_chains(shapes, device, dtype) if c.name in wanted]
    if "conv_bn_relu_maxpool" in wanted:
        stem, why = _stem_chain(shapes, device, dtype)
        chains.append(stem) if stem is not None else skipped.append(why)
    builders = {"qkv": _qkv_chain, "attention": _attention_chain, "attention[t5]": _t5_attention_chain,
                "attention[softcap]": _softcap_attention_chain,
                "encoder_layer": _encoder_chain, **CONV_BUILDERS, **NORM_BUILDERS}
    chains += [build(shapes, device, dtype) for name, build in builders.items() if name in wanted]
    chains += chains_mlp.build_chains(shapes, device, dtype, wanted)
    return chains, skipped


def scaled(shapes: dict, batch_scale: int) -> dict:
    """``shapes`` with the batch (and, through ``batch_scale``, the head + cross-entropy's tokens) times K."""
    if not isinstance(batch_scale, int) or batch_scale < 1:
        raise ValueError(f"batch_scale must be a positive int, got {batch_scale!r}")
    return {**shapes, "batch": shapes["batch"] * batch_scale, "batch_scale": batch_scale}


# --------------------------------------------------------------------------- measuring
def _first_call(fn: Callable[[], None], device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _bytes(fn: Callable, inputs: tuple) -> int | None:
    try:
        return activation_bytes(lambda: fn(*inputs))
    except Exception:  # torch.compile may refuse saved-tensor hooks; report the figure as missing
        return None


def _counting(step: Callable[[], None], faults: dict, calls: dict, key: str) -> Callable[[], None]:
    def run():
        f0 = page_faults()
        step()
        faults[key] += page_faults() - f0
        calls[key] += 1
    return run


def measure(chain: Chain, *, compile_: bool, repeat: int, warmup: int, device, min_round_s: float = 0.0,
            headroom: int = 0) -> dict:
    """One row. ``headroom``: bytes of free heap :func:`~opsnn_lab.bench.allocator.prefault` makes resident
    after the warm-up, so no timed step pays for the heap growing (``--allocator steady``); at least twice the
    peak of the row's eager and fused steps (the heap's free blocks are scattered: one contiguous top of 1.07x
    the peak still let the head + cross-entropy's eager step fault 64,000 pages every other step, 2x none)."""
    grads = [torch.randn_like(o) for o in _outputs(chain.eager(*chain.inputs))]
    steps = {"eager": _step(chain.eager, chain.inputs, grads), "fused": _step(chain.fused, chain.inputs, grads)}
    row = {"chain": chain.name, "fused_first_call_s": _first_call(steps["fused"], device)}
    if compile_:
        compiled = torch.compile(chain.eager)
        steps["compile"] = _step(compiled, chain.inputs, grads)
        row["compile_first_call_s"] = _first_call(steps["compile"], device)
    for f in steps.values():  # warm-up outside the fault count: its first-touch faults are not the steps'
        for _ in range(warmup):
            f()
    peak = ({k: step_peak_bytes(steps[k], (*chain.inputs, *chain.params)) for k in ("eager", "fused")}
            if headroom or chain.params else {})
    if headroom:
        row["headroom_bytes"] = max(headroom, 2 * max(peak.values()))
        prefault(row["headroom_bytes"])
    faults, calls = dict.fromkeys(steps, 0), dict.fromkeys(steps, 0)
    times = interleaved_medians({k: _counting(f, faults, calls, k) for k, f in steps.items()}, warmup=0,
                                repeat=repeat, device=device, min_round_s=min_round_s)
    row.update({f"{k}_faults": round(v / max(calls[k], 1)) for k, v in faults.items()})  # per timed step
    byt = {k: _bytes(f, chain.inputs) for k, f in
           [("eager", chain.eager), ("fused", chain.fused)] + ([("compile", compiled)] if compile_ else [])}
    for k, v in times.items():
        row[f"{k}_ms"] = v * 1e3
        row[f"{k}_bytes"] = byt[k]
    for k in steps:
        if k != "eager":
            row[f"time_{k}_vs_eager"] = times[k] / times["eager"]
            row[f"bytes_{k}_vs_eager"] = byt[k] / byt["eager"] if byt[k] is not None and byt["eager"] else None
    if chain.params:
        row.update(eager_peak_bytes=peak["eager"], fused_peak_bytes=peak["fused"],
                   peak_fused_vs_eager=peak["fused"] / peak["eager"])
    return row


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench ops", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized shapes")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--chains", nargs="*", choices=CHAINS,
                    help="only these chains (default: every row, less [bf16] rows on a CPU that emulates bf16)")
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds per variant (default 7, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds per variant (default 2, quick 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for the run (1 gives steadier ratios on a shared, loaded CPU)")
    ap.add_argument("--batch-scale", type=int, default=1,
                    help="multiply every row's batch (and the head + cross-entropy's tokens) by this (default 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--allocator", choices=("steady", "system"), default="steady",
                    help="steady (default): glibc keeps freed memory, so no variant pays for page faults the "
                         "other's frees caused; system: malloc as configured (see opsnn_lab.bench.allocator)")
    ap.add_argument("--min-round-ms", type=float, default=20.0,
                    help="a timed round repeats a step until the fastest variant has run this long (default 20; "
                         "0: one step per round), so the ratio of a 1 ms chain is not one call's jitter")
    ap.add_argument("--out", default=None, help="directory for ops.json (default build/bench)")
    return ap.parse_args(argv)


def _default(value, fallback):
    return fallback if value is None else value


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = steady() if args.allocator == "steady" else "system"
    if args.batch_scale < 1:
        raise SystemExit(f"--batch-scale must be >= 1, got {args.batch_scale}")
    shapes = scaled(QUICK if args.quick else FULL, args.batch_scale)
    repeat = _default(args.repeat, 5 if args.quick else 7)
    only, skipped = args.chains, []
    if not only:  # rows the user named run whatever their cost
        emulated = emulated_rows(args.device)
        only = [c for c in CHAINS if c not in emulated]
        skipped = [f"{name} skipped: {why}; name it in --chains to time it anyway" for name, why in emulated.items()]
    chains, unavailable = build_chains(shapes, args.device, only=only)
    skipped += unavailable
    for why in skipped:
        print(why)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    warmup = _default(args.warmup, 1 if args.quick else 2)
    min_round_s = max(args.min_round_ms, 0.0) / 1e3
    headroom = (HEADROOM // 16 if args.quick else HEADROOM) if allocator.startswith("steady") else 0
    rows = [measure(c, compile_=not args.no_compile, repeat=repeat, warmup=warmup, device=args.device,
                    min_round_s=min_round_s, headroom=headroom) for c in tqdm(chains, desc="ops", unit="chain")]
    cols = ["chain", "time_fused_vs_eager", "time_compile_vs_eager", "bytes_fused_vs_eager",
            "bytes_compile_vs_eager", "peak_fused_vs_eager", "eager_ms", "eager_faults", "fused_faults",
            "fused_first_call_s", "compile_first_call_s"]
    print(machine_line())
    print(f"allocator: {allocator}; *_faults: minor page faults per timed step; "
          f"rounds of >= {args.min_round_ms:g} ms")
    print(format_table(rows, [c for c in cols if any(c in r for r in rows)]))
    path = write_json("ops", {"quick": args.quick, "device": args.device, "threads": torch.get_num_threads(),
                              "shapes": shapes, "repeat": repeat, "warmup": warmup, "compile": not args.no_compile,
                              "allocator": allocator, "headroom_bytes": headroom, "min_round_ms": args.min_round_ms,
                              "rows": rows, "skipped": skipped, "targets": TARGETS}, args.out)
    print(f"wrote {path}")
    return 0
