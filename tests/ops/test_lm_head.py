import pytest
import torch
from torch import nn

from opsnn_lab import ops
from opsnn_lab.testing import assert_close_dtype

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _batch(vocab, masked):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding in the second row
    labels = ids.clone() if not masked else torch.full_like(ids, -100)
    if masked:
        labels[:, ::3] = ids[:, ::3]
    labels[mask == 0] = -100
    return ids, mask, labels


def _loss_and_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize("build, masked", [(_llama, False), (_bert, True)])
def test_loss_and_every_parameter_gradient_match_the_hf_model(build, masked):
    model = build()
    ids, mask, labels = _batch(model.config.vocab_size, masked)
    assert ops.lm_head_kind(model)[0] == ("masked" if masked else "causal")
    want_loss, want = _loss_and_grads(model, model(ids, attention_mask=mask, labels=labels).loss)
    got_loss, got = _loss_and_grads(model, ops.lm_head_loss(model, ids, labels, attention_mask=mask))
    assert_close_dtype(got_loss, want_loss)
    assert len(got) == len(want)
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        assert_close_dtype(g, w, msg=name)


def test_num_items_in_batch_is_the_trainer_sum_form():
    model = _llama()
    ids, mask, labels = _batch(model.config.vocab_size, False)
    want = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    got = ops.lm_head_loss(model, ids, labels, attention_mask=mask, num_items_in_batch=torch.tensor(40))
    assert_close_dtype(got, want)


def test_unsupported_models_are_rejected_with_the_reason():
    kind, reason = ops.lm_head_kind(nn.Linear(3, 3))
    assert kind is None and "get_output_embeddings" in reason
    model = _llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="model: .*final_logit_softcapping"):
        ops.lm_head_loss(model, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        ops.lm_head_loss(_bert(), torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="model"):
        ops.lm_head_loss("bert", torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
