"""A fused Hugging Face model behaves like the original where users rely on it: forward keywords, torch.save /
load, autocast (bf16 on CPU), DistributedDataParallel (a 1-rank gloo group) and torch.compile (train step with
backward, then eval)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist

import opsnn_lab as ol
from opsnn_lab.demos import zoo
from opsnn_lab.parallel.runtime import destroy_process_group

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _bert(dropout=0.0):
    model, inputs = zoo.build("bert", dropout=dropout)
    fused, plan = ol.fusion.fuse(model, inputs)
    assert plan.summary()["qkv"]["fused"] == 2 and plan.summary()["linear_gelu_linear"]["fused"] == 2
    return model, fused, inputs


def test_forward_keywords_reach_the_model():
    model, fused, inputs = _bert()
    model.eval()
    fused.eval()
    a = model(**inputs, output_hidden_states=True, return_dict=True)
    b = fused(**inputs, output_hidden_states=True, return_dict=True)
    assert len(b.hidden_states) == len(a.hidden_states) == 3
    torch.testing.assert_close(b.loss, a.loss)
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    tup = fused(**no_labels, return_dict=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], a.logits)


def test_hf_resnet_keeps_output_hidden_states():
    model, inputs = zoo.build("resnet")
    fused, plan = ol.fusion.fuse(model.eval(), inputs)
    assert plan.fused
    out = fused(**inputs, output_hidden_states=True)
    ref = model(**inputs, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_save_load_and_autocast_on_a_fused_hf_model():
    model, fused, inputs = _bert()
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert type(loaded) is type(model)  # no class made at run time
    assert ol.fusion.patches(loaded).keys() == ol.fusion.patches(fused).keys()
    model.eval()
    loaded.eval()
    torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits)
    loaded.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loaded(**inputs)
        ref = model.train()(**inputs)
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss, atol=2e-2, rtol=2e-2)
    out.loss.backward()
    assert all(p.grad is not None for n, p in loaded.named_parameters() if "pooler" not in n)


def test_ddp_wraps_a_fused_hf_model():
    model, fused, inputs = _bert()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(fused.train())
        ddp(**inputs).loss.backward()
        model.train()(**inputs).loss.backward()
        grads = dict(fused.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        destroy_process_group()


@pytest.mark.slow
def test_torch_compile_train_step_and_eval():
    model, fused, inputs = _bert(dropout=None)  # dropout at the model's defaults
    compiled = torch.compile(fused, backend="aot_eager")
    for _ in range(2):  # the second step reuses the graph (the dropout stream stays outside it)
        out = compiled(**inputs)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in fused.named_parameters() if "pooler" not in n)
    fused.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "mobilenet_v2"])
def test_fused_model_under_autocast_keeps_its_memory_win_and_eager_accuracy(name):
    """Under autocast the fused ops compute what autocast computes (bf16 matmuls, fp32 norms of the fp32 residual
    stream): fewer saved bytes than eager autocast, every gradient within 2x eager-autocast's error vs fp64."""
    from opsnn_lab.demos import zoo
    from opsnn_lab.measuring import activation_bytes

    model, inputs = zoo.build(name, dropout=0.0)
    kw = inputs if isinstance(inputs, dict) else None

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return zoo.training_loss(m(**kw) if kw else m(*inputs))

    fused, plan = ol.fusion.fuse(copy.deepcopy(model).train(), kw or inputs)
    assert any(d.fused for d in plan.decisions)
    model.train()
    assert activation_bytes(lambda: run(fused)) < 0.9 * activation_bytes(lambda: run(model))
    grads = []
    for m in (model, fused):
        run(m).backward()
        grads.append({k: p.grad for k, p in m.named_parameters() if p.grad is not None})
    double = copy.deepcopy(model).double()
    double.zero_grad()
    cast = {k: v.double() if v.is_floating_point() else v for k, v in kw.items()} if kw else None
    zoo.training_loss(double(**cast) if kw else double(*[x.double() for x in inputs])).backward()
    for k, p in double.named_parameters():
        if p.grad is None:
            continue
        eager_err = (grads[0][k].double() - p.grad).abs().max().item()
        fused_err = (grads[1][k].double() - p.grad).abs().max().item()
        assert fused_err <= 2 * eager_err + 2**-8 * p.grad.abs().max().item(), k
