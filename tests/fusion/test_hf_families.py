"""Hugging Face families outside the model matrix, one tiny config each, in float64 (fused and eager must agree to
rounding): decoders with GQA, soft-capping and ``(1 + w)`` norms, a mixture of experts, a parallel residual, a
ReLU MLP, layers shared across depth, relative attention, encoder-decoders (T5's cast before ``wo``), per-head
q/k norms, vision towers whose regions fx rewrites (specialised ``height``/``width``, a ``ModelOutput`` returned
from a region), CLIP and Whisper. Each fuses; train-mode outputs and every gradient equal eager's; eval with
``output_hidden_states`` / ``output_attentions`` returns the same outputs; ``torch.inference_mode`` runs; the
fused model pickles. These are the architectures a sweep of unseen models broke on before their fixes."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.fusion.runtime import flatten_tensors
from opsnn_lab.testing import eager_without_dropout, projected_loss

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

V = 100
DEC = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, max_position_embeddings=40, bos_token_id=0, eos_token_id=0, pad_token_id=0)
ENC = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=40, pad_token_id=0)
VIT = dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=32)

# name -> (config class, config kwargs, model class, input kind)
FAMILIES = {
    "qwen2": ("Qwen2Config", DEC, "Qwen2ForCausalLM", "lm"),
    "gemma2": ("Gemma2Config", dict(DEC, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               "Gemma2ForCausalLM", "lm"),
    "mixtral": ("MixtralConfig", dict(DEC, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                      sliding_window=None), "MixtralForCausalLM", "lm"),
    "phi": ("PhiConfig", dict(ENC, partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=0), "PhiForCausalLM", "lm"),
    "gpt_neox": ("GPTNeoXConfig", dict(ENC, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0,
                                       eos_token_id=0), "GPTNeoXForCausalLM", "lm"),
    "opt": ("OPTConfig", dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                              word_embed_proj_dim=32, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                              eos_token_id=0), "OPTForCausalLM", "lm"),
    "stablelm_qk_norm": ("StableLmConfig", dict(DEC, partial_rotary_factor=0.25, qk_layernorm=True),
                         "StableLmForCausalLM", "lm"),
    "distilbert": ("DistilBertConfig", dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                            max_position_embeddings=40, pad_token_id=0), "DistilBertForMaskedLM", "lm"),
    "albert": ("AlbertConfig", dict(ENC, embedding_size=16, num_hidden_groups=1), "AlbertForMaskedLM", "lm"),
    "deberta_v2": ("DebertaV2Config", dict(ENC, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                           position_buckets=16, max_relative_positions=-1, share_att_key=True),
                   "DebertaV2ForMaskedLM", "lm"),
    "bart": ("BartConfig", dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                decoder_ffn_dim=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                                eos_token_id=2, decoder_start_token_id=2), "BartForConditionalGeneration", "lm"),
    "t5_relu": ("T5Config", dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                 feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
                "T5ForConditionalGeneration", "lm"),
    "vit": ("ViTConfig", VIT, "ViTModel", "image16"),
    "yolos": ("YolosConfig", dict(VIT, image_size=[16, 16], num_detection_tokens=3), "YolosForObjectDetection",
              "image16"),
    "levit": ("LevitConfig", dict(image_size=32, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                                  depths=[1, 1, 1], key_dim=[8, 8, 8], drop_path_rate=0, mlp_ratio=[2, 2, 2],
                                  attention_ratio=[2, 2, 2]), "LevitModel", "image32"),
    "clip": ("CLIPConfig", dict(text_config=dict(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32,
                                                 max_position_embeddings=16),
                                vision_config=dict(VIT, num_hidden_layers=1), projection_dim=8), "CLIPModel", "clip"),
    "whisper": ("WhisperConfig", dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                      decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
                                      max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=0), "WhisperForConditionalGeneration", "audio"),
}


DTYPE = {"mixtral": torch.float32,  # its experts' grouped GEMM has no float64 kernel
         "gemma2": torch.float32}  # its attention's fp32 softmax (a float64 model's is not fused)
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def _build(name):
    cfg_cls, kwargs, model_cls, kind = FAMILIES[name]
    if not hasattr(T, cfg_cls) or not hasattr(T, model_cls):
        pytest.skip(f"{model_cls} is not in transformers {T.__version__}")
    cfg = eager_without_dropout(getattr(T, cfg_cls)(**kwargs))  # sub-configs (CLIP's text, vision) too
    torch.manual_seed(0)
    model = getattr(T, model_cls)(cfg).to(DTYPE.get(name, torch.float64)).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, 8), generator=g)
    dtype = DTYPE.get(name, torch.float64)
    image = lambda s: torch.randn(2, 3, s, s, generator=g, dtype=dtype)  # noqa: E731
    if kind == "lm":
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if kind.startswith("image"):
        return model, {"pixel_values": image(int(kind[5:]))}
    if kind == "clip":
        return model, {"input_ids": ids, "pixel_values": image(16), "return_loss": True}
    features = torch.randn(2, 8, 16, generator=g, dtype=dtype)  # 2 x max_source_positions frames
    return model, {"input_features": features, "labels": ids[:, :5].clone()}


def _run(model, inputs, **kwargs):
    out = model(**inputs, **kwargs)
    return [t for t in flatten_tensors(out) if t.is_floating_point()]


def _close(got, want, msg=None, scale=None):
    """Within rounding: float64 to 1e-9, float32 to 1e-4, with an absolute floor scaled to ``scale`` (default the
    tensor's largest value; for gradients the model's largest, as a gradient that is 0 by symmetry, a bias before
    a train-mode BatchNorm, is rounding noise on both sides)."""
    tol = TOL[want.dtype]
    if scale is None:
        scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale), msg=msg)


def _same(got, want):
    assert len(got) == len(want)
    for b, a in zip(got, want):
        _close(b, a)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_fuses_and_matches_eager(name):
    model, inputs = _build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, plan = ol.fusion.fuse(model, inputs)
        assert plan.fused, plan.summary()
        assert list(fused.state_dict()) == list(model.state_dict())
        pickle.dumps(fused)  # (before a call asks for hidden states: Hugging Face's capture hooks do not pickle)
        # train: outputs and every parameter gradient
        grads = []
        for m in (model, fused):
            m.zero_grad(set_to_none=True)
            outs = _run(m, inputs)
            projected_loss(outs).backward()
            grads.append((outs, {k: p.grad for k, p in m.named_parameters()}))
        (outs_a, g_a), (outs_b, g_b) = grads
        _same(outs_b, outs_a)
        largest = max(float(g.abs().max()) for g in g_a.values() if g is not None and g.numel())
        for key, g in g_a.items():
            assert (g is None) == (g_b[key] is None), key
            if g is not None:
                _close(g_b[key], g, msg=key, scale=largest)
        # eval, every output the model can be asked for; then under inference_mode
        model.eval()
        fused.eval()
        extra = {"output_hidden_states": True, "output_attentions": True}
        with torch.no_grad():
            _same(_run(fused, inputs, **extra), _run(model, inputs, **extra))
        with torch.inference_mode():
            _same(_run(fused, inputs), _run(model, inputs))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_mixture_of_experts_fuses_the_gated_product_of_the_experts_forward_that_runs(impl):
    # transformers' experts run config._experts_implementation's forward (grouped_mm by default): their wrapper picks
    # it as the tracer runs it, and the code traces (item assignment included); each block's act(gate) * up fuses.
    # The per-expert loop ("eager") cannot be traced
    from opsnn_lab.measuring import activation_bytes

    model, inputs = _build("mixtral")
    model.config._experts_implementation = impl  # the experts hold the model's config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, plan = ol.fusion.fuse(model, inputs)
    decisions = [d for d in plan.decisions if d.pattern == "gated_product_silu"]
    if impl == "eager":  # one candidate per expert the loop ran
        assert decisions and not any(d.fused for d in decisions)
        assert all("for expert_idx in" in d.reason for d in decisions), decisions[0].reason
        return
    assert len(decisions) == 2 and all(d.fused for d in decisions), [d.reason for d in decisions]  # one a layer
    outs = [_run(m, inputs) for m in (model, fused)]
    _same(outs[1], outs[0])
    measured = activation_bytes(lambda: _run(model, inputs)) - activation_bytes(lambda: _run(fused, inputs))
    assert sum(d.saved_bytes for d in plan.decisions if d.fused) == measured > 0
