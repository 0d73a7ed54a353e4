"""ol.train's switchboard: fuse, precision, seed, strict and record each do what they say."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.training import Callback

TASK = MaskedTokenTask(vocab_size=32, seq_len=16, batch_size=4)


def _model(**kw):
    torch.manual_seed(0)
    return TASK.model(EncoderConfig.tiny(hidden=32, intermediate=64, **kw))


def test_fuse_trains_the_fused_copy_and_keeps_the_plan():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = ol.train(model, TASK, steps=2, fuse=True)
    plan = result.extras["fusion_plan"]
    assert any(d.fused for d in plan.decisions)
    assert result.model is not model
    assert set(result.model.state_dict()) == set(before)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "original untouched"
    n_fused = sum(bool(d.fused) for d in plan.decisions)
    assert repr(result) == f"TrainResult(2 steps in {result.seconds:.2f} s, loss {result.losses[0]:.4f} → " \
                           f"{result.losses[1]:.4f}, precision fp32, {n_fused} fused)"


def test_fp16_master_routes_grads_through_the_scaler():
    result = ol.train(_model(), TASK, steps=3, precision="fp16-master")
    history = result.extras["scaler_history"]
    assert len(history) == 3
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # CPU: fp32 compute
    assert all(all(a < 1e3 for a in series) for series in result.grad_amax.values()), "amax is unscaled"


def test_bf16_master_casts_the_model():
    result = ol.train(_model(), TASK, steps=2, precision="bf16-master")
    assert all(p.dtype == torch.bfloat16 for p in result.model.parameters())
    assert all(torch.isfinite(torch.tensor(result.losses)))


def _linear_output_dtypes(model) -> list[torch.dtype]:
    """Record the dtype of every Linear output while ``model`` trains (hooks stay on the deep copy)."""
    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    return seen


def test_bf16_autocasts_the_matmuls_of_every_step():
    a_model, b_model = _model(dropout=0.0, attn_dropout=0.0), _model(dropout=0.0, attn_dropout=0.0)
    a_dtypes, b_dtypes = _linear_output_dtypes(a_model), _linear_output_dtypes(b_model)
    a = ol.train(a_model, TASK, steps=2)
    b = ol.train(b_model, TASK, steps=2, precision="bf16")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in a_model.modules())
    assert a_dtypes == [torch.float32] * (2 * n_linear)
    assert b_dtypes == [torch.bfloat16] * (2 * n_linear)   # every Linear, in both steps
    assert all(p.dtype == torch.float32 for p in b.model.parameters())  # autocast, not a cast model
    assert a.losses == pytest.approx(b.losses, rel=2e-2) and a.losses != b.losses


def test_seed_fixes_the_dropout_masks_whatever_the_global_rng():
    model = _model()  # dropout on

    def run(global_seed, seed):
        torch.manual_seed(global_seed)
        return ol.train(copy.deepcopy(model), TASK, steps=2, seed=seed).losses

    reference = run(1, 7)
    assert reference == run(2, 7)
    assert reference != run(1, 8)
    assert run(1, None) != run(2, None)  # dropout is live: without a seed the global RNG decides


class _Probe(Callback):
    """Calls ``probe()`` at the start of each step and after each backward."""

    def __init__(self, probe):
        self.probe, self.seen = probe, []

    def on_step_start(self, step, batch):
        self.seen.append(self.probe())

    def on_after_backward(self, step, model, loss):
        self.seen.append(self.probe())


def test_strict_is_on_during_the_run_and_off_after_it_even_on_error():
    from opsnn_lab.consistency import is_strict

    probe = _Probe(is_strict)
    ol.train(_model(), TASK, steps=2, strict=True, callbacks=[probe])
    assert probe.seen == [True] * 4 and not is_strict()
    probe = _Probe(is_strict)
    ol.train(_model(), TASK, steps=1, callbacks=[probe])
    assert probe.seen == [False] * 2

    class Boom(Callback):
        def on_after_backward(self, step, model, loss):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ol.train(_model(), TASK, steps=1, strict=True, callbacks=[Boom()])
    assert not is_strict()


def test_record_keeps_what_the_widgets_need():
    model = _model(dropout=0.0, attn_dropout=0.0)
    twin = copy.deepcopy(model)
    TASK.loss(twin, TASK.batch(0)).backward()
    first_grads = {n: p.grad for n, p in twin.named_parameters()}
    result = ol.train(model, TASK, steps=3, record=True, precision="fp16-master")
    assert {"gradient_stats", "consistency", "scaler_history"} <= set(result.extras)
    history = result.extras["scaler_history"]
    assert [row["step"] for row in history] == [0, 1, 2]
    # the gradient statistics are of the true (unscaled) gradients, every step, every parameter
    trace = result.extras["gradient_stats"].trace()
    assert list(trace.step) == [0, 1, 2] and trace.names == list(result.grad_amax)
    assert list(trace.scale) == [row["scale"] for row in history] and history[0]["scale"] > 1
    loop_amax = np.array([result.grad_amax[n] for n in trace.names], dtype=np.float32).T
    np.testing.assert_allclose(trace.param_amax, loop_amax, rtol=1e-6)
    # the consistency reference is the first step, forward and backward, with every parameter's gradient
    reference = result.extras["consistency"].reference
    assert {r.phase for r in reference.records} == {"forward", "backward"}
    grads = {f"{r.module_path}.{r.op.removeprefix('grad.')}": r.outputs[0] for r in reference.records
             if r.kind == "grad"}
    assert set(grads) == set(first_grads)
    scale = history[0]["scale"]
    for name, g in first_grads.items():
        torch.testing.assert_close(grads[name] / scale, g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kwargs, err, word", [
    (dict(precision="fp8"), ValueError, "precision"),
    (dict(fuse=1), TypeError, "fuse"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(precision="fp16-master", optimizer=torch.optim.SGD), ValueError, "optimizer"),
])
def test_bad_switchboard_arguments(kwargs, err, word):
    with pytest.raises(err, match=word):
        ol.train(_model(), TASK, steps=1, **kwargs)
