"""The native decode kernels (ced/kernels) against torch's arithmetic, and the promise that a row's result does not
depend on the rows beside it."""

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ced import kernels
from ced.lora import panels_of

pytestmark = pytest.mark.skipif(not kernels.available(torch.float32), reason="no C++ compiler: the kernels are off")

torch.manual_seed(0)


def spec_of(weight_t, lora=None):
    """A LinearSpec and the tensors it points into (kept alive by the caller)."""
    panels = kernels.pack(weight_t)
    if lora is None:
        return kernels.LinearSpec.of(panels, *weight_t.shape), (panels,)
    a, b = lora  # (S, r, in), (S, out, r)
    a_panels = torch.stack([kernels.pack(slot.t()) for slot in a])
    b_panels = torch.stack([kernels.pack(slot.t()) for slot in b])
    return kernels.LinearSpec.of(panels, *weight_t.shape, (a_panels, b_panels, a.shape[1])), (panels, a_panels,
                                                                                               b_panels)


@pytest.mark.parametrize("shape", [(256, 768), (96, 100), (40, 4), (17, 1)])  # 64-wide, 16-wide and tail panels
@torch.inference_mode()
def test_matmul_matches_torch_and_a_row_has_the_same_bits_in_any_batch(shape):
    weight_t = torch.randn(*shape)
    spec, keep = spec_of(weight_t)
    x = torch.randn(13, 1, shape[0])
    batch = kernels.matmul(x, spec)
    torch.testing.assert_close(batch, x @ weight_t, rtol=1e-5, atol=1e-4)
    for row in range(13):
        assert torch.equal(kernels.matmul(x[row:row + 1], spec), batch[row:row + 1])


@pytest.mark.parametrize("shape", [(256, 768), (96, 100), (40, 4)])  # 64-wide, 16-wide and tail panels
@torch.inference_mode()
def test_bfloat16_weights_pack_at_half_the_bytes_and_give_the_float32_panels_bits(shape):
    """A bfloat16 checkpoint's weights (float32 after the upcast) are read at half the bytes, widened exactly: the
    products have the float32 panels' bits, with and without each row's LoRA; a weight that is not all bfloat16s
    keeps float32 panels."""
    weight_t = torch.randn(*shape).to(torch.bfloat16).float()
    half, wide = kernels.pack_weight(weight_t), kernels.pack(weight_t)
    assert half.dtype == torch.bfloat16 and half.nbytes * 2 == wide.nbytes
    assert kernels.pack_weight(weight_t + 1e-3).dtype == torch.float32
    assert panels_of(weight_t).dtype == torch.bfloat16  # what the engines' linears pack (ced/lora.py)
    S, r = 2, 4
    a, b = torch.randn(S, r, shape[0]), torch.randn(S, shape[1], r)
    a_panels = torch.stack([kernels.pack(slot.t()) for slot in a])
    b_panels = torch.stack([kernels.pack(slot.t()) for slot in b])
    x, slots = torch.randn(9, 1, shape[0]), torch.tensor([0, -1, 1, 1, -1, 0, 0, 1, -1])
    for lora, row_slots in ((None, None), ((a_panels, b_panels, r), slots)):
        got = kernels.matmul(x, kernels.LinearSpec.of(half, *shape, lora), row_slots)
        assert torch.equal(got, kernels.matmul(x, kernels.LinearSpec.of(wide, *shape, lora), row_slots))
    torch.testing.assert_close(kernels.matmul(x, kernels.LinearSpec.of(half, *shape)), x @ weight_t, rtol=1e-5,
                               atol=1e-4)


