"""``python -m opsnn_lab.bench consistency``: what strict() and the checker's trace() cost per training step.

Both figures are ratios of median step times measured round-robin in the same process on the
embedded encoder (masked-token task; one step = zero_grad, forward, loss, backward, SGD update), or with
``--model`` on one of the zoo's image models (``IMAGE_MODELS``: depthwise convolutions in MobileNetV2, EfficientNet
and ConvNeXt; the loss the mean square of the output) at ``--image`` pixels:

* ``strict``: the step inside ``with strict():`` (entered and left every step, so the switch's own cost
  is included) over the plain step. The seed puts full consistency at 5-15%; required <= 1.15.
* ``trace``: forward+backward inside ``with ConsistencyChecker(...).trace(model):`` (operator-level
  statistics and hashes, compared with the first traced step: the checker's use, replaying one step)
  over the same forward+backward untraced (``fwd_bwd``), on fixed weights without dropout; aim <= 2.
* ``memory``: peak bytes of tensors alive during the reference trace and a compared trace, over the untraced
  forward+backward's (``measuring.peak_bytes``), without a limit and with ``memory_limit`` (``--memory-limit``,
  default: the untraced step's own peak), with the limited traces' time over the untraced step's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from opsnn_lab.bench.allocator import page_faults
from opsnn_lab.bench.common import format_table, keeps_threads, machine_line, write_json
from opsnn_lab.consistency.strict import strict
from opsnn_lab.models import EncoderConfig, MaskedTokenTask

IMAGE_MODELS = ("mobilenet_v2", "efficientnet", "convnext", "resnet", "cnn")


def _checker():
    """A ConsistencyChecker without dumps, or None where the checker is not available."""
    try:
        from opsnn_lab.consistency import ConsistencyChecker
    except (ImportError, AttributeError):
        return None
    return ConsistencyChecker(precision=None, check_gradients=True, dump_on_failure=False)


def _steps(model, loss, fixed, fixed_loss):
    """``(model, step, fixed, fwd_bwd)``: an SGD training step of ``model`` on ``loss()``, and the forward+backward
    of ``fixed`` (the same model without dropout) on ``fixed_loss()``. The checker's use is the same step replayed
    and compared with its reference: fixed weights and no dropout keep every traced step equal to the reference,
    so the figure is the cost of recording and comparing, not of reporting a divergence on every op."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    def fwd_bwd():
        fixed.zero_grad(set_to_none=True)
        fixed_loss().backward()

    return model, step, fixed, fwd_bwd


def _setup(args):
    task = MaskedTokenTask(vocab_size=args.vocab, seq_len=args.seq, batch_size=args.batch)
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                        intermediate=4 * args.hidden, max_len=max(args.seq, 64))
    model = task.model(cfg)
    batch = task.batch(0)
    torch.manual_seed(0)
    fixed = task.model(replace(cfg, dropout=0.0, attn_dropout=0.0))
    return _steps(model, lambda: task.loss(model, batch), fixed, lambda: task.loss(fixed, batch))


def _switch_cost(repeat: int = 50) -> float:
    """Seconds to enter and leave strict() once (registering and removing the kernels)."""
    with strict():
        pass  # the first entry pays one-off imports inside torch.use_deterministic_algorithms
    t0 = time.perf_counter()
    for _ in range(repeat):
        with strict():
            pass
    return (time.perf_counter() - t0) / repeat


