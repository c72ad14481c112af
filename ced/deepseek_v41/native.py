"""A deepseek_v41 decode step, prefill chunk or replay in one native call (ced/kernels/v41.cpp), on the
conversations' own state in place.

A V4.1 layer for one token per row is ~200 small torch operations (two mHC sites of which Sinkhorn-Knopp alone is
~80, the low-rank query, the latent and its window, the compressor, the indexer's scores and top-k, the sink
softmax, the grouped output, the gate and an expert loop); on the demo the torch step costs ~18 ms a token in
dispatch where its arithmetic is well under one. Here `V41Engine.step_rows` (and `step`) is one call of
`v41_step_tails` over a `V41Model` (pointers to packed weights and each row's LoRA, built once per set of loaded
adapters by `V41Plan`) and each row's `RowTails` (the TailMetas of its windows, stores, pending group and replay
tails: `ced.deepseek_v41.state.Tail`): the kernel finds each row's places in them, runs `v41_decode_step` and
advances them. The arithmetic is the model's in another summation order: a row's logits agree with the torch
step's to float tolerance, its state likewise, and its top-k and expert choices are the same; a row's result does
not depend on the other rows of the call.

The same call runs a range of sites (`v41_run`): a prefill chunk is the adapter-free sites with the chunk's tokens
as rows, each at its own position in the same tails, so a chunk writes bitwise what its tokens one step at a time
would (a 25-token prompt of the demo: 15.7 ms through torch's path, 2.7 ms here); a replay is the decoder's sites
with the last W positions as rows, from the layer-E tails the shared state keeps.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from .. import kernels
from .adapters import LoRALinear, V41AdapterSet
from .model import DeepseekV41ForCausalLM
from .state import V41ConversationState

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_CHOICES = ("selection.idx", "selection.valid", "pool.idx", "pool.valid")
TAILS_NEED_ROOM, TAILS_OUT_OF_STEP = 1, 2  # v41_step_tails' answers besides the step's own


class V41Plan:
    """A model's weights as the kernel reads them: base panels packed once, and for each set of loaded adapters
    (their order is the rows' slot numbers) the V41Model with each linear's LoRA slots."""

    def __init__(self, model: DeepseekV41ForCausalLM, adapter_set: V41AdapterSet):
        self.model, self.adapter_set, self.config = model, adapter_set, model.config
        config = self.config
        self.native = (len(config.kv_source_layer_ids) <= kernels.MAX_STORES and config.scoring_func in SCORING
                       and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
                       and kernels.available(torch.float32))
        self.stores = {layer: i for i, layer in enumerate(config.kv_source_layer_ids)}
        self._panels: dict[int, list[Tensor]] = {}  # id(module) -> its panels (one per group)
        self._variant: tuple | None = None  # (key, V41Model, what it points into, each adapter's slot, its byref)
        f, long_, bool_, c = torch.float32, torch.long, torch.bool, config
        self.like = {  # (1, 1, ...) of each tail's shape and dtype: what a tail makes room after
            "latent": torch.empty(1, 1, c.head_dim, dtype=f), "key": torch.empty(1, 1, c.index_head_dim, dtype=f),
            "input": torch.empty(1, 1, c.hidden_size, dtype=f),
            "stream": torch.empty(1, 1, c.hc_mult, c.hidden_size, dtype=f), "pre": torch.empty(1, 1, c.hc_mult, dtype=f),
            "selection.idx": torch.empty(1, 1, c.index_topk, dtype=long_),
            "selection.valid": torch.empty(1, 1, c.index_topk, dtype=bool_),
            "pool.idx": torch.empty(1, 1, c.candidate_topk_blocks, dtype=long_),
            "pool.valid": torch.empty(1, 1, c.candidate_topk_blocks, dtype=bool_)}
        self.no_inputs = torch.empty(1, 0, c.hidden_size, dtype=f)  # a store's pending group once it completes
        source = c.roles[c.decoder_start].kv_source  # a step keeps layer E's choices once this store has an entry
        self.n_choices = 0 if source is None else 4 if c.candidate_topk_blocks else 2
        self.choices_from = 0 if source is None else c.compress_ratios[source] - 1  # the first such position

    def model_struct(self) -> kernels.V41Model | None:
        if not self.native:
            return None
        names = tuple(self.adapter_set.names)
        key = (names, LoRALinear.changes)
        if self._variant is None or self._variant[0] != key:
            rank = max((adapter.rank for adapter in self.adapter_set.names.values()), default=1)
            with torch.no_grad():  # a step may ask for it outside inference mode (V41Engine.step)
                struct, keep = self._build(names, rank)
                self._variant = (key, struct, keep, {name: slot for slot, name in enumerate(names)},
                                 ctypes.byref(struct))
        return self._variant[1]

    # -- building ---------------------------------------------------------------------------------------------

    def _specs(self, module: nn.Module, names: tuple[str, ...], rank: int, keep: list):
        """A pointer to one LinearSpec per group of `module` (one for a plain linear), with the LoRA slots of
        `names` where one of them adapts it."""
        groups = getattr(module, "groups", None) or 1
        weight = module.weight.detach()
        out = weight.shape[0] // groups
        if id(module) not in self._panels:
            self._panels[id(module)] = [kernels.pack_weight(weight[g * out: (g + 1) * out].t())
                                      for g in range(groups)]
        panels = self._panels[id(module)]
        adapters = getattr(module, "adapters", {})
        lora = [adapters.get(name) for name in names]
        specs = []
        for g in range(groups):
            if not any(lora):
                specs.append(kernels.LinearSpec.of(panels[g], weight.shape[1], out))
                continue
            a = torch.zeros(len(names), weight.shape[1] * rank)  # slot i: A^T (in, rank) packed, zeros where unused
            b = torch.zeros(len(names), rank * out)  # slot i: B_g^T (rank, out) packed
            for i, pair in enumerate(lora):
                if pair is not None:
                    a_i, b_i = pair[0].float(), pair[1].float()[g * out: (g + 1) * out]
                    padded_a = torch.zeros(weight.shape[1], rank)
                    padded_a[:, : a_i.shape[0]] = a_i.t()
                    padded_b = torch.zeros(rank, out)
                    padded_b[: a_i.shape[0]] = b_i.t()
                    a[i], b[i] = kernels.pack(padded_a), kernels.pack(padded_b)
            used = torch.tensor([pair is not None for pair in lora])
            keep += [a, b, used]
            specs.append(kernels.LinearSpec.of(panels[g], weight.shape[1], out, (a, b, rank), used))
        return self._array(specs, keep)

    @staticmethod
    def _array(specs: list, keep: list):
        """A pointer to the specs as one C array, kept alive in `keep`."""
        array = (kernels.LinearSpec * len(specs))(*specs)
        keep.append(array)
        return ctypes.cast(array, ctypes.POINTER(kernels.LinearSpec))

    def _build(self, names: tuple[str, ...], rank: int) -> tuple[kernels.V41Model, list]:
        model, config, keep = self.model, self.config, []
        spec = lambda module: None if module is None else self._specs(module, names, rank, keep)  # noqa: E731
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        layers = []
        for layer in model.layers:
            attn, ffn, role = layer.attn, layer.ffn, layer.role
            compressor, indexer = attn.compressor, attn.indexer
            experts = [w for expert in ffn.experts for w in (expert.w1, expert.w2, expert.w3)]
            expert_specs = self._array([spec(w)[0] for w in experts], keep)
            shared = ffn.shared_experts
            shared_specs = None if shared is None else self._array(
                [spec(w)[0] for w in (shared.w1, shared.w2, shared.w3)], keep)
            layers.append(kernels.V41Layer(
                attn_norm=ptr(layer.attn_norm.weight), wq_a=spec(attn.wq_a), wq_b=spec(attn.wq_b), wkv=spec(attn.wkv),
                wo_a=spec(attn.wo_a), wo_b=spec(attn.wo_b), q_norm=ptr(attn.q_norm.weight),
                kv_norm=ptr(attn.kv_norm.weight), sink=ptr(attn.attn_sink), rope=int(role.rope == "compress"),
                own_store=self.stores.get(role.index, -1) if role.is_kv_source else -1,
                read_store=-1 if role.kv_source is None else self.stores[role.kv_source],
                ratio=role.ratio, c_wkv=spec(compressor and compressor.wkv),
                c_wgate=spec(compressor and compressor.wgate), c_norm=ptr(compressor and compressor.norm.weight),
                i_wk=spec(indexer and indexer.wk), i_k_norm=ptr(indexer and indexer.k_norm and indexer.k_norm.weight),
                i_wq_b=spec(indexer and indexer.wq_b), i_weights=spec(indexer and indexer.weights_proj),
                uses_candidates=int(role.uses_candidates), candidate_source=int(role.is_candidate_source),
                hc_attn_fn=ptr(layer.hc_attn_fn), hc_attn_base=ptr(layer.hc_attn_base),
                hc_attn_scale=ptr(layer.hc_attn_scale), ffn_norm=ptr(layer.ffn_norm.weight),
                gate_w=ptr(ffn.gate.weight), gate_bias=ptr(ffn.gate.bias), experts=expert_specs,
                shared=shared_specs, hc_ffn_fn=ptr(layer.hc_ffn_fn), hc_ffn_base=ptr(layer.hc_ffn_base),
                hc_ffn_scale=ptr(layer.hc_ffn_scale)))
        layer_array = (kernels.V41Layer * len(layers))(*layers)
        inv_freq = [model._inv_freq[kind].float().contiguous() for kind in ("main", "compress")]
        ratios = [config.compress_ratios[layer] for layer in config.kv_source_layer_ids]
        struct = kernels.V41Model(
            C=config.hidden_size, H=config.num_attention_heads, D=config.head_dim, R=config.qk_rope_head_dim,
            Q=config.q_lora_rank, G=config.o_groups, hc=config.hc_mult, vocab=config.vocab_size,
            window=config.sliding_window, index_heads=config.index_n_heads, index_dim=config.index_head_dim,
            index_topk=config.index_topk, cand_blocks=config.candidate_topk_blocks,
            cand_block_size=config.candidate_block_size, n_experts=config.n_routed_experts,
            top_experts=config.num_experts_per_tok, store_ratio=(ctypes.c_long * kernels.MAX_STORES)(*ratios),
            n_layers=config.num_hidden_layers, decoder_start=config.decoder_start,
            sinkhorn_iters=config.hc_sinkhorn_iters, scoring=SCORING[config.scoring_func],
            norm_topk=int(config.norm_topk_prob), eps=config.rms_norm_eps, hc_eps=config.hc_eps,
            routed_scale=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit or 0.0,
            inv_freq=(ctypes.c_void_p * 2)(*(t.data_ptr() for t in inv_freq)), embed=ptr(model.embed.weight),
            final_norm=ptr(model.norm.weight), head=spec(model.head), layers=layer_array)
        return struct, keep + [layer_array, inv_freq, layers]

    # -- a step ---------------------------------------------------------------------------------------------------

    def _struct(self) -> kernels.V41Model | None:
        # kernels.usable(), not enabled(): these calls are never inside autograd or a tracer (the engine's verbs
        # are), and enabled()'s checks cost a decode step ~20 us on the caches a step leaves
        return self.model_struct() if kernels.usable() else None

    def step(self, states: list[V41ConversationState], tokens: list[int], adapters: list[str | None],
             logits: Tensor | None = None) -> Tensor | None:
        """Next-token logits (B, V) of `tokens` (one per row, checked by the caller) appended to `states`, each
        row under its adapter, written into `logits` where given (B * V contiguous floats); every row's state
        advanced as the torch step advances it. None where the kernel cannot take the step (the caller runs the
        torch path)."""
        struct = self._struct()  # any number of rows (48 rows of the demo: 13.0 ms a step, the torch pass 48.7)
        if struct is None:
            return None
        B, slot_of = len(states), self._variant[3]
        if logits is None:
            logits = torch.empty(B, self.config.vocab_size)
        if B == 1:  # a lone row's arrays live on its RowTails: a new ctypes array costs ~5 us on a step's caches
            row, name = self._row_tails(states[0]), adapters[0]
            rows = [row]
            row.position[0], row.token[0], row.slot[0] = len(states[0].shared.tokens), tokens[0], \
                -1 if name is None else slot_of[name]
            args = (1, row.one, len(self.stores), self.choices_from, self.n_choices, row.position,
                    None if name is None else row.slot, self._variant[4], row.token, logits.data_ptr())
        else:
            rows = [self._row_tails(state) for state in states]
            tails = (ctypes.c_void_p * B)(*[row.address for row in rows])
            positions = (ctypes.c_long * B)(*[len(state.shared.tokens) for state in states])
            lora_slots = None  # no LoRA on any row
            if any(name is not None for name in adapters):
                lora_slots = (ctypes.c_long * B)(*[-1 if name is None else slot_of[name] for name in adapters])
            args = (B, tails, len(self.stores), self.choices_from, self.n_choices, positions, lora_slots,
                    self._variant[4], (ctypes.c_long * B)(*tokens), logits.data_ptr())
        code = kernels.library().v41_step_tails(*args)  # finds each row's places in its tails, steps, advances them
        if code == TAILS_NEED_ROOM:  # a full tail: every row's full ones move to larger buffers (amortised)
            for row in rows:
                row.make_room()
            code = kernels.library().v41_step_tails(*args)
            if code == TAILS_NEED_ROOM:
                raise RuntimeError("v41_step_tails found a full tail after make_room (a bug)")
        if code == TAILS_OUT_OF_STEP:
            return None
        if code:
            kernels.check(code)
        for state, token in zip(states, tokens):
            state.shared.tokens.append(token)
        return logits

    def _row_tails(self, state: V41ConversationState) -> "RowTails":
        """The state's RowTails, kept on the state until its adapter-bound windows change (a replay)."""
        row = state.__dict__.get("_row_tails")
        if row is None or row.bound is not state.bound or row.shared is not state.shared:
            row = state.__dict__["_row_tails"] = RowTails(self, state)
        return row

    def prefill(self, state: V41ConversationState, tokens: list[int]) -> Tensor | None:
        """H19 (T, C) of `tokens` appended to `state` through the adapter-free sites (layers 0..E-1 and layer E's
        attention), the tokens as the rows of one call: each row's places are its own position's in the same tails,
        so the state is what the tokens one decode step at a time would write (bitwise: a row's arithmetic does
        not depend on the other rows). None where the kernel cannot take the chunk (the caller runs torch's)."""
        struct = self._struct()
        if struct is None or not tokens:
            return None
        config, like, E, S, L = self.config, self.like, self.config.decoder_start, kernels.MAX_STORES, \
            self.config.num_hidden_layers
        T, shared, start = len(tokens), state.shared, state.length
        for store in shared.stores.values():  # a state the positions describe, else torch's path says what is wrong
            pending = len(store.inputs) if store.ratio > 1 else 0
            if store.n_entries != start // store.ratio or pending != start % store.ratio:
                return None
        places = RowPlaces(T, L)
        arrays = places.arrays
        for layer in range(E + 1):
            tail = shared.windows[layer].tail
            tail.reserve(T, like["latent"])
            first, held = tail.place(like["latent"]), len(tail)
            for t in range(T):
                arrays["windows"][t * L + layer], arrays["window_n"][t * L + layer] = first, held + t
        groups = {}  # ratio >= 2: each group the chunk touches, in a buffer of its own (none handed out is written)
        for layer, s in self.stores.items():
            store, ratio = shared.stores[layer], shared.stores[layer].ratio
            new = (start + T) // ratio - start // ratio  # entries the chunk completes
            if new:
                store.latents.reserve(new, like["latent"])
                store.keys.reserve(new, like["key"])
            latents_at, keys_at = (store.latents.place(like["latent"]), store.keys.place(like["key"])) if new else (
                _address(store.latent), _address(store.index_keys))  # none written: where the entries are, if any
            if ratio > 1:
                groups[layer] = torch.zeros(new + 1, ratio, config.hidden_size)
                if start % ratio:
                    groups[layer][0, : start % ratio] = store.pending[0]
            for t in range(T):
                i, position = t * S + s, start + t
                arrays["latents"][i], arrays["keys"][i], arrays["n_entries"][i] = latents_at, keys_at, position // ratio
                if ratio > 1:
                    arrays["pending"][i] = groups[layer][position // ratio - start // ratio].data_ptr()
        source = config.roles[E].kv_source
        # layer E's choices are kept from the first row whose position has an entry in the store it reads
        chosen_from = 0 if source is None else max(0, config.compress_ratios[source] - 1 - start)
        kept = {"stream": T, "pre": T}
        if source is not None and chosen_from < T:
            kept |= {"selection.idx": T - chosen_from, "selection.valid": T - chosen_from}
            if config.candidate_topk_blocks:
                kept |= {"pool.idx": T - chosen_from, "pool.valid": T - chosen_from}
        for name, count in kept.items():
            at = shared.tails[name].next_places(count, like[name])
            arrays[name.replace(".", "_")] = [0] * (T - count) + at
        arrays["positions"], arrays["lora_slots"] = list(range(start, start + T)), [-1] * T
        rows = places.rows(T)
        rows.lora_slots = None  # adapter-free
        h19 = torch.empty(T, config.hidden_size)
        ids = (ctypes.c_long * T)(*tokens)
        kernels.check(kernels.library().v41_run(ctypes.byref(rows), ctypes.byref(struct), ids, 0, 2 * E + 1,
                                                h19.data_ptr(), None, T))
        for layer in range(E + 1):
            shared.windows[layer].tail.advance(T)
        for layer in self.stores:
            store = shared.stores[layer]
            store.latents.advance((start + T) // store.ratio - start // store.ratio)
            store.keys.advance((start + T) // store.ratio - start // store.ratio)
            rest = (start + T) % store.ratio  # the inputs of a group still pending, as torch's path keeps them
            store.pending = groups[layer][-1:, :rest] if rest else self.no_inputs
        for name, count in kept.items():
            shared.tails[name].advance(count)
        shared.tokens.extend(tokens)
        return h19

    def replay(self, state: V41ConversationState, adapter: str | None, n: int) -> tuple[Tensor, dict] | None:
        """The next-token logits (V,) and new adapter-bound windows of the last `n` positions replayed under
        `adapter` (layer E's FFN and layers E+1..L-1 from the layer-E streams, pre-mix and choices the shared state
        keeps), the positions as the rows of one call. None where the kernel cannot take it."""
        struct = self._struct()
        if struct is None:
            return None
        config, like, E, S, L = self.config, self.like, self.config.decoder_start, kernels.MAX_STORES, \
            self.config.num_hidden_layers
        shared, start = state.shared, state.length - n
        places = RowPlaces(n, L)
        arrays = places.arrays
        windows = self.model.new_windows(config.adapter_bound_layers)
        for layer, window in windows.items():
            window.tail.reserve(n, like["latent"])
            first = window.tail.place(like["latent"])
            for t in range(n):
                arrays["windows"][t * L + layer], arrays["window_n"][t * L + layer] = first, t
        for layer, s in self.stores.items():  # entries as each position saw them (the decoder reads layer E's)
            store = shared.stores[layer]
            latents_at, keys_at = _address(store.latent), _address(store.index_keys)
            for t in range(n):
                i = t * S + s
                arrays["latents"][i], arrays["keys"][i] = latents_at, keys_at
                arrays["n_entries"][i] = (start + t + 1) // store.ratio
        for name in ("stream", "pre", *_CHOICES):
            value = shared.tails[name].value
            held = 0 if value is None else value.shape[1]  # choices: kept from a row's first entry on
            if name in ("stream", "pre") and held < n:
                return None
            arrays[name.replace(".", "_")] = [0 if t < n - held else value[0, held - n + t].data_ptr()
                                              for t in range(n)]
        slot = -1 if adapter is None else tuple(self.adapter_set.names).index(adapter)
        arrays["positions"], arrays["lora_slots"] = list(range(start, start + n)), [slot] * n
        rows = places.rows(n)
        if slot < 0:
            rows.lora_slots = None
        logits = torch.empty(1, config.vocab_size)
        kernels.check(kernels.library().v41_run(ctypes.byref(rows), ctypes.byref(struct), None, 2 * E + 1, 2 * L,
                                                None, logits.data_ptr(), n - 1))
        for window in windows.values():
            window.tail.advance(n)
        return logits[0], windows


def _address(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class RowTails:
    """One conversation's tails in the order `v41_step_tails` reads them (v41.cpp): its window of each layer (layers
    0..E shared, the rest its adapter-bound ones), each store's latents, keys and pending inputs, then the replay
    tails (stream, pre, the choices), as one C array of their TailMetas. Built once per state and adapter-bound
    windows, so a step's Python does not touch them one by one."""

    def __init__(self, plan: V41Plan, state: V41ConversationState):
        config, shared, like = plan.config, state.shared, plan.like
        E, L = config.decoder_start, config.num_hidden_layers
        self.shared, self.bound = shared, state.bound
        tails = [((shared.windows if layer <= E else state.bound.windows)[layer].tail, like["latent"])
                 for layer in range(L)]
        for layer in plan.stores:  # by slot
            store = shared.stores[layer]
            tails += [(store.latents, like["latent"]), (store.keys, like["key"])]
            tails.append((store.inputs, like["input"]) if store.ratio > 1 else (store.inputs, None))
        names = ("stream", "pre", *_CHOICES[: plan.n_choices])
        tails += [(shared.tails[name], like[name]) for name in names]
        self.tails = tails
        self._metas = (ctypes.POINTER(kernels.TailMeta) * len(tails))(*(ctypes.pointer(t.meta) for t, _ in tails))
        self.address = ctypes.addressof(self._metas)
        # a step of this row alone: its arguments, rewritten in place (V41Plan.step)
        self.one = (ctypes.c_void_p * 1)(self.address)
        self.position, self.token, self.slot = (ctypes.c_long * 1)(), (ctypes.c_long * 1)(), (ctypes.c_long * 1)()

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the state builds its own (these point at the original's tails)

    def make_room(self) -> None:
        """Room for one more position in each tail the kernel writes (a full one moves to a larger buffer)."""
        for tail, like in self.tails:
            if like is not None and (tail.meta.room < 1 or not tail.meta.buf):
                tail.reserve(1, like)


class RowPlaces:
    """The addresses and counts a prefill chunk's or a replay's V41Rows points at, by field name (each a flat list:
    (B, L) windows, (B, MAX_STORES) stores, (B) replay tails; 0 where a row has nothing there)."""

    def __init__(self, B: int, L: int):
        self.L, S = L, kernels.MAX_STORES
        self.arrays = {name: [0] * (B * L) for name in ("windows", "window_n")}
        self.arrays |= {name: [0] * (B * S) for name in ("latents", "keys", "n_entries", "pending")}
        self.arrays |= {name: [0] * B for name in ("stream", "pre", "selection_idx", "selection_valid", "pool_idx",
                                                   "pool_valid")}

    def rows(self, B: int) -> kernels.V41Rows:
        """The V41Rows of these arrays, laid end to end in one C array (kept alive with this object)."""
        flat, offsets = [], {}
        for name, values in self.arrays.items():
            offsets[name] = len(flat)
            flat += values
        self._held = (ctypes.c_long * len(flat))(*flat)
        base, size = ctypes.addressof(self._held), ctypes.sizeof(ctypes.c_long)
        return kernels.V41Rows(B=B, **{name: base + size * offset for name, offset in offsets.items()})
