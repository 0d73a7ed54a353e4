"""Which modules FSDP2 shards, and fused ops following the parameters their owners hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.models import ImageTask, MaskedTokenTask
from opsnn_lab.parallel.wrap import follow_owners, layer_units, shardable_units, wrap_model


def test_layer_units_of_the_embedded_models():
    enc = MaskedTokenTask().model(layers=3)
    assert layer_units(enc) == ["layers.0", "layers.1", "layers.2"]
    cnn = ImageTask().model(blocks=(2, 1))
    assert layer_units(cnn) == ["stages.0.0", "stages.0.1", "stages.1.0"]
    assert layer_units(nn.Linear(2, 2)) == []


def test_fused_encoder_keeps_its_layers_as_units():
    task = MaskedTokenTask(batch_size=2, seq_len=8)
    fused, _ = ol.fusion.fuse(task.model(), task.inputs(task.batch(0)))
    assert shardable_units(fused) == layer_units(fused) == ["layers.0", "layers.1"]


def test_a_fused_chain_called_from_above_keeps_its_layer_in_the_parent_group():
    task = ImageTask(batch_size=2, image_size=16)
    fused, _ = ol.fusion.fuse(task.model(), task.inputs(task.batch(0)))
    called_from_root = {m.rsplit(".", 1)[0] for path, s in fused.named_modules() if hasattr(s, "fused_modules")
                        and "." not in path for m in s.fused_modules if "." in m}
    assert set(shardable_units(fused)).isdisjoint(called_from_root)


def test_fused_ops_read_the_parameter_their_owner_holds_now():
    """What FSDP2 does on every forward: replace a module's parameter; the fused op must follow."""
    task = MaskedTokenTask(batch_size=2, seq_len=8)
    fused, _ = ol.fusion.fuse(task.model(dropout=0.0, attn_dropout=0.0), task.inputs(task.batch(0)))
    assert follow_owners(fused) > 0
    fused.train()
    fc1 = fused.layers[0].mlp.fc1
    new = nn.Parameter(fc1.weight.detach() * 2)
    fc1._parameters["weight"] = new  # as FSDP2's unshard does
    task.loss(fused, task.batch(0)).backward()
    assert new.grad is not None and new.grad.abs().sum() > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="parallel"):
        wrap_model(nn.Linear(2, 2), "zero3")
    with pytest.raises(TypeError, match="model"):
        layer_units("not a model")
    with pytest.raises(ValueError, match="parallel"):
        ol.train(nn.Linear(2, 2), MaskedTokenTask(), 1, parallel="zero3")
    with pytest.raises(ValueError, match="block_rows"):
        ol.train(nn.Linear(2, 2), MaskedTokenTask(), 1, parallel="ddp", block_rows=0)
    assert torch.is_tensor(torch.zeros(1))


def test_fsdp_root_runs_the_fused_head_like_ddp(world_of_one):
    """The head sits in FSDP2's root group (unsharded from forward to backward): the loss takes the same
    fused head + cross-entropy path as an unwrapped or DDP model, so loss and every gradient agree bit for bit."""
    import copy

    from opsnn_lab.parallel.optim import local

    task = MaskedTokenTask(batch_size=4, seq_len=8, vocab_size=32)
    fused, _ = ol.fusion.fuse(task.model(hidden=16, layers=2, heads=2, intermediate=32, vocab_size=32, max_len=8,
                                         dropout=0.0, attn_dropout=0.0), task.inputs(task.batch(0)))
    plain = copy.deepcopy(fused)
    sharded, _ = wrap_model(fused, "fsdp")
    rows = []
    sharded.head.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    batch = task.batch(1)
    want = task.loss(plain, batch)
    want.backward()
    got = task.loss(sharded, batch)
    got.backward()
    assert rows == [0]  # the fused path: the head module computed no logits
    assert torch.equal(got.detach(), want.detach())
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        assert torch.equal(local(p.grad), q.grad), name


@pytest.mark.parametrize("orig", [False, True], ids=["flat_views", "orig_params"])
def test_fsdp1_trains_a_fused_model_like_the_unfused_one_and_frees_the_originals(world_of_one, orig):
    """FSDP1 (``FullyShardedDataParallel``) flattens the Parameters; with ``use_orig_params=False`` each module
    then holds a plain tensor view where its Parameter was. The fused ops that hold Parameters read those views
    (``owners.call``): before, they computed with the Parameters FSDP1 had flattened away (the loss 0.0218 for
    0.02178 at the second step, the weights never updated) and kept them alive (14 of the encoder's 38)."""
    import copy
    import gc
    import weakref

    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    task = MaskedTokenTask(batch_size=4, seq_len=8, vocab_size=32)
    model = task.model(hidden=16, layers=2, heads=2, intermediate=32, vocab_size=32, max_len=8, dropout=0.0,
                       attn_dropout=0.0)
    fused, plan = ol.fusion.fuse(model, task.inputs(task.batch(0)))
    assert any(d.pattern == "linear_gelu_dropout_linear" for d in plan.fused)
    losses, alive = [], []
    for m in (copy.deepcopy(model), fused):
        originals = [weakref.ref(p) for p in m.parameters()]
        wrapped = FullyShardedDataParallel(m, use_orig_params=orig, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        run = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            loss = wrapped(*task.inputs(task.batch(step))).float().square().mean()  # FSDP1 runs forward only
            loss.backward()
            opt.step()
            run.append(loss.detach())
        losses.append(torch.stack(run))
        del m
        gc.collect()
        alive.append(sum(r() is not None for r in originals))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
    assert alive[1] == alive[0]