@torch.inference_mode()
def test_each_row_adds_its_own_slots_lora_and_a_row_without_one_keeps_the_base_bits():
    C, out, r, S = 64, 80, 8, 3
    weight_t, a, b = torch.randn(C, out), torch.randn(S, r, C), torch.randn(S, out, r)
    base, keep_base = spec_of(weight_t)
    spec, keep = spec_of(weight_t, (a, b))
    x, slots = torch.randn(5, 1, C), torch.tensor([2, -1, 0, 2, 1])
    got = kernels.matmul(x, spec, slots)
    for row, slot in enumerate(slots.tolist()):
        expected = x[row] @ weight_t
        if slot < 0:
            assert torch.equal(got[row], kernels.matmul(x[row:row + 1], base)[0])
        else:
            expected = expected + (x[row] @ a[slot].t()) @ b[slot].t()
        torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_swiglu_block_and_rms_norm_match_torch():
    """Within float tolerance of the block's largest output (sums of ~50 terms of magnitude ~10 cancel: a small
    output may differ by 1e-3 in another summation order; with unseeded inputs 5 % of runs failed an absolute 1e-4)."""
    torch.manual_seed(0)
    C, Fh, r, eps = 32, 48, 4, 1e-5
    w = [torch.randn(C, Fh), torch.randn(C, Fh), torch.randn(Fh, C)]
    loras = [(torch.randn(2, r, n_in), torch.randn(2, n_out, r)) for n_in, n_out in ((C, Fh), (C, Fh), (Fh, C))]
    specs = [spec_of(weight_t, lora) for weight_t, lora in zip(w, loras)]
    norm_weight, x, slots = torch.rand(C) + 0.5, torch.randn(3, 1, C), torch.tensor([1, -1, 0])
    got = kernels.swiglu_block(x, norm_weight, eps, *(spec for spec, _ in specs), slots)

    def linear(h, i, row):
        y = h @ w[i]
        if slots[row] >= 0:
            a, b = loras[i][0][slots[row]], loras[i][1][slots[row]]
            y = y + (h @ a.t()) @ b.t()
        return y

    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    torch.testing.assert_close(kernels.rms_norm(x, norm_weight, eps), normed, rtol=1e-5, atol=1e-5)
    for row in range(3):
        n = normed[row]
        expected = x[row] + linear(F.silu(linear(n, 0, row)) * linear(n, 1, row), 2, row)
        torch.testing.assert_close(got[row], expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


@torch.inference_mode()
def test_attend_one_masks_the_window_and_the_invalid_entries_as_torch_does():
    B, H, S, D, K, W = 3, 2, 10, 16, 4, 6
    q, keys, values = torch.randn(B, H, 1, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    key_pos = torch.randint(0, 12, (B, S))
    positions = torch.tensor([[9], [11], [5]])
    k_sel, v_sel = torch.randn(B, H, 1, K, D), torch.randn(B, H, 1, K, D)
    valid = torch.tensor([[[True, False, True, True]], [[False] * 4], [[True] * 4]])
    scale = 1 / math.sqrt(D)
    got = kernels.attend_one(q, keys, values, key_pos, positions, W, scale, (k_sel, v_sel, valid))
    local = (q @ keys.transpose(-1, -2)) * scale  # (B, H, 1, S)
    distance = positions[:, :, None] - key_pos[:, None, :]
    local = local.masked_fill(((distance < 0) | (distance >= W))[:, None], float("-inf"))
    glob = (q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * scale
    glob = glob.masked_fill(~valid[:, None], float("-inf"))
    probs = torch.cat([local, glob], -1).softmax(-1)
    expected = probs[..., :S] @ values + (probs[..., S:].unsqueeze(-2) @ v_sel).squeeze(-2)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(B, 1, H * D), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 8192, 8195])
def test_argmax_rows_picks_what_torch_argmax_picks(width):
    rows = torch.randn(9, width)
    rows[1] = 0.5  # every value equal: the first
    rows[2, width // 2:] = rows[2].max() + 1  # equal maxima, the first of them
    rows[3, -1] = float("inf")
    rows[4, width // 3] = float("nan")  # a NaN wins wherever it lies
    rows[5, -1] = float("nan")
    rows[6] = float("-inf")
    rows[7, :] = float("nan")
    rows[8, [min(2, width - 1), width - 1]] = 99.0  # equal maxima in different lanes and runs: the first
    assert kernels.argmax_rows(rows) == rows.argmax(dim=1).tolist()
    assert kernels.argmax_rows(rows[4]) == [int(rows[4].argmax())]  # one row (V,)
    strided = torch.randn(width, 9).t()  # not contiguous: torch's path
    assert kernels.argmax_rows(strided) == strided.argmax(dim=1).tolist()
    with kernels.turned_off():  # torch's own, where the kernels are off
        assert kernels.argmax_rows(rows) == rows.argmax(dim=1).tolist()


@pytest.mark.parametrize("width", [1, 15, 16, 17, 8192, 8195])
def test_argmax_allowed_picks_what_torch_argmax_of_the_masked_copy_picks(width):
    """xgrammar's bitmask layout (bit j of word w: token 32 w + j), the forbidden tokens at -inf in the copy."""
    g = torch.Generator().manual_seed(width)
    cases = []
    for density in (1.0, 0.5, 0.02, 0.0):
        for values in ("random", "ties", "nan", "-inf"):
            logits = torch.randn(width, generator=g)
            if values == "ties":
                logits = logits.round()
            elif values == "nan":
                logits[torch.randint(0, width, (2,), generator=g)] = float("nan")
            elif values == "-inf":
                logits[:] = float("-inf")
            cases.append((logits, torch.rand(-(-width // 32) * 32, generator=g) < density))
    for logits, flags in cases:
        bits = torch.from_numpy(np.packbits(flags.numpy(), bitorder="little").view(np.int32).copy())
        masked = torch.where(flags[:width], logits, torch.tensor(float("-inf")))
        assert kernels.argmax_allowed(logits, bits) == int(masked.argmax()), (flags[:width].sum(), logits)
    with kernels.turned_off():
        assert kernels.argmax_allowed(logits, bits) is None  # the caller's masked copy then


def test_the_kernels_stay_off_where_gradients_or_chunks_flow():
    x = torch.randn(2, 1, 8)
    assert not kernels.takes(x)  # grad mode: the kernels have no backward
    with torch.inference_mode():
        assert kernels.takes(x)
        assert not kernels.takes(torch.randn(1, 4, 8))  # a chunk keeps MKL's arithmetic
        assert not kernels.takes(torch.randn(kernels.MAX_ROWS + 1, 1, 8))
        assert not kernels.takes(x.double())


def test_two_threads_give_the_same_bits():
    weight_t = torch.randn(256, 1000)  # above the size the kernel splits, a 16-wide and a tail panel at the end
    spec, keep = spec_of(weight_t)
    x = torch.randn(5, 1, 256)
    with torch.inference_mode():
        alone = kernels.matmul(x, spec)
        kernels.set_threads(2)
        try:
            split = [kernels.matmul(x, spec) for _ in range(20)]  # the worker sleeps and wakes between some
        finally:
            kernels.set_threads(1)
    assert all(torch.equal(alone, y) for y in split)


def test_a_native_decode_step_is_the_torch_step_to_float_tolerance(adapter_dirs, tiny_model, monkeypatch):
    """Three ragged rows under three adapters (one none), 20 steps over block ends and page ends: the native step
    (ced/native_decode.py: one call) and the torch step choose the same global entries and agree on
    the logits."""
    from ced import CEDEngine
    from ced.batched import BatchedEngine
    from ced.native_decode import NativeDecode

    steps, native_step = [], NativeDecode.step
    monkeypatch.setattr(NativeDecode, "step", lambda *args: steps.append(native_step(*args)) or steps[-1])

    def run(native: bool):
        engine = CEDEngine(tiny_model(), max_adapters=4, max_rank=8)
        for name in ("A1", "L0"):
            engine.adapters.load(name, adapter_dirs[name])
        batched, adapters = BatchedEngine(engine, page_entries=4), ["A1", None, "L0"]
        rows = []
        for length, seed in ((61, 1), (200, 2), (9, 3)):
            row = batched.open()
            tokens = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
            batched.prefill(row, tokens)
            rows.append(row)
        logits, _ = batched.replay(rows, adapters)
        out = []
        for _ in range(20):
            with contextlib.nullcontext() if native else kernels.turned_off():
                logits = batched.step(rows, logits.argmax(-1).tolist(), adapters)
            out.append(logits)
        return torch.stack(out), batched.pool.sel_idx.clone(), batched.pool.sel_valid.clone()

    native, torch_path = run(True), run(False)
    assert len(steps) == 20 and None not in steps  # every step ran natively
    assert native[2].equal(torch_path[2])
    assert native[1].masked_fill(~native[2], 0).equal(torch_path[1].masked_fill(~torch_path[2], 0))
    assert float((native[0] - torch_path[0]).abs().max()) < 1e-4


def test_attend_one_takes_positions_the_rows_share():
    """(1, 1) positions with several rows, as a chunk of rows at one position gives them (ListCache)."""
    B, H, S, D = 3, 2, 5, 16
    q, keys, values = torch.randn(B, H, 1, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    key_pos, shared = torch.arange(S)[None], torch.tensor([[S - 1]])
    with torch.inference_mode():
        got = kernels.attend_one(q, keys, values, key_pos, shared, 4, 0.25, None)
        each = kernels.attend_one(q, keys, values, key_pos, shared.expand(B, 1), 4, 0.25, None)
    assert torch.equal(got, each)


def test_a_native_step_on_two_threads_is_one_thread_bit_for_bit(adapter_dirs, tiny_model):
    """The kernels' second thread claims rows of attention as it comes free (the tiny model's products are too small
    to share; test_two_threads_give_the_same_bits covers theirs): whichever thread ran a row, a step's logits and
    the rings it writes are the same bits."""
    from ced import CEDEngine
    from ced.batched import BatchedEngine
    from test_batched import FreeCpusReading

    def run(threads: int):
        engine = CEDEngine(tiny_model(), max_adapters=4, max_rank=8)
        engine.adapters.load("A1", adapter_dirs["A1"])
        batched = BatchedEngine(engine, page_entries=4, chunk_threads=2)
        batched.free_cpus = FreeCpusReading(threads)
        rows = []
        for length in (40, 75, 9, 23):
            rows.append(batched.open())
            batched.prefill(rows[-1], torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(length))
                            .tolist())
        adapters = ["A1", None, "A1", None]
        logits, _ = batched.replay(rows, adapters)
        out = []
        for _ in range(12):
            logits = batched.step(rows, logits.argmax(-1).tolist(), adapters)
            out.append(logits)
        return torch.stack(out), batched.pool.stream.clone()

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels take a second thread only while torch runs on one
    try:
        one, two = run(1), run(2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
