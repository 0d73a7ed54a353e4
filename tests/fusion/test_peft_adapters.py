"""LoRA fine-tuning (peft) of a Llama-style decoder: the adapters' dropouts (each ``lora_A(lora_dropout(x))``)
and gated products fuse with the norms and attention, the plan's bytes are what a step saves, and every trainable
gradient is eager's: with ``make_reproducible`` the fused dropouts draw the masks the unfused model draws."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_llama(dropout: float, attn: str):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, target_modules=_TARGETS, lora_dropout=dropout, init_lora_weights=False)
    with warnings.catch_warnings():  # peft reads a flag transformers renamed
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, lora).train()


def _step(model, ids):
    ol.consistency.make_reproducible(model, 3)  # counter masks named by module path: the same in both models
    out = model(ids, labels=ids)
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout, attn, n_dropout", [(0.0, "eager", 0), (0.1, "sdpa", 14)])
def test_lora_llama_fuses_its_adapters_with_eager_gradients(dropout, attn, n_dropout):
    model = _lora_llama(dropout, attn)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), ids)
    summary = plan.summary()
    # one product per layer (the adapters hide the Linears the whole gated MLP needs), one dropout per adapter
    assert summary["gated_product_silu"]["fused"] == 2 and not [d for d in plan.fused if d.pattern == "gated_mlp"]
    assert summary.get("dropout_linear", {}).get("fused", 0) == n_dropout

    def forward(m):
        def run():
            torch.manual_seed(3)  # eager's nn.Dropout: a mask and a dropped copy per adapter, as in training
            return m(ids).logits
        return run
    eager_bytes, fused_bytes = activation_bytes(forward(model)), activation_bytes(forward(fused))
    assert eager_bytes - fused_bytes == plan.saved_bytes > 0
    loss, grads = _step(model, ids)
    fused_loss, fused_grads = _step(fused, ids)
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == fused_grads.keys() and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


def _bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg), ["query", "value", "dense"]


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg), ["c_attn", "c_fc", "c_proj"]


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_adapters_added_after_fusion_take_the_chains_they_wrap_unfused(build):
    """``get_peft_model`` on a model fused before: each adapter wraps a Linear (or GPT-2's Conv1D) and calls it
    inside, so a chain whose first or last step it wraps runs unfused (said once), and every trainable gradient is
    that of the same adapters on the unfused model. Before, the wrapped first step returned the chain's output
    (a shape error) and a wrapped last step took it as its input."""
    torch.manual_seed(0)
    model, targets = build()
    model.train()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), ids)
    assert any(d.pattern.startswith("linear_gelu") for d in plan.fused)
    lora = peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                           fan_in_fan_out=build is _gpt2)
    adapted = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, fused):
            torch.manual_seed(2)
            adapted.append(peft.get_peft_model(m, lora).train())
        (loss, grads), (fused_loss, fused_grads) = (_step(m, ids) for m in adapted)
    said = [str(w.message) for w in caught if "replaced by a `" in str(w.message) and "in its parent" in str(w.message)]
    assert said and all("linear_gelu" in s for s in said)
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == fused_grads.keys() and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
