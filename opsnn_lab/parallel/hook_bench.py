"""DDP step time and bytes with ``fp16_allreduce_hook`` against DDP's own fp32 all-reduce (run under torchrun).

    torchrun --nproc-per-node 2 -m opsnn_lab.parallel.hook_bench --steps 30

Two DDP copies of the same fused encoder, one with the hook; forward + backward steps alternate between
them so load on the machine hits both alike. The loss is scaled by a ``DynamicScaler``'s scale, as
``--precision fp16-master`` trains, and the hook is registered as the CLI registers it (with that
scaler: fp16 payload only). ``--adaptive`` registers it without a scaler instead (its own power-of-two
scale per bucket from an 8-byte amax all-reduce, counted too). Prints (rank 0) the median step-time
ratio hook / fp32 and the bytes each sends per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m opsnn_lab.parallel.hook_bench")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--adaptive", action="store_true", help="the hook without a loss scaler (amax exchange)")
    args = p.parse_args(argv)
    import opsnn_lab as ol
    from opsnn_lab.models import EncoderConfig, MaskedTokenTask
    from opsnn_lab.parallel.cli import SIZES
    from opsnn_lab.parallel.runtime import init_distributed
    from opsnn_lab.parallel.step import slice_rows
    from opsnn_lab.parallel.wrap import wrap_model
    from opsnn_lab.precision import DynamicScaler

    torch.set_num_threads(1)
    ctx = init_distributed()
    cfg = EncoderConfig(**SIZES["encoder"][args.size])
    task = MaskedTokenTask(vocab_size=cfg.vocab_size, seq_len=16, batch_size=args.global_batch_size)
    torch.manual_seed(0)
    fused, _ = ol.fusion.fuse(task.model(cfg), task.inputs(task.batch(0)))
    plain, _ = wrap_model(copy.deepcopy(fused), "ddp")
    scaler = DynamicScaler()
    hooked, state = wrap_model(copy.deepcopy(fused), "ddp", fp16_hook=True, scaler=None if args.adaptive else scaler)
    per = args.global_batch_size // ctx.world_size
    times = {"fp32": [], "fp16_hook": []}
    for step in range(args.steps):
        batch = slice_rows(task.batch(step), ctx.rank * per, (ctx.rank + 1) * per)
        for name, model in (("fp32", plain), ("fp16_hook", hooked)) if step % 2 else (("fp16_hook", hooked),
                                                                                     ("fp32", plain)):
            model.zero_grad(set_to_none=True)
            ctx.barrier()
            t0 = time.perf_counter()
            scaler.scale_loss(task.loss(model, batch)).backward()
            times[name].append(time.perf_counter() - t0)
    numel = sum(p.numel() for p in fused.parameters())
    exchange = 8 * state.calls / args.steps if args.adaptive else 0.0  # the amax all-reduce per bucket
    out = {"world_size": ctx.world_size, "params": numel, "hook": "adaptive" if args.adaptive else "loss-scaled",
           "median_step_s": {k: statistics.median(v[2:]) for k, v in times.items()},
           "bytes_per_step_fp32": 4 * numel,
           "bytes_per_step_fp16_hook": state.bytes_reduced / args.steps + exchange}
    out["time_ratio_hook_over_fp32"] = out["median_step_s"]["fp16_hook"] / out["median_step_s"]["fp32"]
    out["bytes_ratio_hook_over_fp32"] = out["bytes_per_step_fp16_hook"] / out["bytes_per_step_fp32"]
    if ctx.is_main:
        print(json.dumps(out, indent=1), flush=True)
    del plain, hooked  # the DDP reducers go before the process group does
    ctx.barrier()
    ctx.close()
    return out


if __name__ == "__main__":
    main()
