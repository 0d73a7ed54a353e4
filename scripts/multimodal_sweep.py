"""Fuse Hugging Face's multimodal and time-series models (built from small configs) and check them against eager.

Every class of the installed transformers' auto mappings for image-text-to-text generation (LLaVA, PaliGemma,
Idefics, Qwen2-VL, SmolVLM, BLIP-2, GIT, Pix2Struct, Kosmos-2, Florence-2...), visual question answering, zero-shot
image classification (the dual encoders: CLIP, SigLIP, ALIGN, AltCLIP, Chinese-CLIP...) and time-series
classification, regression and prediction, plus every ``<Family>For*`` head of a time-series family (a config with a
``prediction_length``: Informer, Autoformer, TimeSeriesTransformer). Each is built from its default config made
small (1-2 layers 16-64 wide, nested configs too, every special token id moved into a 128-token vocabulary, dropouts
0, experts run one by one) and run on 2 samples: 32 px images in 8 px patches laid out as its forward asks (patch
grids, tiles, frames), a prompt holding as many image tokens as its own ``get_image_features`` gives (as a processor
would insert them), between the start / end tokens its config names, labelled with itself; a time series of 16 steps
(and the lags before them) with its time features, forecasting 4. Then ``hf_sweep.py``'s checks: one training step of
the fused model and of the original (outputs and every parameter gradient of a fixed random projection of them),
eval, ``inference_mode``, the fused model pickled. The same records and line as ``hf_sweep.py``, with ``image_tokens``
(a prompt's) and ``dtype`` where a model runs in another than asked (``FIXES``: its forward makes float32 tensors).

    python scripts/multimodal_sweep.py              # float64: errors are rounding (<= 1e-12)
    python scripts/multimodal_sweep.py --models CLIPModel,LlavaForConditionalGeneration,PatchTSTForPrediction
    python scripts/multimodal_sweep.py --list

GLM-5-Next's hyper-connections cast to float32 inside a float64 model, so its gradients differ by float32 rounding
(~5e-8). Classes whose default config does not build, that need timm, PIL or scipy, or whose inputs no builder here
makes (Molmo2's pooling indices, PI0's robot state and actions) are reported with the stage they failed at.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep
import timm_sweep as TS  # noqa: E402 - the command line, shared
from multimodal_inputs import (  # noqa: E402 - each family's inputs
    BATCH,
    PATCH,
    SIZE,
    V,
    image_id,
    series_inputs,
    vlm_inputs,
)

HEAD_DIM = 16  # where a config names it: partial rotary (a quarter, a half) still leaves M-RoPE three sections
MAX_PARAMETERS = 20_000_000  # float64, three copies (eager, fused, the one counting image tokens) and gradients
MAPPINGS = ("IMAGE_TEXT_TO_TEXT", "VISION_2_SEQ", "VISUAL_QUESTION_ANSWERING", "ZERO_SHOT_IMAGE_CLASSIFICATION",
            "TIME_SERIES_CLASSIFICATION", "TIME_SERIES_REGRESSION", "TIME_SERIES_PREDICTION")
# every int field of these names (nested configs too) takes the small value, where it is larger
SCALARS = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=HEAD_DIM, intermediate_size=64, projection_dim=32, d_model=32, image_size=SIZE,
               patch_size=PATCH, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_layers=2, n_layers=2,
               num_heads=4, d_ff=64, d_kv=8, ffn_dim=64, mlp_dim=64, embed_dim=32, hidden_dim=32, depth=2,
               # the widths a multimodal model joins: projectors, adapters, the text width a vision tower outputs
               out_hidden_size=32, text_hidden_size=32, vision_hidden_size=32, projector_hidden_size=32,
               projector_input_dim=32, projector_output_dim=32, vision_output_dim=32, text_embed_dim=32,
               vision_embed_dim=32, image_token_embed_dim=32, projection_hidden_size=32, projection_size=32,
               word_embed_proj_dim=32, adapter_in_dim=32, adapter_out_dim=32, adapter_input_size=32,
               decoder_hidden_size=32, mm_embed_dim=32, output_proj_dims=32, output_channels=32,
               post_conv_in_channels=32, post_conv_mid_channels=32, post_conv_out_channels=32,
               patch_embed_hidden_size=3 * PATCH * PATCH, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
               # the image tokens a resampler or pooler makes
               num_query_tokens=4, mm_tokens_per_image=4, latent_query_num=4, num_image_tokens=(SIZE // PATCH) ** 2,
               # VQ image and audio tokenizers (a VQ-GAN's GroupNorm takes 32 groups)
               codebook_dim=32, codebook_size=16, base_channels=32, latent_channels=32,
               # mixtures of experts, latent and linear attention
               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
               n_routed_experts=4, num_experts_per_tok=2, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               kv_lora_rank=16, q_lora_rank=16, first_k_dense_replace=1, n_group=1, topk_group=1, qk_head_dim=16,
               index_head_dim=16, index_n_heads=4, linear_head_dim=8, linear_num_heads=4)
# list fields: one block a stage, widths doubling from 16, one head a stage; layer indices inside 2 layers
LISTS = dict(depths=lambda v: [1] * len(v), hidden_sizes=lambda v: [16 << i for i in range(len(v))],
             embed_dim=lambda v: [16 << i for i in range(len(v))], num_heads=lambda v: [1] * len(v),
             num_groups=lambda v: [1] * len(v), num_block_repeats=lambda v: [1] * len(v),
             downsample_channels=lambda v: [32] * len(v), image_grid_pinpoints=lambda v: [[SIZE, SIZE]],
             deepstack_visual_indexes=lambda v: [0, 1][:len(v)], global_attn_indexes=lambda v: [1],
             cross_attention_layers=lambda v: [1], kv_source_layers=lambda v: [0, 1],
             vision_feature_layer=lambda v: [max(min(i, 1), -2) for i in v])
# the time-series families: a short context, a short horizon, lags that fit it
SERIES = dict(prediction_length=4, context_length=16, lags_sequence=[1, 2, 3], num_time_features=1)
DROPPED = {"transformers_version", "architectures", "dtype"}
TOKEN_KEYS = ("token_id", "token_index", "token_ids", "_token")
QWEN_OMNI = dict(vision_start_token_id=151652, vision_end_token_id=151653)  # the thinker reads them, lacks them
MINICPM = dict(image_token_id=50, insert_layer_id=1)  # no image token by default; the vision merge inside 2 layers
# per class: config fields (a nested config's dict changes its fields, one with a "model_type" adds a config the
# defaults lack); "_layout": how its images are laid out where the forward's parameters do not say ("patches": 8 x 8
# patches, "flat": flattened ones, "tokens_last": a merged block of them, channels last, "video": frames, "tiles":
# images per sample with a tile mask); "_image_tokens": a prompt's image tokens where its image features do not say;
# "_float32": its own forward makes float32 tensors (a float32 router, a mask filled with float32's minimum), so
# float64 runs as float32
FIXES: dict[str, dict] = {
    "Apertus1p5ForConditionalGeneration": dict(image_token_offset=32, audio_token_offset=48),  # 16 codes each
    "AriaForConditionalGeneration": dict(projector_patch_to_query_dict={16: 4}),
    "Blip2ForConditionalGeneration": dict(image_token_index=50),  # the query outputs in the prompt, not before it
    "InstructBlipForConditionalGeneration": dict(image_token_index=50),
    "InstructBlipVideoForConditionalGeneration": dict(video_token_index=50, _layout="video"),
    "Blip2ForImageTextRetrieval": dict(qformer_config=dict(use_qformer_text_input=True)),
    "DeepseekOcr2ForConditionalGeneration": dict(text_config=dict(  # its defaults leave the routing unset
        mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2, n_group=1, topk_group=1)),
    "Dots3NoteForConditionalGeneration": dict(text_config=dict(num_key_value_heads=4)),
    "FuyuForCausalLM": dict(_layout="flat"),
    "Gemma4ForConditionalGeneration": dict(vision_config=dict(model_type="gemma4_vision", pooling_kernel_size=2)),
    "Gemma4UnifiedForConditionalGeneration": dict(vision_config=dict(model_type="gemma4_unified_vision",
                                                                     pooling_kernel_size=2)),
    "Glm5NextForConditionalGeneration": dict(text_config=dict(num_key_value_heads=4)),
    "GraniteDoclingForConditionalGeneration": dict(_layout="tiles"),
    "Inkling2ForConditionalGeneration": dict(_layout="tokens_last", _float32=True),
    "Inkling2LoopForConditionalGeneration": dict(_layout="tokens_last", _float32=True),
    "Kimi_K25ForConditionalGeneration": dict(_layout="patches"),
    "Kosmos2ForConditionalGeneration": dict(_float32=True),
    "Llama4ForConditionalGeneration": dict(vision_config=dict(intermediate_size=128)),  # 2 x 2 pixel shuffle of 32
    "MiniCPMOcrForConditionalGeneration": MINICPM, "MiniCPMV4_6ForConditionalGeneration": MINICPM,
    "MiniCPMV4_7ForConditionalGeneration": MINICPM,
    "MllamaForConditionalGeneration": dict(_image_tokens=1, vision_config=dict(  # its output: 2 layers' states
        intermediate_layers_indices=[1], vision_output_dim=64, num_global_layers=1)),
    "MuseGlimmerForConditionalGeneration": dict(out_hidden_size=128),  # the vision width, 2 x 2 patches merged
    "MuseSparkForConditionalGeneration": dict(out_hidden_size=128, audio_config=dict(
        patch_sizes=[16, 4], hidden_sizes=[16, 32], depths=[1, 1])),
    "NemotronH_Omni_Reasoning_V3": dict(image_token_id=50),
    "PaddleOCRVLForConditionalGeneration": dict(_layout="patches"),
    "Qwen2_5OmniThinkerForConditionalGeneration": QWEN_OMNI, "Qwen3OmniMoeThinkerForConditionalGeneration": QWEN_OMNI,
    "Step3p7ForConditionalGeneration": dict(text_config=dict(sliding_window=8)),
    "UdopForConditionalGeneration": dict(decoder_start_token_id=0),
    "UnlimitedOcrForConditionalGeneration": dict(text_config=dict(num_key_value_heads=4)),
    "VisionEncoderDecoderModel": dict(decoder_start_token_id=0, pad_token_id=0),
    "AlignModel": dict(vision_config=dict(width_coefficient=0.1, depth_coefficient=0.25)),  # its last stage 32 wide
    "AutoformerForPrediction": dict(_float32=True),
    "TimesFm2_5ModelForPrediction": dict(context_length=64, horizon_length=16, output_quantile_len=16,
                                         max_position_embeddings=64),
}


def multimodal_models() -> list[str]:
    """The classes of ``MAPPINGS``, then the heads of the time-series families, deduplicated, the ``Auto*`` classes
    left out (not Autoformer)."""
    import transformers as T
    from transformers.models.auto import configuration_auto as C
    from transformers.models.auto import modeling_auto as M

    names = []
    for m in MAPPINGS:
        for v in getattr(M, f"MODEL_FOR_{m}_MAPPING_NAMES", {}).values():
            names += [v] if isinstance(v, str) else list(v)
    for kind, config in C.CONFIG_MAPPING_NAMES.items():
        cfg = getattr(T, config, None)
        base = M.MODEL_MAPPING_NAMES.get(kind)
        if cfg is None or not isinstance(base, str) or "prediction_length" not in inspect.signature(cfg).parameters:
            continue
        stem = base.removesuffix("Model")
        names += sorted(n for n in dir(T) if n.startswith(stem + "For"))
    return [n for n in dict.fromkeys(names) if not n.startswith(("AutoModel", "AutoConfig"))]


def _shrunk(d: dict, fixes: dict, config=None) -> dict:
    """A config's ``to_dict()`` with the small sizes, only the fields ``config`` (its class) takes (not those it
    derives); nested configs (dicts with a ``model_type``) and plain dicts (rope parameters) too; a per-layer list
    keeps its first and last entries (sliding and full attention)."""
    import transformers as T

    if config is None and d.get("model_type") in T.CONFIG_MAPPING:
        config = T.CONFIG_MAPPING[d["model_type"]]
    takes = set(inspect.signature(config.__init__).parameters) | {"model_type"} if config else set(d)
    named = {v: k for k, v in getattr(config, "attribute_map", {}).items() if k in takes}  # n_layers: its parameter
    d = {named.get(k, k): v for k, v in d.items()}
    layers = next((d[k] for k in ("num_hidden_layers", "depth") if isinstance(d.get(k), int)), None)
    out = {}
    for k, v in d.items():
        if k not in takes or k in DROPPED:
            continue
        if isinstance(v, dict):
            out[k] = _shrunk(v, fixes.get(k, {})) if k not in ("id2label", "label2id") else v
        elif k in SCALARS and isinstance(v, int) and not isinstance(v, bool):
            out[k] = min(v, SCALARS[k])  # never larger: 0 stays (no RoPE), 1 stays (one key-value head)
        elif k in LISTS and isinstance(v, list):
            out[k] = LISTS[k](v)
        elif isinstance(v, list) and layers and len(v) == layers > 2:
            out[k] = [v[0], v[-1]]
        else:
            out[k] = v
    out.update({k: v for k, v in SERIES.items() if k in out and "prediction_length" in out})
    if out.get("kv_lora_rank") and "num_attention_heads" in out:  # latent attention expands keys to every head
        out["num_key_value_heads"] = out["num_attention_heads"]
    if config:
        _rope_sections(out, config)
    for k, v in fixes.items():
        if isinstance(v, dict) and "model_type" in v and not isinstance(d.get(k), dict):  # a config it lacks
            out[k] = _shrunk({**T.CONFIG_MAPPING[v["model_type"]]().to_dict(), **v}, {})
        elif not (isinstance(v, dict) and isinstance(d.get(k), dict)):
            out[k] = v
    return out


def _special_tokens(d: dict, ids: dict) -> None:
    """Every special token id of ``d`` (nested too) above 2 moved to the top of the vocabulary, the same id to the
    same place (a text config's image token is its parent's)."""
    def moved(i):
        return ids.setdefault(i, V - 1 - len(ids)) if isinstance(i, int) and not isinstance(i, bool) and i > 2 else i

    for k, v in d.items():
        if isinstance(v, dict) and k not in ("id2label", "label2id"):
            _special_tokens(v, ids)
        elif not isinstance(k, str) or isinstance(v, dict):
            continue
        elif k.endswith(TOKEN_KEYS) and isinstance(v, list):
            d[k] = [moved(i) for i in v]
        elif k.endswith(TOKEN_KEYS):
            d[k] = moved(v)


def small_config(cls, fixes: dict):
    """``cls.config_class``'s defaults made small, then ``fixes``; mixtures of experts run expert by expert (the
    grouped GEMM has no float64 kernel)."""
    d = _shrunk(cls.config_class().to_dict(), {k: v for k, v in fixes.items() if not k.startswith("_")},
                cls.config_class)
    d.pop("model_type", None)
    _special_tokens(d, {})
    cfg = cls.config_class(**d)
    for c in _configs(cfg):
        c._experts_implementation = "eager"
    return cfg


def _configs(cfg):
    """``cfg`` and every config nested in it."""
    yield cfg
    for v in list(vars(cfg).values()):
        if hasattr(v, "to_dict") and hasattr(v, "model_type"):
            yield from _configs(v)


def _rope_sections(d: dict, config) -> None:
    """M-RoPE's (time, height, width) sections sum to half the rotary width: set in a config dict ``d`` of a class
    that has them (its default, or the modeling code's, is for a 128 wide head); equal height and width sections
    (ERNIE-VL stacks them), time takes the rest."""
    rope = d.get("rope_parameters")
    if "vocab_size" not in d or not rope or not isinstance(rope, dict) or any(isinstance(v, dict) for v in
                                                                              rope.values()):  # a text config's
        return
    sources = (config.__module__, config.__module__.replace(".configuration_", ".modeling_"))
    if "mrope_section" not in rope and not any(importlib.util.find_spec(m) and "mrope_section" in inspect.getsource(
            importlib.import_module(m)) for m in sources):
        return
    head = d.get("qk_rope_head_dim") or d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    half = int(head * (rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0)) // 2
    n = len(rope.get("mrope_section") or [0, 0, 0])
    step = 2 if half >= 2 * n else 1
    d["rope_parameters"] = {**rope, "mrope_section": [step] * (n - 1) + [half - step * (n - 1)]}


def build(name: str, dtype: torch.dtype, dropout: float = 0.0):
    """The model (train mode, ``dtype``) and its keyword inputs."""
    import transformers as T

    cls = getattr(T, name)
    cfg = S.eager_with_dropout(small_config(cls, FIXES.get(name, {})), dropout)
    with torch.device("meta"):  # a size the small config did not reach (a field of another name) would fill memory
        size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the small config still gives {size / 1e6:.0f}M parameters (> {MAX_PARAMETERS / 1e6:.0f}M)")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if FIXES.get(name, {}).get("_float32") and dtype == torch.float64:
        dtype = torch.float32
    model = cls(cfg).to(dtype).train()
    takes = set(inspect.signature(model.forward).parameters)
    if "past_values" in takes:
        inputs = series_inputs(model, cfg, takes, g)
    else:
        inputs = vlm_inputs(model, cfg, takes, FIXES.get(name, {}), g)
    return model, {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def running(name: str, dtype: torch.dtype, r: dict, dropout: float = 0.0):
    """``hf_sweep.build_running`` for these models: built (stage "build") and run once (stage "eager")."""
    r["stage"] = "build"
    model, inputs = build(name, dtype, dropout)
    if model.dtype != dtype:
        r["dtype"] = str(model.dtype).removeprefix("torch.")
    image = image_id(model.config, set(inspect.signature(model.forward).parameters))
    if image is not None and "input_ids" in inputs:  # a prompt's image tokens, counted from its features
        r["image_tokens"] = int((inputs["input_ids"] == image).sum()) // BATCH
    r["stage"] = "eager"
    S._run(copy.deepcopy(model), inputs)  # on a copy, as ``_image_tokens``
    return model, inputs


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, multimodal_models, running=running)


if __name__ == "__main__":
    main()
