"""The shared training loop: loss falls, histories recorded, callbacks called in order."""

from __future__ import annotations

import copy

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.models import EncoderConfig, ImageTask, MaskedTokenTask
from opsnn_lab.training import Callback, TrainResult


def test_encoder_loss_falls_and_history_recorded():
    torch.manual_seed(0)
    task = MaskedTokenTask(vocab_size=64, seq_len=32, batch_size=16)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    result = ol.train(model, task, steps=120, lr=3e-3, progress=False)
    assert result.steps == 120
    assert sum(result.losses[-5:]) / 5 < 0.85 * result.losses[0]
    assert set(result.grad_amax) == {n for n, _ in model.named_parameters()}
    assert all(len(v) == 120 and all(a >= 0 for a in v) for v in result.grad_amax.values())


def test_cnn_loss_falls():
    torch.manual_seed(0)
    task = ImageTask(batch_size=32, image_size=16, noise=0.3)
    model = task.model(width=8)
    result = ol.train(model, task, steps=40, lr=3e-3, progress=False, record_grad_amax=False)
    assert sum(result.losses[-5:]) / 5 < 0.7 * result.losses[0]
    assert result.grad_amax == {}


def test_callbacks_called_in_order():
    calls = []

    class Spy(Callback):
        def on_train_start(self, model, optimizer):
            calls.append("start")

        def on_step_start(self, step, batch):
            calls.append(f"s{step}")

        def on_after_backward(self, step, model, loss):
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
            calls.append(f"b{step}")

        def on_step_end(self, step, model, loss):
            calls.append(f"e{step}")

        def on_train_end(self, result):
            calls.append("end")

    task = MaskedTokenTask(vocab_size=16, seq_len=8, batch_size=2)
    ol.train(task.model(), task, steps=2, callbacks=[Spy()], start_step=5)
    assert calls == ["start", "s5", "b5", "e5", "s6", "b6", "e6", "end"]


def _sgd_expectation(model, task, lr):
    """The weights after one plain-SGD step of ``lr`` on batch 0, computed apart from ol.train."""
    twin = copy.deepcopy(model)
    task.loss(twin, task.batch(0)).backward()
    return {n: (p - lr * p.grad).detach() for n, p in twin.named_parameters()}


def test_optimizer_factory_and_instance():
    task = MaskedTokenTask(vocab_size=16, seq_len=8, batch_size=2)
    torch.manual_seed(0)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    received = []

    def factory(params):
        received.append(list(params))
        return torch.optim.SGD(received[-1], lr=0.1)

    expected = _sgd_expectation(model, task, 0.1)
    ol.train(model, task, steps=1, optimizer=factory, record_grad_amax=False)
    assert len(received) == 1 and [id(p) for p in received[0]] == [id(p) for p in model.parameters()]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], msg=n)

    instance = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = _sgd_expectation(model, task, 0.05)
    ol.train(model, task, steps=1, optimizer=instance, record_grad_amax=False)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], msg=n)


def test_an_optimizer_instance_trains_the_fused_copy():
    """``fuse=True`` trains a fused copy: an optimizer built on the model stepped tensors without gradients and
    nothing trained, without an error (the fusion's own first-step warning now says so). It is moved to the copy."""
    import warnings

    task = MaskedTokenTask(vocab_size=16, seq_len=8, batch_size=2)
    torch.manual_seed(0)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    expected = _sgd_expectation(model, task, 0.1)
    instance = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = ol.train(model, task, steps=1, optimizer=instance, fuse=True, record_grad_amax=False)
    assert result.model is not model and all(len(instance.state[p]) for p in result.model.parameters())
    for n, p in result.model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("kwargs, err, word", [
    (dict(steps=-1), ValueError, "steps"),
    (dict(lr=0), ValueError, "lr"),
    (dict(steps=1.5), TypeError, "steps"),
])
def test_bad_arguments(kwargs, err, word):
    task = MaskedTokenTask(vocab_size=16, seq_len=8, batch_size=2)
    with pytest.raises(err, match=word):
        ol.train(task.model(), task, **kwargs)


def test_bad_task_and_model():
    task = MaskedTokenTask(vocab_size=16, seq_len=8, batch_size=2)
    with pytest.raises(TypeError, match="task"):
        ol.train(task.model(), object())
    with pytest.raises(TypeError, match="model"):
        ol.train("not a model", task)


def test_train_result_helpers():
    r = TrainResult(losses=[4.0, 2.0, 0.0])
    assert r.smoothed(2) == [4.0, 3.0, 1.0] and r.final_loss == 0.0
    assert "3 steps" in r._repr_html_() and r.to_dict()["losses"] == [4.0, 2.0, 0.0]


def test_train_result_repr_is_a_short_summary():
    """print(result) after the README's 150-step run: one line, not every loss and gradient amax."""
    losses = [4.0 - i / 50 for i in range(150)]
    r = TrainResult(losses=losses, grad_amax={f"layers.{i}.weight": [0.125] * 150 for i in range(40)},
                    seconds=12.345, precision="fp16-master", skipped_steps=2, extras={"losses_copy": losses})
    text = repr(r)
    assert text == "TrainResult(150 steps in 12.35 s, loss 4.0000 → 1.0200, precision fp16-master, 2 skipped)"
    assert str(r) == text and len(text) < 300
    assert repr(TrainResult()) == "TrainResult(0 steps in 0.00 s, loss nan → nan)"
    assert r._repr_html_() == "<b>TrainResult</b>: " + text.removeprefix("TrainResult(")[:-1]
