"""``python -m opsnn_lab.train``: the one training loop from the command line, as is or under torchrun.

    torchrun --nproc-per-node 2 -m opsnn_lab.train --model encoder --fuse --precision fp16-master \\
        --parallel ddp --out runs/ddp

Writes (rank 0) ``OUT/metrics.json`` -- per-step loss, loss scale, skipped flag, samples/s, the world
size, the fp16 hook's bytes on the wire and the machine block -- ``OUT/state.sha256`` (the final fp32
master weights in canonical order, gathered to rank 0 under FSDP), ``OUT/weights.pt`` (the same weights,
for :func:`opsnn_lab.parallel.max_relative_difference`), and per rank ``OUT/ranks/rank<r>.json`` (the
loss scaler's state, which must agree across ranks). A failing or interrupted rank ends every rank
with a message naming it; collectives time out after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

SIZES = {  # --size: CI-small to laptop-small
    "encoder": {"tiny": dict(hidden=32, layers=2, heads=2, intermediate=64, vocab_size=64, max_len=16),
                "small": dict(hidden=64, layers=2, heads=4, intermediate=256, vocab_size=128, max_len=64)},
    "cnn": {"tiny": dict(width=8, blocks=(1, 1)), "small": dict(width=16, blocks=(1, 1))},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m opsnn_lab.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("encoder", "cnn"), default="encoder")
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=16, help="rows per step over all ranks")
    p.add_argument("--fuse", action="store_true", help="rewrite the model with fused ops (ol.fusion.fuse)")
    p.add_argument("--precision", choices=("fp32", "bf16", "bf16-master", "fp16-master"), default="fp32")
    p.add_argument("--strict", action="store_true",
                   help="fixed reduction order: bit-identical weights for world sizes 1, 2, 4 (dropout off: "
                        "see --dropout)")
    p.add_argument("--block-rows", type=int, default=None,
                   help="strict mode: rows per gradient block (default: global batch / 4)")
    p.add_argument("--dropout", type=float, default=None,
                   help="encoder dropout (default: the model's 0.1; 0 under --strict, which refuses any other "
                        "rate: a mask is drawn per forward call from (seed, op, step, element offset in that "
                        "call's tensor), so a rank's rows would not get the slice of the global batch's mask)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--out", default="runs/train", help="directory for metrics.json and state.sha256")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for a peer")
    p.add_argument("--save", default=None, metavar="DIR", help="write a torch.distributed.checkpoint at the end")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from a checkpoint written by --save")
    p.add_argument("--inject-overflow", default=None, metavar="RANK:STEP[,STEP]",
                   help="testing aid: one gradient element becomes inf on RANK at each STEP (DDP: before the "
                        "gradient sync, so it crosses the comm hook; FSDP: after it, in RANK's shard only)")
    return p


def _check_args(args) -> None:
    for name in ("steps", "global_batch_size", "threads"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if (args.save or args.resume) and not args.precision.endswith("-master"):
        raise SystemExit("--save/--resume need --precision fp16-master or bf16-master: a checkpoint holds "
                         "their fp32 masters and moments")
    if args.block_rows is not None and args.block_rows <= 0:
        raise SystemExit(f"--block-rows must be a positive integer, got {args.block_rows}")
    if args.strict and args.dropout:
        raise SystemExit(f"--strict trains without dropout (got --dropout {args.dropout}): a dropout mask is drawn per "
                         "forward call from (seed, op, step, element offset in that call's tensor), and under "
                         "--strict every block of rows is a call of its own, so the masks would depend on how "
                         "the global batch is split over ranks and the world-size identity would not hold")


def _task_and_model(args):
    import torch

    from opsnn_lab.models import EncoderConfig, ImageTask, MaskedTokenTask, ResNetConfig

    torch.manual_seed(args.seed)
    size = SIZES[args.model][args.size]
    rate = 0.0 if args.strict else args.dropout
    drop = {} if rate is None else {"dropout": rate, "attn_dropout": rate}
    if args.model == "encoder":
        cfg = EncoderConfig(**size, **drop)
        task = MaskedTokenTask(vocab_size=cfg.vocab_size, seq_len=min(16, cfg.max_len),
                               batch_size=args.global_batch_size, seed=args.seed)
        return task, task.model(cfg)
    task = ImageTask(image_size=16, batch_size=args.global_batch_size, seed=args.seed)
    return task, task.model(ResNetConfig(**size))


def _parse_injection(spec: str | None) -> tuple[int, set[int]] | None:
    if spec is None:
        return None
    try:
        rank, steps = spec.split(":")
        return int(rank), {int(s) for s in steps.split(",")}
    except ValueError:
        raise SystemExit(f"--inject-overflow must look like RANK:STEP[,STEP], got {spec!r}") from None


class _Recorder:
    """Per-step rows for metrics.json, and the overflow injection of ``--inject-overflow``."""

    def __init__(self, rows_per_step: int, rank: int, injection):
        self.rows_per_step, self.rank, self.injection = rows_per_step, rank, injection
        self.steps: list[dict] = []

    def on_train_start(self, model, optimizer):
        self.model, self.optimizer, self._handle = model, optimizer, None

    def _injects(self, step) -> bool:
        return bool(self.injection) and self.rank == self.injection[0] and step in self.injection[1]

    def on_step_start(self, step, batch):
        scaler = getattr(self.optimizer, "scaler", None)
        self._t0, self._scale = time.perf_counter(), (scaler.scale if scaler is not None else 1.0)
        self._skipped = getattr(self.optimizer, "skipped_steps", 0)
        import torch

        from opsnn_lab.parallel.optim import is_dtensor

        p = next(p for p in self.model.parameters() if p.requires_grad)
        if self._injects(step) and not is_dtensor(p):  # DDP: before the sync, so the comm hook carries it
            first = torch.tensor([0])
            self._handle = p.register_hook(lambda g: g.flatten().index_fill(0, first, float("inf")).view_as(g))

    def on_after_backward(self, step, model, loss):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        elif self._injects(step):  # FSDP: after the reduce-scatter, in this rank's shard only
            from opsnn_lab.parallel.optim import local

            p = next(p for p in model.parameters() if p.grad is not None)
            local(p.grad).view(-1)[0] = float("inf")

    def on_step_end(self, step, model, loss):
        dt = time.perf_counter() - self._t0
        self.steps.append({"step": step, "loss": loss, "scale": self._scale, "seconds": dt,
                           "skipped": getattr(self.optimizer, "skipped_steps", 0) > self._skipped,
                           "samples_per_s": self.rows_per_step / dt if dt > 0 else None})

    def on_train_end(self, result): ...


def run(args) -> dict:
    import torch

    import opsnn_lab as ol
    from opsnn_lab.bench.common import machine_info
    from opsnn_lab.parallel.checkpoint import ResumeCallback, checkpoint_step, save_checkpoint
    from opsnn_lab.parallel.runtime import init_distributed
    from opsnn_lab.parallel.state import master_weights, state_sha256

    torch.set_num_threads(args.threads)
    ctx = init_distributed(timeout_s=args.timeout)
    task, model = _task_and_model(args)
    block_rows = args.block_rows
    if args.strict and block_rows is None:
        block_rows = max(1, args.global_batch_size // 4)
    rec = _Recorder(args.global_batch_size, ctx.rank, _parse_injection(args.inject_overflow))
    callbacks, start = [rec], 0
    if args.resume is not None:
        start = checkpoint_step(args.resume)
        callbacks.insert(0, ResumeCallback(args.resume))
    try:
        result = ol.train(model, task, args.steps, lr=args.lr, fuse=args.fuse, precision=args.precision,
                          seed=args.seed, strict=args.strict, parallel=args.parallel, block_rows=block_rows,
                          callbacks=callbacks, record_grad_amax=False, progress=ctx.is_main, start_step=start,
                          desc=f"{args.parallel} x{ctx.world_size}")
        if args.save is not None:
            save_checkpoint(args.save, result.extras["optimizer"], start + args.steps)
        weights = master_weights(result.model, result.extras["optimizer"])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        scaler = result.extras.get("scaler")
        (out / "ranks").mkdir(exist_ok=True)
        (out / "ranks" / f"rank{ctx.rank}.json").write_text(json.dumps({
            "rank": ctx.rank, "skipped_steps": result.skipped_steps,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "skipped": [s["skipped"] for s in rec.steps], "losses": result.losses}, indent=1))
        metrics = {}
        if ctx.is_main:
            digest = state_sha256(weights)
            comm = result.extras.get("comm_state")
            metrics = {
                "config": {k: v for k, v in vars(args).items()}, "world_size": ctx.world_size,
                "parallel": args.parallel, "steps": rec.steps, "skipped_steps": result.skipped_steps,
                "state_sha256": digest, "seconds": result.seconds, "machine": machine_info(),
                "median_step_s": sorted(s["seconds"] for s in rec.steps)[len(rec.steps) // 2] if rec.steps else None,
                "comm": None if comm is None else {"calls": comm.calls, "bytes_fp16_per_step": comm.bytes_reduced /
                                                   max(1, args.steps), "bytes_fp32_per_step": comm.bytes_fp32 /
                                                   max(1, args.steps)},
            }
            (out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
            (out / "state.sha256").write_text(digest + "\n")
            torch.save(weights, out / "weights.pt")
        ctx.barrier()
        return metrics
    finally:
        result = model = None  # the DDP model goes before its process group does (runtime.destroy_process_group)
        ctx.close()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    _check_args(args)
    rank = os.environ.get("RANK", "0")
    try:
        metrics = run(args)
    except KeyboardInterrupt:
        print(f"[opsnn_lab.train rank {rank}] interrupted: stopping this rank", file=sys.stderr, flush=True)
        os._exit(130)  # no teardown collective: the peers may be gone already
    except SystemExit:
        raise
    except BaseException as e:  # a rank that fails says so, then leaves without waiting on its peers
        traceback.print_exc()
        print(f"[opsnn_lab.train rank {rank}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    if metrics:
        losses = [s["loss"] for s in metrics["steps"]]
        print(f"{metrics['parallel']} x{metrics['world_size']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{metrics['skipped_steps']} skipped, state.sha256 {metrics['state_sha256'][:16]}...")
    return 0
