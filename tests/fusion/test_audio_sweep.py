"""scripts/audio_sweep.py, the sweep of Hugging Face's speech models, on three of them: a Conformer whose convolution
module fuses as ``conv_bn_<act>`` and whose positional conv holds a weight-norm parametrization (torch pickles that
only through its state_dict: recorded, not a failure), Parakeet's FastConformer, and Whisper."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tests.fusion._sweeps import clean_records, sweep

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "audio_sweep.py"


def test_the_audio_sweep_fuses_the_speech_models_and_checks_them(tmp_path, capsys):
    assert {"Wav2Vec2ForCTC", "Wav2Vec2ConformerForCTC", "ParakeetForCTC",
            "WhisperForConditionalGeneration"} <= set(sweep("audio_sweep.py")["audio_models"]())
    names = ["Wav2Vec2ConformerForCTC", "ParakeetForCTC", "WhisperForConditionalGeneration"]
    results = clean_records("audio_sweep.py", names, tmp_path, tol=1e-12)
    assert results["Wav2Vec2ConformerForCTC"]["fused"].count("conv_bn_gelu@module") == 2
    assert results["ParakeetForCTC"]["fused"].count("conv_bn_silu@module") == 2
    assert "does not pickle" in results["Wav2Vec2ConformerForCTC"]["pickled"]
    assert "pickled" not in results["ParakeetForCTC"]
    assert "ParakeetForCTC" in capsys.readouterr().out


def test_the_consistency_sweep_takes_the_audio_models(tmp_path):
    main = runpy.run_path(str(SCRIPT.with_name("hf_consistency_sweep.py")))["main"]
    out = tmp_path / "consistency.json"
    main(["--audio", "--models", "Wav2Vec2ConformerForCTC", "--strict", "--out", str(out)])
    r = json.loads(out.read_text())["Wav2Vec2ConformerForCTC"]
    assert "error" not in r and r["dropouts"] > 0 and r["fused"] > 0, r
    assert r["repeat_consistent"] and r["fused_repeat_equal"], r  # reproducible dropout, fused and not
    assert r["strict_threads_bitwise"] and r["strict_fused_threads_bitwise"], r
    assert r["out_err"] < 1e-6 and r["grad_err"] < 1e-5, r
