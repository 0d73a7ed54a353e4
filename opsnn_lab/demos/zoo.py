"""Small models to prove fusion on: Hugging Face ``transformers`` models built from configs (no downloads)
and the embedded encoder and CNN. Used by the model-matrix test and ``python -m opsnn_lab.bench fusion
--models hf``.

``build(name, size="tiny", dropout=None, batch=2, seq=8)`` -> ``(model, inputs)`` with ``inputs`` a
dict of keyword arguments (or a tuple for the embedded models). ``dropout=None`` keeps the model's
defaults; ``dropout=0.0`` sets every dropout probability to 0 (exact comparisons in train mode).
``size="base"`` gives BERT-base shapes (12 layers, 768 hidden) for the HF BERT.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "build", "training_loss", "EXPECTED", "TIMM_MODELS", "build_timm", "TORCHVISION_MODELS",
           "build_torchvision", "PEFT_MODELS", "build_peft"]

_TEXT = ("bert", "roberta", "gpt2", "llama")


def _dropouts(cfg, names, dropout):
    if dropout is not None:
        for n in names:
            if hasattr(cfg, n):
                setattr(cfg, n, dropout)
    return cfg


def _bert_cfg(T, size, dropout, cls=None):
    cls = cls or T.BertConfig
    if size == "base":
        cfg = cls(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=514)
    else:
        cfg = cls(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=40, pad_token_id=1)
    # attention as Hugging Face runs it by default (F.scaled_dot_product_attention), as users get it
    return _dropouts(cfg, ("hidden_dropout_prob", "attention_probs_dropout_prob"), dropout)


def _text_inputs(vocab, batch, seq, labels=False):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, seq), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        out["labels"] = ids.clone()
    return out


def _images(batch, size=32):
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))}


def _hf(name, size, dropout, batch, seq):
    import transformers as T

    if name == "bert":
        cfg = _bert_cfg(T, size, dropout)
        return T.BertForMaskedLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "roberta":
        cfg = _bert_cfg(T, size, dropout, T.RobertaConfig)
        return T.RobertaModel(cfg, add_pooling_layer=False), _text_inputs(cfg.vocab_size, batch, seq)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0,
                           eos_token_id=0)
        cfg = _dropouts(cfg, ("resid_pdrop", "embd_pdrop", "attn_pdrop"), dropout)
        return T.GPT2LMHeadModel(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "llama":
        cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=40,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout",), dropout)
        return T.LlamaForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "gemma2":  # scores capped by 50 tanh(s / 50) before the mask (eager attention), logits by 30 tanh
        cfg = T.Gemma2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, query_pre_attn_scalar=8,
                             max_position_embeddings=40, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout",), dropout)
        return T.Gemma2ForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "mixtral":  # a mixture of experts (4, top 2), run by transformers' grouped-GEMM experts forward
        cfg = T.MixtralConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=40,
                              num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
                              pad_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout",), dropout)
        return T.MixtralForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "phi3":  # one gate_up_proj Linear split by chunk, one qkv_proj: the packed forms
        cfg = T.Phi3Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=40,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout", "resid_pdrop", "embd_pdrop"), dropout)
        return T.Phi3ForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "falcon":  # FalconLinear: an nn.Linear subclass whose own forward is `x @ W.T + b`
        cfg = T.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             new_decoder_architecture=False, bos_token_id=0, eos_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout", "hidden_dropout"), dropout)
        return T.FalconForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "bloom":  # BloomGelu: tanh-GELU written out, with its own autograd Function in training
        cfg = T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        cfg = _dropouts(cfg, ("attention_dropout", "hidden_dropout"), dropout)
        return T.BloomForCausalLM(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "t5":  # gated-GELU feed-forward (T5 v1.1 / Flan-T5), RMS norms named T5LayerNorm
        cfg = T.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        cfg = _dropouts(cfg, ("dropout_rate",), dropout)
        return T.T5ForConditionalGeneration(cfg), _text_inputs(cfg.vocab_size, batch, seq, labels=True)
    if name == "mobilenet_v2":  # ReLU6, depthwise convs, TF "same" padding inline before each conv
        cfg = T.MobileNetV2Config(image_size=32, depth_multiplier=0.25, classifier_dropout_prob=0.0)
        return T.MobileNetV2Model(cfg), _images(batch)
    if name == "resnet":
        cfg = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
        return T.ResNetModel(cfg), _images(batch)
    if name == "efficientnet":
        cfg = T.EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.2,
                                   hidden_dim=128, dropout_rate=0.0)
        cfg = _dropouts(cfg, ("drop_connect_rate",), dropout)
        return T.EfficientNetModel(cfg), _images(batch)
    if name == "convnext":
        cfg = T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)
        cfg = _dropouts(cfg, ("drop_path_rate",), dropout)
        return T.ConvNextModel(cfg), _images(batch)
    raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")


def _embedded(name, size, dropout, batch, seq):
    from opsnn_lab.models import Encoder, EncoderConfig, ResNet, ResNetConfig

    if name == "encoder":
        over = {} if dropout is None else {"dropout": dropout, "attn_dropout": dropout}
        cfg = EncoderConfig.tiny(**over)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        return Encoder(cfg), (ids,)
    return ResNet(ResNetConfig()), (_images(batch)["pixel_values"],)


MODELS = {"bert": _hf, "roberta": _hf, "gpt2": _hf, "llama": _hf, "gemma2": _hf, "mixtral": _hf, "phi3": _hf,
          "falcon": _hf, "bloom": _hf, "t5": _hf, "resnet": _hf,
          "efficientnet": _hf, "mobilenet_v2": _hf, "convnext": _hf, "encoder": _embedded, "cnn": _embedded}

# What each architecture has, per pattern: {pattern: (fused, rejected)} with the ops as they are today
# (2 layers / 2 stages). The matrix test checks plan.summary() against this; the README lists the reasons.
EXPECTED: dict[str, dict[str, tuple[int, int]]] = {}


def build(name: str, size: str = "tiny", dropout: float | None = None, batch: int = 2,
          seq: int = 8) -> tuple[nn.Module, object]:
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    if size not in ("tiny", "base"):
        raise ValueError(f"size must be 'tiny' or 'base', got {size!r}")
    torch.manual_seed(0)
    model, inputs = MODELS[name](name, size, dropout, batch, seq)
    return model, inputs


def training_loss(out) -> torch.Tensor:
    """A scalar to train a zoo model's output on: its own loss when it computes one (labels given), else the
    mean square of its first output in fp32 (a base model's hidden states)."""
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.to_tuple()[0].float().square().mean()


# timm's models (not a dependency of opsnn_lab): BatchNormAct2d in the EfficientNet/MobileNet/RegNet families,
# nn.Identity placeholders inside ResNet blocks and the ViT Mlp.
# tf_efficientnet_b0: TensorFlow's 'same' padding, computed per call by its stride-2 convs (Conv2dSame).
TIMM_MODELS = ("resnet18", "efficientnet_b0", "tf_efficientnet_b0", "mobilenetv3_small_100", "mobilenetv2_050",
               "lcnet_050", "regnetx_002", "vit_tiny_patch16_224", "inception_next_atto", "caformer_s18")


def build_timm(name: str, batch: int = 2, size: int = 96) -> tuple[nn.Module, tuple]:
    """A timm model without weights (``pretrained=False``: no download), 10 classes, no drop path."""
    import timm

    torch.manual_seed(0)
    extra = {"img_size": size} if name.startswith("vit") else {}
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.0, **extra)
    return model, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)),)


