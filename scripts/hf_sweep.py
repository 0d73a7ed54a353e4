"""Fuse many Hugging Face architectures built from tiny configs and check each against eager.

For every ``<Name>Config`` / model class pair found in the installed transformers: dropouts 0, eager
attention, one training step of the fused model and of the original (outputs and every parameter gradient
of a fixed random projection), then eval with hidden states and attentions, then ``inference_mode``; and the
plan's activation bytes (saved, eager total) against what a step keeps, eager and fused ("plan = step").
Prints one line per model; ``--out`` writes the details (fused patterns, fx regions, errors) as JSON.
A model the installed transformers cannot build from the small config is reported as such, not as a
fusion failure (``stage`` says where a failure happened).

    python scripts/hf_sweep.py                       # float64: errors are rounding (<= 1e-12)
    python scripts/hf_sweep.py --dtype float32 --models Llama,Qwen2,T5
    python scripts/hf_sweep.py --dtype float32 --models all   # + every other causal / masked LM installed
    python scripts/hf_sweep.py --dtype float32 --autocast     # + a bf16 autocast step, fused and eager vs fp32
    python scripts/hf_sweep.py --dtype float32 --no-cache     # use_cache=False before fusion, as training sets it
    python scripts/hf_sweep.py --dtype float32 --call-no-cache  # fused on a default call, trained with use_cache=False
    python scripts/hf_sweep.py --models all --checkpointing   # checkpointing on before fusion
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import pickle
import statistics
import time
import traceback
import warnings

import torch
import transformers as T
from tqdm import tqdm

import opsnn_lab as ol
from opsnn_lab.fusion.rewrite import REWRITE_FAILED
from opsnn_lab.fusion.runtime import flatten_tensors
from opsnn_lab.testing import eager_with_dropout, projected_loss

V = 100
TEXT_SIZES = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  head_dim=8, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, n_layer=2, n_head=4, n_embd=32,
                  n_positions=64, num_layers=2, num_heads=4, d_ff=64, d_kv=8, ffn_dim=64, dim=32, n_layers=2,
                  n_heads=4, hidden_dim=64, decoder_start_token_id=0, embedding_size=32,
                  # multi-head latent attention (DeepSeek-V2/V3 and their kin): every width small and consistent
                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
                  moe_intermediate_size=32, n_routed_experts=4, num_experts=4, num_experts_per_tok=2,
                  first_k_dense_replace=1, n_group=1, topk_group=1)  # grouped routing: 4 experts in one group
# per-architecture settings the small sizes above need to pass the config's own checks (two layers, small heads)
CONFIG_FIXES = {
    "GPTNeo": dict(attention_types=[[["global", "local"], 1]]),
    "Mamba2": dict(num_heads=8, n_groups=1, chunk_size=8),
    "Bamba": dict(mamba_n_heads=8, mamba_d_head=8, attn_layer_indices=[1], mamba_chunk_size=8),
    "GraniteMoeHybrid": dict(mamba_n_heads=8, mamba_d_head=8, layer_types=["mamba", "attention"], mamba_chunk_size=8),
    "Zamba": dict(layers_block_type=["hybrid", "mamba", "hybrid"], num_hidden_layers=3, n_mamba_heads=2),
    "Zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=8, chunk_size=8),
    "Dots3Note": dict(num_key_value_heads=4),
    "Zaya": dict(num_experts_per_tok=1),
    "Dots1": dict(n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2),
    "Lfm2Moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "Reformer": dict(axial_pos_embds_dim=(16, 16), axial_pos_shape=(4, 2), attention_head_size=8,
                     attn_layers=["local", "local"], local_attn_chunk_length=4, lsh_attn_chunk_length=4),
}
VIT_SIZES = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, num_channels=3)
TEXT = ["Bert", "Roberta", "Electra", "Albert", "DistilBert", "DebertaV2", "Deberta", "MPNet", "XLMRoberta", "Ernie",
        "Camembert", "Data2VecText", "RoFormer", "Nystromformer", "Funnel", "MobileBert", "ConvBert", "GPT2",
        "GPTNeoX", "GPTJ", "OPT", "Bloom", "CodeGen", "Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Phi",
        "Phi3", "StableLm", "Olmo", "Olmo2", "Falcon", "Starcoder2", "Cohere", "Granite", "Mixtral", "Qwen2Moe",
        "Bart", "MBart", "Pegasus", "Marian", "T5", "MT5", "LongT5", "Blenderbot", "Persimmon", "Glm", "Helium",
        "SmolLM3", "Exaone4"]
# ViT-like configs take the small sizes; the others (convolutional, hierarchical) keep their defaults
VIT_LIKE = ["ViT", "DeiT", "Beit", "Dinov2", "Dinov2WithRegisters", "ViTMAE", "Data2VecVision", "DPT", "Siglip"]
VISION_DEFAULT = ["Swin", "Swinv2", "ConvNext", "ConvNextV2", "ResNet", "RegNet", "MobileNetV2", "EfficientNet",
                  "Levit", "PoolFormer", "Segformer", "MobileViT", "Pvt", "PvtV2", "Bit", "FocalNet", "Hiera", "Cvt"]
MAX_PARAMETERS = 300_000_000  # Gemma-4 (134M) and ModernVBert (291M) run; the configs that did not take: 2.9G, 6.9G
FULL_SIZE = {"Swin", "Swinv2", "FocalNet", "Hiera", "DPT", "Levit", "Pvt"}  # their image size is built in


# LM classes whose forward needs more than token ids (images, audio codes, a language id) or whose tiny config
# is rejected: left out of ``--models all``
NOT_TEXT_ONLY = {"Emu3", "Fuyu", "Mllama", "Phi4Multimodal", "Gemma3n", "MiniMaxM3VL", "Musicgen", "MusicgenMelody",
                 "Moshi", "Clvp", "CsmDepthDecoder", "Git", "TrOCR", "Whisper", "Blt", "Vilt", "Xmod", "Perceiver",
                 "BridgeTower"}


def every_image_classifier() -> list[str]:
    """Every ``<Name>`` of the installed transformers with a ``<Name>ForImageClassification`` class and no language
    model class (CLIP, MobileNetV1, HGNetV2, SwiftFormer...): built from their default configs."""
    names = [n[:-len("ForImageClassification")] for n in dir(T) if n.endswith("ForImageClassification")]
    return sorted(n for n in names if n and not n.startswith("Auto") and n not in NOT_TEXT_ONLY
                  and not hasattr(T, n + "ForCausalLM") and not hasattr(T, n + "ForMaskedLM"))


def _vision(name: str) -> bool:
    return name in VIT_LIKE + VISION_DEFAULT or name in every_image_classifier()


def every_text_lm() -> list[str]:
    """Every ``<Name>`` of the installed transformers with a ``<Name>Config`` and a causal or masked LM class."""
    names = [n[:-len("Config")] for n in dir(T) if n.endswith("Config")]
    return sorted(n for n in names if n and n not in NOT_TEXT_ONLY
                  and (hasattr(T, n + "ForCausalLM") or hasattr(T, n + "ForMaskedLM")))


def _model_class(name: str, suffixes):
    for s in suffixes:
        if hasattr(T, name + s):
            return getattr(T, name + s)
    raise AttributeError(f"transformers {T.__version__} has no {name}{{{','.join(suffixes)}}}")


def build(name: str, dtype: torch.dtype, layers: int | None = None, dropout: float = 0.0, full: bool = False):
    """The model and its inputs, every dropout of its config ``dropout`` (0: compared with eager as it is); a vision
    model's images at 64 px, or at its config's size where it is smaller, or ``full``."""
    g = torch.Generator().manual_seed(0)
    if not _vision(name):  # a text model
        cls = _model_class(name, ("ForCausalLM", "ForMaskedLM", "ForConditionalGeneration", "LMHeadModel", "Model"))
        cfg_cls = cls.config_class  # a text-only class may take the family's text config (Gemma3TextConfig)
        params = inspect.signature(cfg_cls.__init__).parameters
        sizes = TEXT_SIZES if layers is None else {**TEXT_SIZES, "num_hidden_layers": layers, "n_layer": layers,
                                                   "num_layers": layers, "n_layers": layers}
        fixes = CONFIG_FIXES.get(name, {})
        cfg = eager_with_dropout(cfg_cls(**{**{k: v for k, v in sizes.items() if k in params}, **fixes}), dropout)
        cfg.decoder_start_token_id = getattr(cfg, "decoder_start_token_id", None) or 0
        if hasattr(cfg, "rotary_dim"):
            cfg.rotary_dim = 4
        if getattr(cfg, "kv_lora_rank", None):  # latent attention expands keys to every head: no grouping
            cfg.num_key_value_heads = cfg.num_attention_heads
        ids = torch.randint(3, V, (2, 8), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if not cls.__name__.endswith("Model"):
            inputs["labels"] = ids.clone()
    else:
        vision = name in ("Siglip",)
        cls = getattr(T, name + "VisionModel") if vision else _model_class(name, ("ForImageClassification", "Model"))
        cfg_cls = cls.config_class  # CLIPForImageClassification takes CLIPConfig, SiglipVisionModel its vision one
        cfg = eager_with_dropout(cfg_cls(**VIT_SIZES) if name in VIT_LIKE else cfg_cls(), dropout)
        size = cfg.image_size if isinstance(getattr(cfg, "image_size", None), int) else 224
        size = size if name in FULL_SIZE or full or size <= 64 else 64
        inputs = {"pixel_values": torch.randn(2, 3, size, size, generator=g)}
    if dtype == torch.float64 and name in ("Mixtral", "Qwen2Moe"):
        dtype = torch.float32  # grouped expert GEMMs have no float64 kernel
    torch.manual_seed(0)
    with torch.device("meta"):  # a config whose small sizes did not take (a nested one) would fill the memory
        size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the small config still gives {size / 1e6:.0f}M parameters (> {MAX_PARAMETERS / 1e6:.0f}M)")
    model = cls(cfg).to(dtype).train()
    return model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _run(model, inputs, **kwargs):
    torch.manual_seed(123)  # models that draw (ViTMAE's masking) draw the same in both
    return [t for t in flatten_tensors(model(**inputs, **kwargs)) if t.is_floating_point()]


def _rel(got, want, scale=None) -> float:
    """Largest difference over the largest finite magnitude of ``want``; NaN or Inf where ``want`` has the same
    (ProphetNet's own float64 outputs hold NaN) count as equal, anywhere else as an infinite error."""
    errs = []
    for a, b in zip(got, want):
        if not b.numel():
            continue
        same = (a == b) | (a.isnan() & b.isnan())
        d = torch.where(same, torch.zeros((), dtype=a.dtype), (a - b).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
        errs.append(float(d.max()) / (scale or largest_finite([b]) or 1.0))
    return max(errs, default=0.0)


def largest_finite(tensors) -> float:
    """The largest finite magnitude among ``tensors`` (the scale of gradient errors)."""
    return max((float(t[t.isfinite()].abs().max()) for t in tensors if t.isfinite().any()), default=0.0)


def build_running(name: str, dtype: torch.dtype, r: dict, dropout: float = 0.0):
    """``build`` and one eager forward (stages "build", "eager"). A hybrid whose first layers are all linear
    attention or state-space layers (Jamba, Kimi-Linear: the mask helper finds no attention layer) is built again
    with 8 layers, which brings one in; ``r["layers"]`` says so. A vision model that fails at 64 px (CLIP's fixed
    positions) is built again at its config's image size; ``r["full_size"]`` says so."""
    r["stage"] = "build"
    model, inputs = build(name, dtype, dropout=dropout)
    r["stage"] = "eager"
    try:
        _run(model, inputs)
    except Exception as exc:  # noqa: BLE001 - retried once, as said; raised again if the retry fails too
        again = {"layers": 8} if "Attention layers" in str(exc) else {"full": True} if _vision(name) else None
        if again is None:
            raise
        r["stage"] = "build"
        r.update({"layers": 8} if "layers" in again else {"full_size": True})
        model, inputs = build(name, dtype, dropout=dropout, **again)
        r["stage"] = "eager"
        _run(model, inputs)
    return model, inputs


def _train_step(model, inputs):
    """Outputs (fp32) and every parameter gradient of a fixed projection of them."""
    outs = [o.float() for o in _run(model, inputs)]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(projected_loss(outs), params, allow_unused=True)
    return outs, [g if g is not None else torch.zeros(0) for g in grads]


# what pickling a model that cannot be pickled raises: torch pickles a parametrization (weight norm) only through its
# state_dict (RuntimeError); a local function held as a hook (transformers' output capturing around a backbone) is
# AttributeError or PicklingError; an object refusing it, TypeError
_UNPICKLABLE = (RuntimeError, AttributeError, TypeError, pickle.PicklingError)


def fuse_recorded(model, example, r: dict):
    """``ol.fusion.fuse`` (stage "fuse"), the fused model pickled, and in ``r`` what fused: the patterns with their
    routes, the fx regions, and any fx rewrite that failed (its region runs unfused with a warning, which the
    sweeps ignore: a bug, kept in the record)."""
    r["stage"] = "fuse"
    fused, plan = ol.fusion.fuse(model, example)
    try:
        pickle.dumps(fused)
    except _UNPICKLABLE:
        try:
            pickle.dumps(model)
        except _UNPICKLABLE as exc:  # the model itself does not pickle: recorded, not counted against fusion
            r["pickled"] = f"neither: the model itself does not pickle ({str(exc)[:80]})"
        else:
            raise
    r["fused"] = sorted(f"{d.pattern}@{d.route.split(':')[0]}" for d in plan.decisions if d.fused)
    r["plan_bytes"] = {"saved": plan.saved_bytes, "eager": plan.activation_bytes}
    r["fx_regions"] = sorted(x["path"] or "<model>" for x in plan.routes if x["route"] == "fx")
    r["rewrite_failed"] = sorted({d.reason for d in plan.decisions if d.reason.startswith(REWRITE_FAILED)})
    return fused


AMP_FACTOR = 2.0  # the flash-attention criterion: the fused bf16 step's error within 2x eager's, both vs fp32
# eager's own bf16 error at or above this share of the largest value: bf16 has no precision left there to compare
AMP_NO_PRECISION = 0.5


def autocast_errors(step, model, fused, fp32, r: dict, others=()) -> None:
    """A training step under bf16 autocast (``step(m)`` -> outputs, gradients), eager and fused, each against the fp32
    eager step ``fp32``: ``r["amp_out_err"]`` / ``r["amp_grad_err"]``, ``{"eager": .., "fused": ..}``.

    One input's figure is one element's, the largest: a token whose MoE router picks another expert in one of the two
    bf16 steps, or one unlucky rounding, puts a model over the criterion that the next input does not. Where this
    input is over it, the same steps on ``others`` (``step(m)`` on other inputs) give ``r["amp_ratios"]``, each
    input's worse ratio of the two, and the verdict is their median, ``r["amp_ratio"]``. ``r["amp_no_precision"]``:
    eager's own bf16 error is already ``AMP_NO_PRECISION`` of the largest value or more, so no ratio says much."""
    r["stage"] = "autocast"  # a model that fails here in eager fails without opsnn_lab
    r["amp_out_err"], r["amp_grad_err"] = _amp_errors(step, model, fused, fp32)
    ratios = [amp_ratio(r["amp_out_err"], r["amp_grad_err"])]
    if ratios[0] > AMP_FACTOR:
        for other in others:
            try:
                model.train()
                ratios.append(amp_ratio(*_amp_errors(other, model, fused, other(model))))
            except Exception as exc:  # noqa: BLE001 - an input the model refuses: the verdict from the others
                r.setdefault("amp_recheck_errors", []).append(f"{type(exc).__name__}: {str(exc)[:200]}")
        r["amp_ratios"] = ratios
    r["amp_ratio"] = statistics.median(ratios)
    if max(r["amp_out_err"]["eager"], r["amp_grad_err"]["eager"]) >= AMP_NO_PRECISION:
        r["amp_no_precision"] = True


def _amp_errors(step, model, fused, fp32):
    outs_a, g_a = fp32
    model.train()
    fused.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs_e, g_e = step(model)
        outs_f, g_f = step(fused)
    largest = largest_finite(g_a)
    return ({"eager": _rel(outs_e, outs_a), "fused": _rel(outs_f, outs_a)},
            {"eager": _rel(g_e, g_a, largest), "fused": _rel(g_f, g_a, largest)})


def amp_ratio(out_err: dict, grad_err: dict) -> float:
    """The fused bf16 step's error over eager's, the worse of outputs and gradients."""
    return max(_over_eager(out_err), _over_eager(grad_err))


def _over_eager(err: dict) -> float:
    return err["fused"] / max(err["eager"], 1e-30)


def other_inputs(inputs, n: int = 3) -> list:
    """``n`` other inputs like ``inputs`` (a tensor, or a dict of keyword arguments): floating tensors of two or more
    dims drawn again from a normal distribution of their own mean and spread, token ids (``*input_ids``) drawn again
    below their largest; masks, labels, timesteps and the rest as they are."""
    def again(key, v, g):
        if not isinstance(v, torch.Tensor):
            return v
        if v.is_floating_point() and v.dim() >= 2 and v.numel() > 1:
            fresh = torch.randn(v.shape, generator=g, dtype=torch.float64)
            return (fresh * v.double().std() + v.double().mean()).to(v.dtype)
        if key.endswith("input_ids") and not v.is_floating_point() and v.numel():
            return torch.randint(0, int(v.max()) + 1, v.shape, generator=g, dtype=v.dtype)
        return v

    out = []
    for seed in range(1, n + 1):
        g = torch.Generator().manual_seed(seed)
        out.append({k: again(k, v, g) for k, v in inputs.items()} if isinstance(inputs, dict) else again("", inputs, g))
    return out


_UNFUSED_AT_RUN = ("changed after", "has a hook added after", "was fused for other arguments")


@contextlib.contextmanager
def unfused_at_run(r: dict):
    """Warnings silenced, except that ``r["ran_unfused"]`` lists each fused chain or region that ran unfused at a
    call of the checks (a hook added after fusion, a setting changed since: ``staleness.warn_hooked``,
    ``staleness.warn_changed``; a region that cannot be traced for a call's values: ``FxForward._alternate``). The
    checks change none of them, so any is a bug, as a failed rewrite is."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            said = {str(w.message).split(";")[0] for w in seen if str(w.message).startswith("opsnn_lab.fusion: ")
                    and any(k in str(w.message) for k in _UNFUSED_AT_RUN)}
            if said:
                r["ran_unfused"] = sorted(said)


def check(name: str, dtype: torch.dtype, r: dict, autocast: bool = False, running=build_running,
          no_cache: bool = False, call_no_cache: bool = False, checkpointing: bool = False) -> None:
    """Fill ``r``; ``r["stage"]`` is where an exception left it ("build"/"eager": the model itself).
    ``running(name, dtype, r)``: the model and its keyword inputs, run once (diffusers_sweep.py hands its own).
    ``no_cache``: ``use_cache = False`` in the model's configs before fusion (training scripts set it).
    ``call_no_cache``: fused on the example as it is, checked on calls passing ``use_cache=False`` (what a training
    script passes to a model fused on a default call: the regions' code traced for it at its first call).
    ``checkpointing``: activation checkpointing on before fusion (``enable_checkpointing``). The plan's bytes are
    checked against the step's either way (``r["bytes"]``)."""
    with unfused_at_run(r):
        model, inputs = running(name, dtype, r)
        if no_cache:
            without_cache(model)
        if checkpointing:
            r["stage"] = "checkpointing"
            enable_checkpointing(model)
        fused = fuse_recorded(model, inputs, r)
        step_bytes(lambda m: sum(o.sum() for o in _run(m, inputs)), model, fused, r)
        if call_no_cache and "use_cache" in inspect.signature(model.forward).parameters:
            inputs = {**inputs, "use_cache": False}
            r["called_with"] = "use_cache=False"
        r["stage"] = "train"
        (outs_a, g_a), (outs_b, g_b) = (_train_step(m, inputs) for m in (model, fused))
        largest = largest_finite(g_a)  # a gradient 0 by symmetry is noise
        r["out_err"], r["grad_err"] = _rel(outs_b, outs_a), _rel(g_b, g_a, largest)
        r["stage"] = "eval"
        model.eval()
        fused.eval()
        with torch.no_grad():
            extra = {"output_hidden_states": True, "output_attentions": True}
            try:
                want = _run(model, inputs, **extra)
            except Exception:  # noqa: BLE001 - a model without those outputs
                extra, want = {}, _run(model, inputs)
            r["eval_err"] = _rel(_run(fused, inputs, **extra), want)
        with torch.inference_mode():
            r["inference_err"] = _rel(_run(fused, inputs), _run(model, inputs))
        if autocast:  # last: its updates of BatchNorm running statistics differ between the two models
            autocast_errors(lambda m: _train_step(m, inputs), model, fused, (outs_a, g_a), r,
                            [lambda m, i=i: _train_step(m, i) for i in other_inputs(inputs)])
    del r["stage"]


def enable_checkpointing(model) -> None:
    """Activation checkpointing on as the model's library turns it on: Hugging Face's
    ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before it), diffusers'
    ``enable_gradient_checkpointing()``, timm's ``set_grad_checkpointing()``; a wrapper's model held as ``.vae``
    (diffusers_sweep.EncodeDecode) through it. ``ValueError`` where the model has none of these."""
    inner = getattr(model, "vae", model)
    if getattr(inner, "supports_gradient_checkpointing", False):  # Hugging Face
        on = getattr(inner, "activation_checkpointing_enable", None) or inner.gradient_checkpointing_enable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "use_cache=True is incompatible with gradient checkpointing"
            on()
    elif getattr(inner, "_supports_gradient_checkpointing", False):  # diffusers
        inner.enable_gradient_checkpointing()
    elif hasattr(inner, "set_grad_checkpointing"):  # timm
        inner.set_grad_checkpointing(True)
    else:
        raise ValueError(f"{type(inner).__name__} has no activation checkpointing to turn on")


def step_bytes(loss, model, fused, r: dict) -> None:
    """``r["bytes"]``: the activation bytes a step of ``loss(m)`` keeps, eager and fused, beside the plan's figures
    (``r["plan_bytes"]``): what the plan says fusion saves, and the eager total, each as the step measures it."""
    from opsnn_lab.measuring import activation_bytes

    r["stage"] = "bytes"
    eager, kept = (activation_bytes(lambda m=m: loss(m), exclude=tuple(m.parameters())) for m in (model, fused))
    r["bytes"] = {"saved": eager - kept, "eager": eager}


def without_cache(model) -> None:
    """``use_cache = False`` in every config the model's modules hold that has it (nested ones too)."""
    seen, todo = set(), [m.config for m in model.modules() if hasattr(m, "config")]
    while todo:
        cfg = todo.pop()
        if id(cfg) in seen or not hasattr(cfg, "to_dict"):
            continue
        seen.add(id(cfg))
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        todo.extend(v for v in vars(cfg).values() if hasattr(v, "to_dict"))


def model_names(arg: str) -> list[str]:
    """``--models``: comma-separated names; "" for the list above; "all" for it and every other text LM."""
    if arg not in ("", "all"):
        return arg.split(",")
    names = TEXT + VIT_LIKE + VISION_DEFAULT
    others = [*every_text_lm(), *every_image_classifier()]
    return names + [n for n in dict.fromkeys(others) if n not in names] if arg == "all" else names


def run_sweep(names, check_one, line, out: str = "") -> dict:
    """``check_one(name, record)`` per model (an exception is recorded with the stage it left, and the sweep goes
    on); prints ``line(record)`` per model; writes every record as JSON to ``out`` when given, after each model: a
    process that dies (a segfault in a native kernel, the OOM killer) leaves the records so far, and the model it
    was running recorded as started."""
    torch.set_num_threads(1)
    results = {}
    for name in tqdm(names, desc="models", unit="model"):
        t0, r = time.perf_counter(), results.setdefault(name, {})
        _write(out, {**results, name: {"stage": "started; the process ended inside this model"}})
        try:
            check_one(name, r)
        except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
            r["error"] = f"{r['stage']}: {type(exc).__name__}: {str(exc)[:300]}"
            r["trace"] = traceback.format_exc()[-2000:]
        r["seconds"] = round(time.perf_counter() - t0, 1)
        tqdm.write(f"{name:20s} {(r.get('error') or line(r))[:150]}")
        _write(out, results)
    return results


def _write(out: str, results: dict) -> None:
    """``results`` as JSON at ``out`` (nothing when ``out`` is empty), replaced whole: never half written."""
    if out:
        with open(f"{out}.part", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(f"{out}.part", out)


def _line(r: dict) -> str:
    errs = ("out_err", "grad_err", "eval_err", "inference_err")
    line = f"fused {len(r['fused']):4d}  " + ", ".join(f"{k} {r[k]:.1e}" for k in errs)
    if "amp_out_err" in r:  # fused / eager error of the bf16 step against the fp32 one: outputs, gradients
        line += "  bf16 x" + "/".join(f"{_over_eager(r[k]):.2f}" for k in ("amp_out_err", "amp_grad_err"))
        if "amp_ratios" in r:
            line += f" (median of {len(r['amp_ratios'])} inputs x{r['amp_ratio']:.2f})"
        if r.get("amp_no_precision"):
            line += f" (eager's own bf16 error >= {AMP_NO_PRECISION})"
    if "bytes" in r:
        line += "  plan = step" if r["bytes"] == r["plan_bytes"] else \
            f"  PLAN {r['plan_bytes']} != STEP {r['bytes']}"
    if r.get("ran_unfused"):
        line = f"{len(r['ran_unfused'])} RAN UNFUSED, " + line
    if r.get("rewrite_failed"):  # first: the printed line is cut at 150 characters (the JSON has the reasons)
        line = f"{len(r['rewrite_failed'])} fx REWRITES FAILED, " + line
    return line


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """``--models`` (see ``model_names``) and ``--out``, the arguments every sweep takes."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: hf_sweep.py's list; all: "
                    "those and every other causal or masked LM and image classifier class of the installed "
                    "transformers)")
    ap.add_argument("--out", default="", help="write the details as JSON here")
    return ap


def add_checkpointing_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on before fusion, as the "
                    "model's library turns it on")


def main(argv=None) -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--autocast", action="store_true", help="also a training step under bf16 autocast, eager and "
                    "fused, each against the float32 eager step")
    ap.add_argument("--no-cache", action="store_true", help="use_cache=False in the configs before fusion")
    ap.add_argument("--call-no-cache", action="store_true", help="fused on the default call, checked on calls "
                    "passing use_cache=False")
    add_checkpointing_flag(ap)
    args = ap.parse_args(argv)
    if args.autocast and args.dtype != "float32":
        ap.error("--autocast compares with the float32 step: use it with --dtype float32")
    dtype = getattr(torch, args.dtype)
    run_sweep(model_names(args.models), lambda name, r: check(name, dtype, r, args.autocast, no_cache=args.no_cache,
                                                              call_no_cache=args.call_no_cache,
                                                              checkpointing=args.checkpointing), _line, args.out)


if __name__ == "__main__":
    main()