def _interleaved(fns: dict, repeat: dict, warmup: int = 2) -> dict:
    """Median wall and CPU (process) seconds and minor page faults per variant, measured round-robin.

    CPU time is reported next to wall time because on a shared machine other processes' load
    stretches wall time far more than the work the step does. Page faults are reported because a
    traced step holds every tensor it records, so the memory it allocates is fresh, and what a fault
    costs varies several-fold between machines (and over time on a virtual one).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    for i in tqdm(range(max(repeat.values())), desc="consistency bench", leave=False):
        for k, fn in fns.items():
            if i >= repeat[k]:
                continue
            f0, w0, c0 = page_faults(), time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
            faults[k].append(page_faults() - f0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), statistics.median(faults[k])) for k in fns}


def _setup_images(args):
    """``_setup`` for a zoo image model: the step and, without dropout, the forward+backward to trace."""
    from opsnn_lab.demos import zoo

    x = torch.randn(args.batch, 3, args.image, args.image, generator=torch.Generator().manual_seed(0))

    def build(dropout):
        model, inputs = zoo.build(args.model, dropout=dropout, batch=args.batch)
        model.train()
        if isinstance(inputs, tuple):  # the embedded ResNet takes the images positionally, returns a tensor
            return model, lambda: model(x).float().square().mean()
        return model, lambda: zoo.training_loss(model(pixel_values=x))

    return _steps(*build(None), *build(0.0))


def _gemm_paths() -> dict:
    """How many GEMM shapes of the strict steps took each path (see ``strict_probe_report``)."""
    from collections import Counter

    from opsnn_lab.consistency.strict import strict_probe_report

    return dict(Counter(f"{e['key'][0]}:{e['path']}" for e in strict_probe_report()))


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench consistency", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="encoder", choices=("encoder", *IMAGE_MODELS),
                    help="the embedded encoder (default) or a zoo image model")
    ap.add_argument("--image", type=int, default=64, help="image side for --model <image model>")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=15, help="timed steps per variant")
    ap.add_argument("--trace-repeat", type=int, default=5, help="timed traced steps (they are slow)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    ap.add_argument("--no-trace", action="store_true", help="time strict() only")
    ap.add_argument("--memory-limit", default="step",
                    help="the checker's memory_limit for the memory rows: bytes, a size ('64MiB'), or 'step' "
                         "(the untraced step's peak)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory rows")
    ap.add_argument("--quick", action="store_true", help="CI size: tiny model, few steps")
    ap.add_argument("--out", default=None, help="directory for consistency.json (default build/bench)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.hidden, args.layers, args.vocab, args.repeat = 4, 16, 64, 2, 128, 3
        args.trace_repeat, args.image = 2, 32
    return args


@keeps_threads
def main(argv: list[str] | None = None) -> int:
    return _run(_parse(argv))


def _memory_rows(model, fwd_bwd, limit_arg: str) -> tuple[list[dict], int]:
    """Peak tensor bytes of traced steps over the untraced step's, with and without a memory limit."""
    from opsnn_lab._checks import check_bytes
    from opsnn_lab.consistency import ConsistencyChecker
    from opsnn_lab.measuring import peak_bytes

    fwd_bwd()
    plain = peak_bytes(fwd_bwd)
    limit = plain if limit_arg == "step" else check_bytes("--memory-limit", limit_arg)
    rows = []
    for name, value in (("no limit", None), (f"memory_limit {limit / 2**20:.1f} MiB", limit)):
        checker = ConsistencyChecker(precision=None, dump_on_failure=False, memory_limit=value)

        def traced(checker=checker):
            with checker.trace(model):
                fwd_bwd()

        traced()  # the hash's caches fill once per process
        checker.reset()
        ref = peak_bytes(traced)
        compared = peak_bytes(traced)
        times = _interleaved({"fwd_bwd": fwd_bwd, "trace": traced}, {"fwd_bwd": 3, "trace": 3}, warmup=1)
        rows.append({"variant": name, "step_peak_MiB": plain / 2**20, "reference_peak_ratio": ref / plain,
                     "compared_peak_ratio": compared / plain, "trace_time_ratio": times["trace"][0] /
                     times["fwd_bwd"][0], "summarised": f"{checker.last_trace.summarised}/{len(checker.last_trace)}",
                     "ok": checker.report.ok})
    return rows, limit


def _run(args) -> int:
    model, step, fixed, fwd_bwd = _setup(args) if args.model == "encoder" else _setup_images(args)
    checker = None if args.no_trace else _checker()

    def strict_step():
        with strict():
            step()

    def traced_step():
        with checker.trace(fixed):
            fwd_bwd()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    variants = {"default": step, "strict": strict_step}
    repeat = {"default": args.repeat, "strict": args.repeat}
    if checker is not None:
        traced_step()  # the first trace becomes the reference; timed traces are compared with it
        variants["fwd_bwd"] = fwd_bwd
        variants["trace"] = traced_step
        repeat["fwd_bwd"] = repeat["trace"] = args.trace_repeat
    switch = _switch_cost()
    times = _interleaved(variants, repeat)
    # strict is judged against the default step, trace against the same forward+backward untraced
    base = {k: times["fwd_bwd" if k == "trace" else "default"] for k in times}
    rows = [{"variant": k, "step_ms": w * 1e3, "ratio": w / base[k][0], "cpu_ms": c * 1e3,
             "cpu_ratio": c / base[k][1], "page_faults": int(f)} for k, (w, c, f) in times.items()]
    print(machine_line())
    what = (f"encoder: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}"
            if args.model == "encoder" else f"{args.model}: batch {args.batch} x 3 x {args.image} x {args.image}")
    print(f"{what}; threads {torch.get_num_threads()}")
    print(format_table(rows, ["variant", "step_ms", "ratio", "cpu_ms", "cpu_ratio", "page_faults"]))
    print(f"strict() enter+exit: {switch * 1e3:.3f} ms (included in the strict step)")
    print(f"strict() GEMM paths (probed on this machine): {_gemm_paths()}")
    if checker is None and not args.no_trace:
        print("trace: ConsistencyChecker not available in this build; trace overhead not measured")
    memory, limit = ([], None) if checker is None or args.no_memory else _memory_rows(fixed, fwd_bwd, args.memory_limit)
    if memory:
        print("trace memory (peak tensor bytes over the untraced forward+backward's):")
        print(format_table(memory, ["variant", "step_peak_MiB", "reference_peak_ratio", "compared_peak_ratio",
                                    "trace_time_ratio", "summarised", "ok"]))

    def ratio(name, col):
        return next((r[col] for r in rows if r["variant"] == name), None)

    data = {
        "config": {k: getattr(args, k) for k in ("model", "image", "batch", "seq", "hidden", "heads", "layers",
                                                 "vocab", "repeat", "trace_repeat")},
        "threads": torch.get_num_threads(),
        "rows": rows,
        "strict_ratio": ratio("strict", "ratio"),
        "strict_cpu_ratio": ratio("strict", "cpu_ratio"),
        "trace_ratio": ratio("trace", "ratio"),
        "trace_cpu_ratio": ratio("trace", "cpu_ratio"),
        "strict_switch_ms": switch * 1e3,
        "strict_gemm_paths": _gemm_paths(),
        "memory_limit": limit,
        "memory": memory,
        "targets": {"strict_ratio": 1.15, "strict_ratio_aim": 1.10, "trace_ratio_aim": 2.0},
    }
    path = write_json("consistency", data, args.out)
    print(f"wrote {path}")
    return 0
