"""``demos.consistency.mask_variants`` (notebook 03): a prepared model's masks survive fusion and activation
checkpointing; an unprepared one under another global seed trains on other masks."""

from __future__ import annotations

import torch

from opsnn_lab.demos.consistency import mask_variants
from opsnn_lab.models import EncoderConfig, MaskedTokenTask


def test_fused_and_checkpointed_variants_train_on_the_prepared_masks():
    task = MaskedTokenTask(batch_size=2, seq_len=8, seed=0)

    def make():
        torch.manual_seed(0)
        return task.model(EncoderConfig.tiny(dropout=0.2, attn_dropout=0.2))

    got = mask_variants(make, task, seed=3, steps=2)
    assert set(got) == {"fused", "checkpointed", "fused + checkpointed", "not prepared"}
    assert got["checkpointed"]["max |d grad| / max |grad|"] == 0.0 and got["checkpointed"]["max |d loss|"] == 0.0
    assert got["fused"]["ok"] and got["fused + checkpointed"]["ok"]
    assert got["fused"]["max |d loss|"] < 1e-5
    assert not got["not prepared"]["ok"] and got["not prepared"]["max |d grad| / max |grad|"] > 1e-2
