"""Fuse Hugging Face's speech and audio models (built from small configs) and check them against eager.

Every ``<Name>ForCTC`` class of the installed transformers (wav2vec 2.0 and its kin, Conformers, Parakeet's
FastConformer...), the speech-to-text seq2seq models and the audio classifiers below, each from a config 2 layers
deep and 32 wide (nested encoder configs too), dropouts and SpecAugment masking at 0; then ``hf_sweep.py``'s checks:
one training step of the fused model and of the original (the outputs and every parameter gradient of a fixed
random projection of them), eval, ``inference_mode``, the fused model pickled (where the original pickles:
wav2vec 2.0's positional conv holds a weight-norm parametrization, which torch pickles only through its
``state_dict``). The same records and line as ``hf_sweep.py``.

    python scripts/audio_sweep.py                    # float64: errors are rounding (<= 1e-12)
    python scripts/audio_sweep.py --models Wav2Vec2ConformerForCTC,ParakeetForCTC --dtype float32 --autocast
    python scripts/audio_sweep.py --list
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_sweep as S  # noqa: E402 - the comparisons and the sweep loop of the Hugging Face sweep
import timm_sweep as TS  # noqa: E402 - the command line, shared

SAMPLES, FRAMES, MELS, LABELS = 1600, 64, 16, 3  # 0.1 s of 16 kHz audio; 64 feature frames of 16 mel bins
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
             intermediate_size=64, vocab_size=32, d_model=32, encoder_layers=2, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
             # the waveform encoders' feature convolutions: 1600 samples -> 159 frames
             conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
             num_conv_pos_embedding_groups=4, tdnn_dim=(16, 16), xvector_output_dim=16, output_hidden_size=32,
             # the feature-input encoders: mel bins, subsampling convolutions, Conformer convolution modules
             num_mel_bins=MELS, feature_size=MELS, input_feat_per_channel=MELS, conv_channels=16,
             subsampling_conv_channels=16, conv_depthwise_kernel_size=7, conv_kernel_size=7,
             max_source_positions=64, max_target_positions=64, max_position_embeddings=128,
             mask_time_prob=0.0, mask_feature_prob=0.0)
# speech-to-text and audio classification classes swept besides every ``*ForCTC`` one
OTHERS = ["WhisperForConditionalGeneration", "Speech2TextForConditionalGeneration",
          "MoonshineForConditionalGeneration", "ASTForAudioClassification", "WhisperForAudioClassification",
          "Wav2Vec2ForSequenceClassification", "HubertForSequenceClassification"]


def audio_models() -> list[str]:
    """Every ``*ForCTC`` class of the installed transformers, then ``OTHERS`` (those it has)."""
    import transformers as T

    ctc = sorted(n for n in dir(T) if n.endswith("ForCTC") and not n.startswith("Auto"))
    return ctc + [n for n in OTHERS if hasattr(T, n)]


def _small(cfg) -> None:
    """``SIZES`` into ``cfg`` and every nested config, where it has the field; token ids inside the small vocab."""
    for k, v in SIZES.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if hasattr(cfg, k):  # None too: a seq2seq model shifts its labels with the pad id
            setattr(cfg, k, 1)
    for v in list(vars(cfg).values()):
        if hasattr(v, "to_dict") and hasattr(v, "model_type"):
            _small(v)


def _inputs(model, cfg, g) -> dict:
    """The input the model's forward takes first: a waveform, or feature frames laid out as its config says."""
    name = model.main_input_name
    enc = getattr(cfg, "encoder_config", None) or cfg
    if name == "input_values" and hasattr(cfg, "max_length"):  # AST: a spectrogram of max_length frames
        return {name: torch.randn(2, cfg.max_length, cfg.num_mel_bins, generator=g)}
    if name == "input_values":
        return {name: torch.randn(2, SAMPLES, generator=g)}
    width = next(getattr(enc, k) for k in ("feature_projection_input_dim", "num_mel_bins", "input_feat_per_channel",
                                           "feature_size") if isinstance(getattr(enc, k, None), int))
    if "Whisper" in type(model).__name__:  # mel bins first, 2 frames a source position
        return {name: torch.randn(2, width, 2 * cfg.max_source_positions, generator=g)}
    return {name: torch.randn(2, FRAMES, width, generator=g),
            "attention_mask": torch.ones(2, FRAMES, dtype=torch.long)}  # the CTC loss reads the frames' lengths


def build(name: str, dtype: torch.dtype, dropout: float = 0.0):
    """The model (train mode, ``dtype``) and its keyword inputs, with labels for its own loss; every dropout of its
    configs ``dropout`` (``hf_consistency_sweep.py --audio`` draws them)."""
    import transformers as T

    cls = getattr(T, name)
    params = inspect.signature(cls.config_class.__init__).parameters
    try:
        cfg = cls.config_class(**{k: v for k, v in SIZES.items() if k in params})
    except Exception:  # noqa: BLE001 - sizes its nested defaults contradict (a vocabulary both must share)
        cfg = cls.config_class()
    _small(cfg)
    S.eager_with_dropout(cfg, dropout)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = cls(cfg)
    inputs = _inputs(model, cfg, g)
    if name.endswith("ForCTC"):
        inputs["labels"] = torch.randint(2, 30, (2, LABELS), generator=g)
    elif name.endswith("ForConditionalGeneration"):
        inputs["labels"] = torch.randint(2, 30, (2, 5), generator=g)
    model = model.to(dtype).train()
    return model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def running(name: str, dtype: torch.dtype, r: dict, dropout: float = 0.0):
    """``hf_sweep.build_running`` for these models: built (stage "build") and run once (stage "eager")."""
    r["stage"] = "build"
    model, inputs = build(name, dtype, dropout)
    r["stage"] = "eager"
    S._run(model, inputs)
    return model, inputs


def main(argv=None) -> None:
    TS.sweep_main(argv, __doc__, audio_models, running=running)


if __name__ == "__main__":
    main()
