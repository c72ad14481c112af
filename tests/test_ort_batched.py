"""The serving engine on ONNX Runtime (ced/ort_batched.py) against the torch one over the same paged pool: a mixed
batch (ragged chunks, rows under different adapters, steps across block and page ends) gives the same greedy tokens,
logits and pool contents within float tolerance; a settled decode batch hands the graph the pool's own buffers;
an adapter loaded between calls takes effect on the next; a folder without the pool graphs is refused clearly;
benchmarks/onnxruntime_ceiling.py rebuilds a step's products with the shapes ORT ran."""

import json
import shutil

import pytest
import torch

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from ced.batched import BatchedEngine
from ced.engine_files import EngineFileError
from ced.onnx_export import export_engine
from ced.ort_batched import OrtBatchedEngine
from ced.ort_engine import OrtCEDEngine

ATOL = 2e-5  # float32, the graphs reorder a few reductions (measured: ~2e-6 on tiny)
# (history length, adapter); the two longest apart, so that their later chunks run on rows of slots 1 and 3 (their
# rings copied out, not a slice)
ROWS = [(5, "A1"), (300, "L0"), (37, None), (130, "A1"), (16, "L0")]


def history(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort_batched")
    CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0).save_pretrained(str(root / "model"))
    export_engine(root / "model", root / "engine", progress=False)
    return root


@pytest.fixture()
def engines(built, adapter_dirs):
    """(torch, ONNX Runtime) batched engines over the same tiny model, pages of 4 entries (steps cross them)."""
    serial = CEDEngine(CEDForCausalLM.from_pretrained(str(built / "model")), max_adapters=4, max_rank=8)
    exported = OrtCEDEngine(CEDForCausalLM.from_pretrained(str(built / "model")), built / "engine", max_adapters=4,
                            max_rank=8, threads=1)
    for engine in (serial, exported):
        for name in ("A1", "L0"):
            engine.adapters.load(name, adapter_dirs[name])
    return BatchedEngine(serial, page_entries=4), OrtBatchedEngine(exported, page_entries=4, threads=1)


def run(batched, steps: int = 20):
    """Each row's history in chunks of up to 64 (every row's chunk in one ragged call), a replay of all rows, then
    greedy steps: (rows, greedy ids per row, logits per call)."""
    rows = [batched.open() for _ in ROWS]
    histories = [history(n, i) for i, (n, _) in enumerate(ROWS)]
    for start in range(0, max(n for n, _ in ROWS), 64):
        chunked = [(row, tokens[start: start + 64]) for row, tokens in zip(rows, histories) if tokens[start:]]
        batched.prefill_rows([row for row, _ in chunked], [chunk for _, chunk in chunked])
    adapters = [adapter for _, adapter in ROWS]
    logits, _ = batched.replay(rows, adapters)
    calls, ids = [logits], []
    for _ in range(steps):
        ids.append(logits.argmax(-1).tolist())
        logits = batched.step(rows, ids[-1], adapters)
        calls.append(logits)
    return rows, ids, calls


def close(ours, reference):
    if reference is None:  # a part not written yet (no open block)
        assert ours is None
        return
    assert ours.shape == reference.shape
    difference = float((ours.float() - reference.float()).abs().max()) if ours.numel() else 0.0
    assert difference <= ATOL, difference


def test_a_mixed_batch_gives_the_torch_engines_tokens_logits_and_pool(engines):
    reference, ours = engines
    (reference_rows, reference_ids, reference_calls), (rows, ids, calls) = run(reference), run(ours)
    assert ids == reference_ids
    for got, expected in zip(calls, reference_calls):
        close(got, expected)
    for row, reference_row in zip(rows, reference_rows):  # what each call wrote: windows, entries, open blocks
        state, expected = ours.export(row), reference.export(reference_row)
        for i in expected.shared.windows:
            close(state.shared.windows[i].k, expected.shared.windows[i].k)
        for i in expected.bound.windows:
            close(state.bound.windows[i].v, expected.bound.windows[i].v)
        for s, store in expected.shared.globals.items():
            for part in ("k", "v", "index_keys", "pending"):
                close(getattr(state.shared.globals[s], part), getattr(store, part))
        close(state.shared.stream, expected.shared.stream)


def test_a_settled_decode_step_hands_the_graph_the_pools_own_buffers(engines):
    """What a step moves does not grow with the history: the rings are a slice of the pool's buffers and the
    pages the buffers themselves, read in place."""
    _, ours = engines
    rows, _, _ = run(ours, steps=2)
    ordered = sorted(rows, key=lambda row: row.slot)
    feeds = ours._pool_feeds("pool_step", ordered, [row.length for row in ordered], 1)
    layer, source = 0, ours.config.source_layers[0]
    assert feeds[f"ring_k.{layer}"].data_ptr() == ours.pool.wk[layer][ordered[0].slot].data_ptr()
    assert feeds[f"pages_k.{source}"] is ours.pool.gk[source]


def test_an_adapter_loaded_between_calls_takes_effect_on_the_next(engines, adapter_dirs):
    reference, ours = engines
    results = []
    for batched in (reference, ours):
        row = batched.open()
        batched.prefill(row, history(40, 1))
        before, _ = batched.replay([row], ["A1"])
        batched.adapters.unload("A1")
        batched.adapters.load("A1", adapter_dirs["A2"])  # another adapter's weights under the same name
        after, _ = batched.replay([row], ["A1"])
        assert float((after - before).abs().max()) > 1e-3
        results.append(after)
    close(results[1], results[0])


def test_a_folder_built_before_the_pool_graphs_is_refused(built, tmp_path):
    old = tmp_path / "engine"
    shutil.copytree(built / "engine", old)
    manifest = json.loads((old / "engine.json").read_text())
    for stage in ("pool_prefill", "pool_replay", "pool_step"):
        del manifest["graphs"][stage]
    (old / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineFileError, match="pool_prefill.*build it again"):
        OrtCEDEngine(CEDForCausalLM.from_pretrained(str(built / "model")), old)


def test_the_ceiling_benchmark_reruns_each_product_of_a_step_with_its_shapes(engines):
    """benchmarks/onnxruntime_ceiling.py times a step's products alone: read from the step's profile, each is rebuilt
    with the operands ORT ran (a transposed one laid out K before N) and gives the output shape ORT gave."""
    from benchmarks.onnxruntime_ceiling import open_rows, products_graph, step_products

    _, batched = engines
    batch = open_rows(batched, 3, 40, ["A1", None, "L0"])
    products = step_products(batched, batch)
    assert len(products) >= 4 * batched.config.n_layers  # a layer's projections at least
    assert any(len(operands) == 2 and operands[1][-2] != operands[0][-1] for operands, _ in products)  # transposed
    session, feeds = products_graph(products, threads=1)
    outputs = session.run(None, feeds)
    assert [list(y.shape) for y in outputs] == [out for _, out in products]
