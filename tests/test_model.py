"""The model as a transformers/PEFT citizen and its stages: safetensors round trip, incremental equals one pass,
PEFT-trained adapters load and compute what PEFT computes, the slotted LoRA equals plain LoRA."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from ced import CEDEngine, CEDForCausalLM
from ced.lora import LoRAMapping, MultiLoRALinear, lora_forward_reference
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex

TOLERANCE = 1e-5  # fp32: one pass and token by token differ only by matmul shapes


def tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_save_and_load_with_safetensors(tiny_model, tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    loaded = CEDForCausalLM.from_pretrained(tmp_path)
    assert loaded.ced == model.ced
    ids = torch.tensor([tokens(50)])
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_one_pass_and_token_by_token_prefill_agree(tiny_model):
    engine = CEDEngine(tiny_model())
    history = tokens(70)
    one_pass, stepwise = engine.new_conversation(), engine.new_conversation()
    h19 = engine.prefill(one_pass, history)
    h19_steps = torch.cat([engine.prefill(stepwise, [t]) for t in history])
    torch.testing.assert_close(h19, h19_steps, rtol=0, atol=TOLERANCE)
    for layer, store in one_pass.shared.globals.items():
        torch.testing.assert_close(store.k, stepwise.shared.globals[layer].k, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(store.v, stepwise.shared.globals[layer].v, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(one_pass.shared.stream, stepwise.shared.stream, rtol=0, atol=TOLERANCE)
    assert torch.equal(one_pass.shared.selection.idx, stepwise.shared.selection.idx)


def test_token_by_token_decode_equals_the_oracle_without_a_switch(engine):
    history = tokens(60, seed=1)
    oracle = engine.oracle(history, "A2")
    state = engine.new_conversation()
    engine.prefill(state, history[:1])
    logits, _ = engine.replay(state, "A2")
    for position, token in enumerate(history[1:]):
        torch.testing.assert_close(logits, oracle[position], rtol=0, atol=TOLERANCE)
        logits = engine.step(state, token, "A2")


def test_peft_trains_an_adapter_that_the_engine_loads(tiny_model, tmp_path):
    base = tiny_model()
    config = base.ced
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=decoder_modules_regex(config, ATTENTION + FFN), lora_dropout=0.0))
    peft_model.print_trainable_parameters()
    data = torch.tensor([tokens(48, seed=s) for s in range(4)])
    data[:, 1::2] = data[:, ::2]  # a learnable pattern: every odd token repeats the previous one
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(15):
        loss = peft_model(input_ids=data, labels=data).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    peft_model.save_pretrained(tmp_path / "trained")

    engine = CEDEngine(tiny_model(), max_rank=4)
    engine.adapters.load("trained", tmp_path / "trained")
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "trained").eval()
    with torch.no_grad():
        expected = reloaded(input_ids=data[:1]).logits[0]
    torch.testing.assert_close(engine.oracle(data[0].tolist(), "trained"), expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("rank, rows", [(1, 1), (4, 3), (8, 5)])
def test_slotted_lora_equals_plain_lora(rank, rows):
    torch.manual_seed(rank)
    base = torch.nn.Linear(24, 40, bias=False)
    mapping = LoRAMapping()
    slotted = MultiLoRALinear(base, n_slots=3, max_rank=8, mapping=mapping)
    adapters = [(torch.randn(rank, 24), torch.randn(40, rank)) for _ in range(2)]
    for slot, (a, b) in enumerate(adapters):
        slotted.set_lora(slot, a, b)
    x = torch.randn(rows, 7, 24)
    slots = torch.tensor([(i % 3) - 1 for i in range(rows)])  # -1 (none), 0, 1, ...
    mapping.row_slots = slots
    out = slotted(x)
    for i, slot in enumerate(slots.tolist()):
        a, b = adapters[slot] if slot >= 0 else (None, None)
        torch.testing.assert_close(out[i], lora_forward_reference(x[i], base, a, b), rtol=1e-5, atol=1e-5)
        if slot < 0:
            assert torch.equal(out[i], base(x[i]))


def test_top_k_recent_orders_by_score_then_recency():
    """The integer keys order every float as the floats order (negatives, -0.0 == 0.0, -inf) with ties to the
    most recent index: the reference is a full sort by (score, index), both descending."""
    from ced.model import top_k_recent

    scores = torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(3))
    scores[:, :, 50:80] = 0.0
    scores[:, :, 60:70] = -0.0
    scores[:, :, 120:140] = float("-inf")
    scores[:, :, 140:150] = scores[:, :, 150:160]  # ties of nonzero values
    scores = scores.round(decimals=1)  # and many more
    idx, values = top_k_recent(scores, 190)  # deep enough to order the negatives and the -inf
    for row, (chosen, got) in enumerate(zip(idx.view(-1, 190).tolist(), values.view(-1, 190).tolist())):
        line = scores.view(-1, 200)[row].tolist()
        expected = sorted(range(200), key=lambda i: (line[i] + 0.0, i), reverse=True)[:190]
        assert chosen == expected and got == [line[i] for i in expected]
