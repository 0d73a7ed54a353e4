"""GradientTraceCallback on a tiny Hugging Face model: a trace per step, npz next to the checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from opsnn_lab.integrations.transformers import TRACE_NAME, GradientTraceCallback  # noqa: E402
from opsnn_lab.precision import GradientTrace  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=8, vocab=32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.slow
def test_trainer_records_every_step_and_saves_the_trace_next_to_checkpoints(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, save_steps=2, logging_steps=100,
                                          report_to=[], use_cpu=True, learning_rate=1e-3, save_only_model=True)
    cb = GradientTraceCallback()
    model = _tiny_gpt2()
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]).train()
    trace = cb.trace
    assert list(trace.step) == [0, 1, 2, 3]
    assert trace.names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert np.all(np.isfinite(trace.amax)) and np.all(trace.amax > 0)
    for folder in ("checkpoint-2", "checkpoint-4", "."):
        assert (tmp_path / folder / TRACE_NAME).exists(), folder
    saved = GradientTrace.load(tmp_path / TRACE_NAME)
    np.testing.assert_array_equal(saved.counts, trace.counts)
    assert len(GradientTrace.load(tmp_path / "checkpoint-2" / TRACE_NAME)) == 2


def test_callback_without_training_says_so():
    with pytest.raises(RuntimeError, match="nothing recorded"):
        _ = GradientTraceCallback().trace
    with pytest.raises(ValueError, match="model"):
        GradientTraceCallback().on_train_begin(None, None, None, model=None)
