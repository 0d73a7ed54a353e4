"""Reference models and synthetic tasks: shapes, determinism, learnability, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.models import (
    Encoder,
    EncoderConfig,
    ImageTask,
    MaskedTokenTask,
    ResNet,
    ResNetConfig,
)


def test_encoder_shapes_and_layout():
    cfg = EncoderConfig.tiny()
    model = Encoder(cfg)
    ids = torch.randint(0, cfg.vocab_size - 1, (3, 11))
    assert model(ids).shape == (3, 11, cfg.vocab_size)
    names = dict(model.named_modules())
    # the patterns the fusion analysis looks for exist under stable names
    for suffix in ("attention.query", "attention.key", "attention.value", "mlp.fc1", "mlp.act", "mlp.dropout",
                   "mlp.fc2"):
        assert f"layers.0.{suffix}" in names


def test_encoder_attention_mask_blocks_padding():
    model = Encoder(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0)).eval()
    ids = torch.randint(0, 100, (1, 8))
    mask = torch.ones(1, 8)
    mask[0, 6:] = 0
    other = ids.clone()
    other[0, 6:] = 3  # change only padded tokens
    out_a, out_b = model(ids, mask), model(other, mask)
    torch.testing.assert_close(out_a[0, :6], out_b[0, :6])


def test_bert_base_shapes():
    cfg = EncoderConfig.bert_base()
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.intermediate) == (768, 12, 12, 3072)


@pytest.mark.parametrize("kwargs, err, word", [
    (dict(hidden=30, heads=4), ValueError, "divisible"),
    (dict(dropout=1.5), ValueError, "dropout"),
    (dict(layers=0), ValueError, "layers"),
    (dict(hidden=32.0), TypeError, "hidden"),
])
def test_encoder_config_rejects_bad_arguments(kwargs, err, word):
    with pytest.raises(err, match=word):
        EncoderConfig(**kwargs)


def test_encoder_rejects_bad_inputs():
    model = Encoder(EncoderConfig.tiny())
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, model.config.max_len + 1, dtype=torch.long))


def test_resnet_shapes_and_stem():
    model = ResNet(ResNetConfig(width=8, blocks=(1, 1, 1)))
    assert model(torch.randn(2, 3, 33, 31)).shape == (2, 10)
    assert isinstance(model.conv1, torch.nn.Conv2d) and isinstance(model.maxpool, torch.nn.MaxPool2d)
    assert ResNetConfig.resnet18_stem().blocks == (2, 2, 2, 2)


def test_masked_token_task_is_deterministic_per_step():
    task = MaskedTokenTask(vocab_size=50, seq_len=16, batch_size=4, seed=3)
    a, b, c = task.batch(5), task.batch(5), task.batch(6)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    masked = a["labels"] != -100
    assert masked.any(dim=1).all(), "every row has at least one target"
    assert (a["input_ids"][masked] == task.mask_id).all()
    assert task.batch(0, batch_size=0)["input_ids"].shape == (0, 16)


def test_masked_token_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        MaskedTokenTask(vocab_size=2)
    with pytest.raises(ValueError, match="mask_prob"):
        MaskedTokenTask(mask_prob=0.0)


def test_image_task_labels_are_learnable_signal():
    task = ImageTask(batch_size=64, noise=0.0, image_size=16)
    batch = task.batch(0)
    assert batch["images"].shape == (64, 3, 16, 16)
    # noiseless images of the same class are identical, of different classes differ
    imgs, labels = batch["images"], batch["labels"]
    same = (labels[:, None] == labels[None, :])
    dist = (imgs.flatten(1)[:, None] - imgs.flatten(1)[None]).abs().amax(-1)
    assert torch.all(dist[same] < 1e-5) and torch.all(dist[~same] > 1e-2)


def test_masked_token_loss_starts_at_chance():
    torch.manual_seed(0)
    task = MaskedTokenTask(vocab_size=64, seq_len=16, batch_size=32)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    loss = task.loss(model, task.batch(0))
    assert abs(loss.item() - math.log(64)) < 0.15


def test_target_mask_gives_the_selected_rows_of_the_full_logits():
    model = Encoder(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0)).eval()
    task = MaskedTokenTask(vocab_size=model.config.vocab_size, seq_len=12, batch_size=3)
    batch = task.batch(0)
    targets = batch["labels"] != -100
    full = model(batch["input_ids"])
    torch.testing.assert_close(model(batch["input_ids"], target_mask=targets), full[targets])
    # the loss over masked rows equals cross-entropy with ignore_index over the full logits
    ref = torch.nn.functional.cross_entropy(full.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(task.loss(model, batch), ref)
    with pytest.raises(ValueError, match="target_mask"):
        model(batch["input_ids"], target_mask=targets[:, :5])
    with pytest.raises(TypeError, match="target_mask"):
        model(batch["input_ids"], target_mask=targets.long())


class _WrappedEncoder(torch.nn.Module):  # how DistributedDataParallel holds a model: at .module
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _loss_and_grads(task, model, batch):
    loss = task.loss(model, batch)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("wrap", [False, True])
def test_fused_head_loss_equals_the_plain_path_with_every_gradient(wrap):
    torch.manual_seed(0)
    fused_task = MaskedTokenTask(seq_len=16, batch_size=4)
    plain_task = MaskedTokenTask(seq_len=16, batch_size=4, fused_head=False)
    model = fused_task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    model = _WrappedEncoder(model) if wrap else model
    calls = []
    head = model.module.head if wrap else model.head
    head.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    batch = fused_task.batch(3)
    got_loss, got = _loss_and_grads(fused_task, model, batch)
    want_loss, want = _loss_and_grads(plain_task, model, batch)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    n_masked = int((batch["labels"] != -100).sum())
    assert calls == [0, n_masked]  # the fused path's head ran on 0 rows: no logits were computed
    assert not head._forward_pre_hooks  # the capture hook is gone


def test_fused_head_switch_is_validated_and_non_linear_heads_fall_back():
    with pytest.raises(TypeError, match="fused_head"):
        MaskedTokenTask(fused_head=1)
    task = MaskedTokenTask(seq_len=8, batch_size=2)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    model.head = torch.nn.Sequential(model.head)  # not an nn.Linear: the plain path runs
    assert torch.isfinite(task.loss(model, task.batch(0)))