# torchvision's classification models (not a dependency either): Conv2dNormActivation blocks with ReLU, ReLU6,
# Hardswish and SiLU, squeeze-excitation, channel shuffles, dense concatenations, inception branches, ConvNeXt.
TORCHVISION_MODELS = ("resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
                      "regnet_y_400mf", "shufflenet_v2_x0_5", "mnasnet0_5", "densenet121", "googlenet",
                      "convnext_tiny")


def build_torchvision(name: str, batch: int = 2, size: int = 96) -> tuple[nn.Module, tuple]:
    """A torchvision model without weights (``weights=None``: no download), 10 classes, no auxiliary heads."""
    import torchvision

    torch.manual_seed(0)
    extra = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=10, **extra)
    return model, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)),)


# LoRA fine-tuning with peft (not a dependency): a Llama-style decoder with adapters on every projection, as the
# common recipes set them (r=16, alpha 32, every attention and MLP Linear), with and without lora_dropout, SDPA or
# the eager attention; "llama_no_adapters" is the same decoder trained in full, for comparison.
PEFT_MODELS = ("llama_no_adapters", "lora_llama", "lora_llama_dropout", "lora_llama_dropout_eager_attention")
_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft(name: str, batch: int = 2, seq: int = 256) -> tuple[nn.Module, tuple]:
    """A ``LlamaForCausalLM`` (hidden 256, intermediate 688, 4 layers, GQA 8/4, vocabulary 1024) from a config, with
    peft's LoRA adapters (``get_peft_model``) unless ``name`` is ``llama_no_adapters``; token ids as input."""
    import transformers

    if name not in PEFT_MODELS:
        raise ValueError(f"name must be one of {PEFT_MODELS}, got {name!r}")
    attn = "eager" if name.endswith("eager_attention") else "sdpa"
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=1024, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if name != "llama_no_adapters":
        import peft

        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=_LORA_TARGETS,
                               lora_dropout=0.05 if "dropout" in name else 0.0)
        model = peft.get_peft_model(model, lora)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model.train(), (ids,)
