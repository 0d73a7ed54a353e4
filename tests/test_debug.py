"""The seed's snippet runs verbatim through ``opsnn_lab.debug``."""

from __future__ import annotations

import torch

import opsnn_lab as ol
from opsnn_lab.debug import ConsistencyChecker
from opsnn_lab.models import EncoderConfig, MaskedTokenTask


def test_seed_snippet_runs_verbatim(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = MaskedTokenTask(batch_size=2, seq_len=8)
    torch.manual_seed(0)
    model = task.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    batch = task.batch(0)
    inputs, labels = batch["input_ids"], batch["labels"]

    checker = ConsistencyChecker(precision=1e-6, check_gradients=True, dump_on_failure=True,
                                 dump_dir="consistency_dumps")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with checker.trace(model):
            outputs = model(inputs)
            loss = torch.nn.functional.cross_entropy(outputs.flatten(0, 1), labels.flatten())
            loss.backward()
    assert checker.report.ok
    assert not (tmp_path / "consistency_dumps").exists()


def test_same_class_from_every_import_path():
    assert ConsistencyChecker is ol.consistency.ConsistencyChecker
    from opsnn_lab.consistency import ConsistencyReport, Divergence
    from opsnn_lab.debug import ConsistencyReport as R
    from opsnn_lab.debug import Divergence as D
    assert (R, D) == (ConsistencyReport, Divergence)
