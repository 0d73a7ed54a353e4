"""``python -m opsnn_lab.bench precision``: the fused master-weight step against GradScaler + AdamW.

Two figures:

* time of one optimizer step over the same parameter shapes: ``MasterWeightOptimizer`` (fp16 params
  and grads, fp32 masters, fused unscale + finite check + AdamW + write-back) against
  ``torch.amp.GradScaler`` ``unscale_`` + ``AdamW(foreach=True)`` + ``update`` on fp32 params, as a
  ratio of interleaved medians (target <= 1.0 on CPU). Loss scale 1.0 on both sides so that neither
  needs its grads restored between timed steps; the unscale/finite-check pass runs on both anyway.
* peak gradient bytes alive during backward of the embedded encoder, plain vs ``pipelined=True``.
"""

from __future__ import annotations

import argparse

import torch

from opsnn_lab.bench.common import format_table, interleaved_medians, keeps_threads, machine_line, write_json
from opsnn_lab.precision import DynamicScaler, MasterWeightOptimizer

__all__ = ["main", "peak_grad_bytes", "step_time_ratio"]


def _shapes(numel: int) -> list[tuple[int, ...]]:
    """Transformer-like mix: square weights, 4x MLP weights, biases and norms, about ``numel`` in all."""
    h = max(8, int((numel / 12) ** 0.5))
    per_layer = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)] + [(h,)] * 6 + [(4 * h,)]
    layer_numel = sum(torch.Size(s).numel() for s in per_layer)
    return per_layer * max(1, round(numel / layer_numel))


def step_time_ratio(numel: int = 1 << 22, repeat: int = 15, device: str = "cpu",
                    low_dtype: torch.dtype = torch.float16) -> dict:
    """Median step times of the fused master step and of GradScaler + AdamW(foreach) on the same shapes."""
    shapes = _shapes(numel)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]

    ref_params = [torch.nn.Parameter(v.clone().to(device)) for v in values]
    for p, g in zip(ref_params, grads):
        p.grad = g.to(device)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-4, foreach=True)
    ref_scaler = torch.amp.GradScaler(device, init_scale=1.0, growth_interval=10**9)
    ref_scaler.scale(torch.ones((), device=device))  # initialise its scale tensor

    def baseline():
        ref_scaler.unscale_(ref_opt)
        ref_scaler.step(ref_opt)
        ref_scaler.update()

    low_params = [torch.nn.Parameter(v.to(device=device, dtype=low_dtype)) for v in values]
    for p, g in zip(low_params, grads):
        p.grad = g.to(device=device, dtype=low_dtype)
    scaler = DynamicScaler(init_scale=1.0, min_scale=1.0, growth_interval=10**9)
    fused = MasterWeightOptimizer(low_params, lr=1e-4, scaler=scaler)
    quiet = MasterWeightOptimizer(low_params, lr=1e-4, scaler=DynamicScaler(
        init_scale=1.0, min_scale=1.0, growth_interval=10**9, track_underflow=False))
    times = interleaved_medians({"gradscaler_adamw_foreach": baseline, "master_fused": fused.step,
                                 "master_fused_no_underflow_stats": quiet.step},
                                warmup=2, repeat=repeat, device=device)
    base = times["gradscaler_adamw_foreach"]
    return {"numel": sum(torch.Size(s).numel() for s in shapes), "tensors": len(shapes), "device": device,
            "seconds": times, "ratio": {k: v / base for k, v in times.items()}}


def peak_grad_bytes(model: torch.nn.Module, backward) -> int:
    """Largest number of gradient bytes alive at once while ``backward()`` runs.

    Sampled each time autograd hands a parameter its gradient (a tensor hook, which runs before the
    grad is accumulated and before any post-accumulate hook frees it): bytes of the ``.grad``s already
    held plus the one arriving.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    peak = {"bytes": 0}

    def on_grad(g):
        held = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        peak["bytes"] = max(peak["bytes"], held + g.numel() * g.element_size())

    handles = [p.register_hook(on_grad) for p in params]
    try:
        backward()
    finally:
        for h in handles:
            h.remove()
    return peak["bytes"]


def pipelined_memory(hidden: int = 64, layers: int = 2) -> dict:
    """Peak gradient bytes of one backward of the bf16 encoder, plain vs pipelined master updates."""
    from opsnn_lab.models import EncoderConfig, MaskedTokenTask

    task = MaskedTokenTask(vocab_size=128, seq_len=32, batch_size=4)
    out = {}
    for pipelined in (False, True):
        torch.manual_seed(0)
        model = task.model(EncoderConfig.tiny(hidden=hidden, layers=layers, intermediate=4 * hidden)).to(torch.bfloat16)
        opt = MasterWeightOptimizer(model, lr=1e-3, scaler=DynamicScaler(), pipelined=pipelined)
        loss = opt.scaler.scale_loss(task.loss(model, task.batch(0)))
        out["pipelined" if pipelined else "plain"] = peak_grad_bytes(model, loss.backward)
        opt.step()
    out["param_grad_bytes"] = sum(p.numel() * 2 for p in model.parameters())
    out["saved_fraction"] = 1.0 - out["pipelined"] / out["plain"]
    return out


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench precision", description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 22, help="parameter elements in the timed step")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: leave as is)")
    ap.add_argument("--out", default=None, help="directory for precision.json (default build/bench)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = step_time_ratio(args.numel, args.repeat, args.device)
    memory = pipelined_memory()
    rows = [{"variant": k, "median_ms": v * 1e3, "ratio_vs_gradscaler": timing["ratio"][k]}
            for k, v in timing["seconds"].items()]
    print(machine_line())
    print(f"optimizer step over {timing['numel']:,} params in {timing['tensors']} tensors on {args.device}")
    print(format_table(rows))
    print(f"\npeak gradient bytes in backward (bf16 encoder): plain {memory['plain']:,}, "
          f"pipelined {memory['pipelined']:,} -> {memory['saved_fraction']:.1%} saved")
    path = write_json("precision", {"step_time": timing, "pipelined_memory": memory,
                                    "threads": torch.get_num_threads()}, args.out)
    print(f"wrote {path}")
    return 0
