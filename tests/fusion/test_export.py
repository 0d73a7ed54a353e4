"""``torch.export`` of a fused model: every patch gives the exporter the model's own code.

Before, a non-strict export (the default) traced into the fused ops with fake tensors and failed on a data pointer
("Cannot access data pointer of Tensor"), a root region failed on ``forward.__code__``, and a strict export refused
the ``torch.compiler.disable``d patch calls. An exported program is the model's graph (what fused ops save for a
backward is no concern of it), with the model's outputs; the fused model trains fused afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.models import Encoder, EncoderConfig
from opsnn_lab.testing import seeded


class Block(nn.Module):
    """Conv -> BN -> ReLU (a module chain), q/k/v siblings and an attention core, and an MLP whose GELU is inline
    in this forward (its fx region)."""

    def __init__(self, d=8):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, d, 3, padding=1), nn.BatchNorm2d(d), nn.ReLU()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, scale: float = 1.0):
        h = self.act(self.bn(self.conv(x))).flatten(2).transpose(1, 2)
        q, k, v = (p(h).unflatten(-1, (2, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        h = h + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.fc2(F.gelu(self.fc1(h))) * scale


def _block():
    return Block().train(), (seeded(2, 3, 4, 4),)


def _encoder():
    return Encoder(EncoderConfig.tiny(layers=1)).train(), (torch.randint(0, 100, (2, 6),
                                                                         generator=torch.Generator().manual_seed(0)),)


MODELS = {"block": _block, "encoder": _encoder}


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("case", list(MODELS))
def test_an_exported_fused_model_is_the_models_own_program(case, strict):
    torch.manual_seed(0)
    model, inputs = MODELS[case]()
    fused, plan = ol.fusion.fuse(model, inputs)
    routes = {d.route for d in plan.fused}
    assert len(plan.fused) >= 3 and (case != "block" or routes == {"module:chain", "module:qkv", "fx:<model>"})
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    fused_bytes = activation_bytes(lambda: fused(*inputs))
    fused.load_state_dict(state)  # BatchNorm statistics as the model's
    for m in (model, fused):
        m.eval()
    program = torch.export.export(fused, inputs, strict=strict)
    assert not [n for n in program.graph.nodes if n.op == "call_function" and "opsnn" in str(n.target)]
    torch.testing.assert_close(program.module()(*inputs), model(*inputs), rtol=0, atol=0)
    torch.testing.assert_close(program.module()(*inputs), torch.export.export(model, inputs).module()(*inputs),
                               rtol=0, atol=0)
    fused.train()  # and the fused model runs fused again
    assert activation_bytes(lambda: fused(*inputs)) == fused_bytes
