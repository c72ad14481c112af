"""`--engine onnxruntime`: the same Triton models on the exported ONNX graphs answer with the torch engine's
greedy tokens, explicit and routed turns alike."""

from __future__ import annotations

from ced.engines import ensure_onnx_engine

from test_disaggregated import TURNS, comparable, conversation


def test_onnxruntime_engine_serves_the_same_tokens(server, start_server, repository, served_dir):
    ensure_onnx_engine(served_dir / "model")  # once, as `mol2 serve --engine onnxruntime` does before starting
    torch_answers = conversation(server, TURNS)
    with start_server(repository, store="ort-store", log="ort.log", engine="onnxruntime") as ort:
        ort_answers = conversation(ort, TURNS)
        explicit = [(text, adapter or "base") for text, adapter in TURNS]
        assert [a[:3] for a in comparable(conversation(ort, explicit))] == \
               [a[:3] for a in comparable(conversation(server, explicit))]
    texts = lambda answers: [(a["text_output"], a["applied_adapter"], a["replayed_tokens"]) for a in answers]  # noqa
    assert texts(ort_answers) == texts(torch_answers)
    # Route scores come from H19 computed by each engine: equal to float tolerance, not bitwise.
    for mine, theirs in zip(ort_answers, torch_answers):
        import json

        a, b = json.loads(mine["route_scores"]), json.loads(theirs["route_scores"])
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
