"""The map artifact round-trips (safetensors + JSON fingerprints) and refuses a map for another pair by name."""
import pytest
import torch

from heterofold import mapfile
from heterofold.calibrate import FitConfig, collect, fit



def test_roundtrip_and_mismatch_refusal(tmp_path, tiny_models, tokenizers, texts):
    S, R = tiny_models["llama"], tiny_models["qwen3"]
    samples = collect(S, R, tokenizers["llama"], tokenizers["qwen3"], texts[:8])
    m, _ = fit(S, R, samples[:6], samples[6:], FitConfig(epochs=1), progress=False)
    s_fp, r_fp = mapfile.fingerprint(S, tokenizers["llama"]), mapfile.fingerprint(R, tokenizers["qwen3"])
    mapfile.save(m, tmp_path / "map", s_fp, r_fp, "calib-hash")
    loaded = mapfile.load(tmp_path / "map", s_fp, r_fp)
    assert loaded.meta["calibration_hash"] == "calib-hash" and loaded.meta["sender"]["family"] == "llama"
    cap, pairs = samples[0].sender, samples[0].pairs
    for a, b in zip(m.apply(cap, pairs)[0], loaded.apply(cap, pairs)[0]):
        assert torch.allclose(a, b, atol=1e-4)

    M = tiny_models["mistral"]
    with pytest.raises(mapfile.MapMismatch, match="receiver family: map has 'qwen3', model has 'mistral'"):
        mapfile.load(tmp_path / "map", s_fp, mapfile.fingerprint(M, tokenizers["mistral"]))
    with pytest.raises(mapfile.MapMismatch, match="sender tokenizer_hash"):
        mapfile.load(tmp_path / "map", mapfile.fingerprint(S, tokenizers["mistral"]), r_fp)
    other = dict(r_fp, config_hash="0" * 16)
    with pytest.raises(mapfile.MapMismatch, match="receiver config_hash"):
        mapfile.load(tmp_path / "map", s_fp, other)
