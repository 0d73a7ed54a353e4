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


def _roberta():  # a causal LM whose head module transforms before the decoder (dense, GELU, LayerNorm)
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     is_decoder=True)
    return transformers.RobertaForCausalLM(cfg)


def _mbart():  # a causal LM that does not shift its labels
    torch.manual_seed(0)
    cfg = transformers.MBartConfig(vocab_size=97, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                   decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0)
    return transformers.MBartForCausalLM(cfg)


@pytest.mark.parametrize("build, masked", [(_llama, False), (_bert, True), (_roberta, False), (_mbart, False)],
                         ids=["llama", "bert", "roberta_causal", "mbart_causal"])
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


def _tiny(config_class, **kw):
    return config_class(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw)


# Logit maps read from the config, with which way each model takes its scale: Gemma 2's cap (0.5: a fresh model's
# logits reach it), Cohere multiplies by logit_scale, Granite divides by logits_scaling, HyperCLOVA X multiplies.
_MAPPED = [
    ("Gemma2", dict(final_logit_softcapping=0.5), "causal cap 0.5"),
    ("Cohere", dict(logit_scale=0.0625), "causal x0.0625"),
    ("Granite", dict(logits_scaling=4.0), "causal x0.25"),
    ("HyperCLOVAX", dict(logits_scaling=4.0), "causal x4"),
]


@pytest.mark.parametrize("family, config, way", _MAPPED, ids=[m[0] for m in _MAPPED])
def test_a_logit_map_in_the_config_is_found_and_trained_through(family, config, way):
    from opsnn_lab.ops.lm_head import _VERIFIED, describe

    if not hasattr(transformers, f"{family}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(_tiny(getattr(transformers, f"{family}Config"), **config))
    ids, mask, labels = _batch(model.config.vocab_size, False)
    want_loss, want = _loss_and_grads(model, model(ids, attention_mask=mask, labels=labels).loss)
    got_loss, got = _loss_and_grads(model, ops.lm_head_loss(model, ids, labels, attention_mask=mask))
    assert describe(model.__dict__[_VERIFIED][("causal", torch.float32)]) == way
    assert_close_dtype(got_loss, want_loss)
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
    model = _llama()  # a cap in the config that the model does not apply: equal losses at init, not at the cap
    model.config.final_logit_softcapping = 30.0
    ids, mask, labels = _batch(model.config.vocab_size, False)
    with pytest.raises(ValueError, match=r"model: .*\(causal cap 30 differs once the logits reach the cap"):
        ops.lm_head_loss(model, ids, labels, attention_mask=mask)
    with pytest.raises(ValueError, match="labels"):
        ops.lm_head_loss(_bert(), torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="model"):
        ops.lm_head_loss("bert", torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


class ScaledLlamaForCausalLM(transformers.LlamaForCausalLM if transformers else object):
    """A causal LM whose forward scales the logits, which nothing in its attributes or config says."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden) / 4.0
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_model_whose_loss_is_another_raises_naming_both_once_checked():
    torch.manual_seed(0)
    model = ScaledLlamaForCausalLM(_llama().config)
    ids, mask, labels = _batch(model.config.vocab_size, False)
    assert ops.lm_head_kind(model)[0] == "causal"  # its attributes look like any causal LM's
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(1))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"ScaledLlamaForCausalLM's own loss on the first 9 tokens is .*, "
                                             r"lm_head_loss's \(causal .*\): its forward does more between"):
            ops.lm_head_loss(model, ids, labels, attention_mask=mask)
    assert len(calls) == 1  # the verdict is kept: one check, on the first call


def test_the_check_runs_once_in_eval_mode_and_puts_every_module_s_mode_back():
    model = _llama().train()
    model.model.layers[0].eval()  # a frozen layer: its mode is the user's
    ids, mask, labels = _batch(model.config.vocab_size, False)
    modes = []
    model.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    for _ in range(3):
        ops.lm_head_loss(model, ids, labels, attention_mask=mask).backward()
    assert modes == [False]  # only the check called the model itself, in eval mode
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


def test_the_lm_head_sweep_script_tells_same_refused_and_failed_apart():
    """scripts/lm_head_sweep.py (the README's figure) on a causal LM, one whose head module transforms, one
    whose labels are not shifted, one whose head cannot read the base model's output, one scaling its logits, and
    a name the installed transformers does not have."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "lm_head_sweep.py"
    check = runpy.run_path(str(script))["check"]
    # RemBert: the plain kind raises on the head (its hidden states are narrower than the head's input)
    for name, way in (("Llama", "causal"), ("Roberta", "causal_head"), ("MBart", "unshifted"),
                      ("RemBert", "causal_head"), ("Cohere", "causal x0.0625")):
        status, detail = check(name, torch.float32)
        assert status == "same" and f" as {way}:" in detail, (name, detail)
    assert check("NoSuchModel", torch.float32)[0] == "build fails"
