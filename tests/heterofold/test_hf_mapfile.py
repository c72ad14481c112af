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


def test_a_damaged_map_is_named_not_a_traceback(tmp_path, tiny_models, tokenizers, texts):
    import shutil

    S, R = tiny_models["llama"], tiny_models["qwen3"]
    samples = collect(S, R, tokenizers["llama"], tokenizers["qwen3"], texts[:8])
    m, _ = fit(S, R, samples[:6], samples[6:], FitConfig(epochs=1, calibrate_k=False, calibrate_v=False),
               progress=False)
    mapfile.save(m, tmp_path / "good", {}, {}, "calib-hash")
    for damage, message in (("map.json", "map.json is damaged"), ("map.safetensors", "map.safetensors cannot be read")):
        bad = tmp_path / damage
        shutil.copytree(tmp_path / "good", bad)
        (bad / damage).write_bytes((bad / damage).read_bytes()[:20])
        with pytest.raises(mapfile.MapMismatch, match=message):
            mapfile.load(bad)


def test_calibration_without_held_out_prompts_is_refused(tiny_models, tokenizers, texts):
    S, R = tiny_models["llama"], tiny_models["qwen3"]
    samples = collect(S, R, tokenizers["llama"], tokenizers["qwen3"], texts[:4])
    with pytest.raises(ValueError, match="calibration needs held-out prompts"):
        fit(S, R, samples, [], FitConfig(epochs=1), progress=False)


def test_calibration_prompts_must_fit_in_the_split(tmp_path):
    import json

    from heterofold.pipeline import calibration_texts

    docs = [f"document {i} " + "text " * 60 for i in range(10)]
    (tmp_path / "corpus.json").write_text(json.dumps({"train": [], "calib": docs, "heldout": []}))
    train, held = calibration_texts(8, 2, root=tmp_path)
    assert len(train) == 8 and len(held) == 2
    for n_train, n_held in ((9, 2), (10, 0), (0, 2)):
        with pytest.raises(ValueError, match="the calib split holds 10"):
            calibration_texts(n_train, n_held, root=tmp_path)
