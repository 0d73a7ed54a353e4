"""The consistency pillar across ranks, runnable: a small 2-rank gloo job with one rank perturbed.

``run_rank_check`` spawns the ranks on 127.0.0.1 for notebook 03 and the tests; each rank traces one
step of the tiny encoder under ``ConsistencyChecker`` (which compares it with rank 0's step through
``consistency.distributed.compare_with_rank0``). The worker is a module-level function so that
``torch.multiprocessing.spawn`` can import it by name.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from opsnn_lab._checks import check_bytes
from opsnn_lab.consistency import ConsistencyChecker
from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.parallel.runtime import destroy_process_group, free_port

__all__ = ["run_rank_check", "rank_check_worker"]


def rank_check_worker(rank: int, world_size: int, port: int, perturb_rank: int, perturb: str, out_dir: str,
                      eps: float = 1e-4, memory_limit=None) -> None:
    """One rank: the tiny encoder (same seed everywhere), one traced step; ``perturb_rank`` nudges
    ``perturb``'s weight by ``eps``. Writes ``rank{r}.json`` (the report) under ``out_dir``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        task = MaskedTokenTask(batch_size=2, seq_len=8)
        torch.manual_seed(0)
        model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
        if rank == perturb_rank:
            w = model.get_parameter(f"{perturb}.weight")
            with torch.no_grad():
                w.add_(eps * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        checker = ConsistencyChecker(dump_dir=os.path.join(out_dir, "dumps"), memory_limit=memory_limit)
        with checker.trace(model):
            task.loss(model, task.batch(0)).backward()
        Path(out_dir, f"rank{rank}.json").write_text(checker.report.to_json())
    finally:
        destroy_process_group()


def run_rank_check(world_size: int = 2, perturb_rank: int = 1, perturb: str = "layers.0.mlp.fc1",
                   out_dir: str | os.PathLike | None = None, eps: float = 1e-4,
                   memory_limit: int | str | None = None) -> list[dict]:
    """Spawn ``world_size`` gloo ranks on 127.0.0.1, perturb one; return each rank's report as a dict.
    ``memory_limit``: each rank's ``ConsistencyChecker(memory_limit=...)``."""
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    if not isinstance(perturb_rank, int) or not 0 <= perturb_rank < world_size:
        raise ValueError(f"perturb_rank must be in [0, {world_size}), got {perturb_rank!r}")
    memory_limit = check_bytes("memory_limit", memory_limit, allow_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.fspath(out_dir) if out_dir is not None else tmp
        os.makedirs(out, exist_ok=True)
        mp.spawn(rank_check_worker, args=(world_size, free_port(), perturb_rank, perturb, out, eps, memory_limit),
                 nprocs=world_size, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


# --------------------------------------------------------------------------- fused and checkpointed variants
def _checkpoint_layers(model) -> None:
    """Run each encoder layer under a (non-reentrant) activation checkpoint, as HF's
    ``gradient_checkpointing_enable`` does for its decoder layers."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.layers:
        forward = layer.forward  # the class's, or a fusion rewrite's
        layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def mask_variants(make_model, task, seed: int = 0, steps: int = 2) -> dict[str, dict]:
    """Train ``steps`` steps of each variant of one model and compare every output and gradient with the
    prepared (``make_reproducible``) unfused run: fused, checkpointed, both, and unprepared under another
    global seed. ``{variant: {"max |d loss|": .., "max |d grad| / max |grad|": .., "ok": ..}}``."""
    from opsnn_lab import fusion
    from opsnn_lab.consistency import make_reproducible

    def run(fuse: bool, ckpt: bool, prepared: bool, global_seed: int):
        model = make_model()
        batch = task.batch(0)
        if fuse:
            model, _ = fusion.fuse(model, (batch["input_ids"],))
        if prepared:
            make_reproducible(model, seed=seed)
        if ckpt:
            _checkpoint_layers(model)
        torch.manual_seed(global_seed)
        losses, grads = [], []
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            loss = task.loss(model, task.batch(step))
            loss.backward()
            losses.append(loss.detach())
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        return losses, grads

    ref_losses, ref_grads = run(False, False, True, 1)
    variants = {"fused": (True, False, True, 2), "checkpointed": (False, True, True, 3),
                "fused + checkpointed": (True, True, True, 4), "not prepared": (False, False, False, 5)}
    out = {}
    for name, args in variants.items():
        losses, grads = run(*args)
        d_loss = max((a - b).abs().item() for a, b in zip(losses, ref_losses))
        # relative to the largest gradient of the step: a gradient that is 0 by symmetry (the key bias under
        # softmax) holds only rounding noise, whatever order computed it
        d_grad = max(max((g[k] - r[k]).abs().max().item() for k in r) / max(v.abs().max().item() for v in r.values())
                     for g, r in zip(grads, ref_grads))
        out[name] = {"max |d loss|": d_loss, "max |d grad| / max |grad|": d_grad, "ok": d_grad < 1e-5}
    return out
