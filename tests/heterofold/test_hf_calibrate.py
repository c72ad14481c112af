"""Output-aware calibration lowers the held-out loss on a tiny pair, and the fitted map runs end to end."""

from heterofold.baselines import fit_method
from heterofold.calibrate import FitConfig, collect, fit
from heterofold.evaluate import Direction, EvalConfig, evaluate, make_items
from heterofold.zoo import ZooModel



def _samples(tiny_models, tokenizers, TEXTS, s="mistral", r="qwen3"):
    texts = [a + " " + b for a, b in zip(TEXTS[:14], TEXTS[5:19])]
    return collect(tiny_models[s], tiny_models[r], tokenizers[s], tokenizers[r], texts)


def test_calibration_lowers_held_out_loss(tiny_models, tokenizers, texts):
    samples = _samples(tiny_models, tokenizers, texts)
    m, curves = fit(tiny_models["mistral"], tiny_models["qwen3"], samples[:10], samples[10:],
                    FitConfig(epochs=4), progress=False)
    assert len(m.layers) == tiny_models["qwen3"].layers
    assert set(curves) == {f"{l}.{r}" for l in range(3) for r in "kv"}
    for key, curve in curves.items():                 # curve[0] = Recolor init, then one value per epoch
        assert min(curve[1:]) < curve[0], key


def test_fitted_map_shapes_and_end_to_end_eval(tiny_models, tokenizers, texts, tiny_specs):
    S, R = tiny_models["llama"], tiny_models["mistral"]
    samples = _samples(tiny_models, tokenizers, texts, "llama", "mistral")
    methods = {"text_reprefill": None}
    for name in ("heterofold", "kv_ridge_ta", "dense_latent_ta", "abl_index_pairing", "abl_head_local"):
        methods[name] = fit_method(name, S, R, samples[:10], samples[10:])[0]
    hm = methods["heterofold"]
    assert all(l.k.A.shape == (len(l.sender_layers) * S.d_kv, R.d_kv) for l in hm.layers)
    s = ZooModel(tiny_specs["llama"], S.model, tokenizers["llama"])
    r = ZooModel(tiny_specs["mistral"], R.model, tokenizers["mistral"])
    docs = [" ".join(texts[i:i + 9]) for i in range(6)]
    rows = evaluate(Direction(s, r), methods, make_items(docs, EvalConfig(n_docs=2, context_chars=300, n_mc=1, n_recon=1)),
                    progress=False)
    by = {row["method"]: row for row in rows}
    assert by["text_reprefill"]["next_token_kl"] < 1e-6 and by["text_reprefill"]["top1_agreement"] == 1.0
    assert all(row["next_token_kl"] >= -1e-9 and 0 <= row["top1_agreement"] <= 1 for row in rows)


def test_query_span_scores_only_the_last_rows(tiny_models, tokenizers, texts):
    """The calibration targets at the question span are the last rows of the full causal attention, and the
    receiver's own K/V give zero loss there."""
    import torch
    from heterofold.calibrate import _Targets, k_loss, v_loss

    R, s = tiny_models["qwen3"], _samples(tiny_models, tokenizers, texts)[0]
    full, span = _Targets(R, 1, s, 0), _Targets(R, 1, s, 4)
    T = full.p.shape[1]
    assert span.p.shape[1:] == (4, T) and torch.allclose(span.p, full.p[:, T - 4:], atol=1e-6)
    assert torch.allclose(span.o, full.o[:, T - 4:], atol=1e-5)
    assert float(k_loss(R, 1, span, s.receiver.k[1])) < 1e-6
    assert float(v_loss(R, span, s.receiver.v[1])) < 1e-10
    assert _Targets(R, 1, s, T + 5).p.shape[1] == T          # a span longer than the prompt: every row


def test_calibration_with_mapped_span_keys_lowers_held_out_loss(tiny_models, tokenizers, texts):
    """The seed's setting (the question span's own K/V mapped too) also calibrates."""
    samples = _samples(tiny_models, tokenizers, texts)
    _, curves = fit(tiny_models["mistral"], tiny_models["qwen3"], samples[:10], samples[10:],
                    FitConfig(epochs=4, span_keys="mapped", query_span=4), progress=False)
    for key, curve in curves.items():
        assert min(curve[1:]) < curve[0], key


def test_selection_items_score_the_last_receiver_tokens_of_each_prompt(tokenizers, texts):
    from heterofold.evaluate import selection_items

    tok = tokenizers["mistral"]
    prompts = [" ".join(texts[i:i + 4]) for i in range(3)] + ["too short"]
    items = selection_items(prompts, tok, scored=8)
    assert items["mc"] == [] and items["recon"] == [] and len(items["lm"]) == 3
    for (ctx, tail), prompt in zip(items["lm"], prompts):
        assert ctx + tail == prompt
        assert list(tok.encode(ctx)[1]) == list(tok.encode(prompt)[1][:-8])   # the context ends where the last 8 begin
