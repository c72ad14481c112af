"""Shape of a DeepSeek-V4.1 model: one frozen config with the release's `text_config` names, its presets, its
per-layer role table and its parameter count per part.

V4.1 is a causal encoder-decoder (tech report §4.2.1): layers below the last KV source E (20 in the release) are
the encoder; E is the first decoder layer. KV sources (2, 8, 14, 20) own a compressor that writes the global KV
of their group; index sources (2, 8, 14, 20, 24, 28, 32, 36) score those entries with their own indexer queries;
every other layer reuses the KV of the nearest source at or below it and the top-k of the nearest index source.
Decoder layers read only layer E's KV, so the global KV never depends on a decoder adapter.

Fields that the reference (../shared/reference/deepseek_v41.md §1.1) gives by name carry that name. The Engram,
DSpark and vision sub-shapes are spelled here as `engram_*`, `dspark_*` and `vision_*` (the reference gives their
values but not the release's own key for each): `from_hf` reads them from `text_config` / `vision_config`
under these names and `to_hf` writes them back, so a round trip is exact.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
MODEL_TYPE = "deepseek_v41"


class V41ConfigError(ValueError):
    """A V4.1 shape that breaks one of the rules the engine relies on."""


@dataclass(frozen=True)
class V41LayerRole:
    """What one backbone layer does, expanded once from the config (tech report §4.2.1, "Full / Reuse / Reindex")."""

    index: int
    mode: str  # swa | encoder-full | encoder-reuse | encoder-reindex | decoder-full | decoder-reuse | decoder-reindex
    ratio: int  # compress ratio: 0 = sliding window only, 1 = one latent per token, >=2 = softmax-gated pool
    is_decoder: bool
    is_kv_source: bool  # owns a compressor (+ indexer keys): writes the global KV of its group
    is_index_source: bool  # owns indexer queries (wq_b, weights_proj): picks a new top-k
    is_candidate_source: bool  # publishes the candidate pool later index sources score inside
    uses_candidates: bool  # an index source above the candidate source: scores only inside the pool
    kv_source: int | None  # whose global KV this layer reads (nearest source at or below); None = window only
    selection_layer: int | None  # whose top-k this layer uses (nearest index source at or below)
    rope: str  # "main" (theta rope_theta, ratio-0 layers) or "compress" (compress_rope_theta with YaRN)
    has_engram: bool


@dataclass(frozen=True)
class V41Config:
    # -- vocabulary and trunk
    vocab_size: int = 129280  # token embedding rows and head outputs
    hidden_size: int = 5120  # C: width of each of the hc_mult residual streams
    num_hidden_layers: int = 40  # backbone layers (DSpark's layers come after, see num_nextn_predict_layers)
    rms_norm_eps: float = 1e-20  # every RMSNorm (V4 used 1e-6)
    tie_word_embeddings: bool = False  # the release has a separate `head.weight`
    max_position_embeddings: int = 1048576  # the longest context the rope tables are made for
    # -- attention: MQA over one shared K=V latent
    num_attention_heads: int = 64  # H query heads
    num_key_value_heads: int = 1  # one shared latent (K = V); only 1 is supported
    head_dim: int = 512  # D: latent width and query head width
    qk_rope_head_dim: int = 64  # trailing dims of each head that get (interleaved) RoPE
    q_lora_rank: int = 1280  # low-rank query: wq_a (C -> q_lora_rank), q_norm, wq_b (-> H*D)
    o_groups: int = 8  # grouped output projection: wo_a maps each group of H/o_groups heads separately
    o_lora_rank: int = 1024  # per-group width after wo_a; wo_b maps o_groups*o_lora_rank -> C
    sliding_window: int = 128  # W: every layer attends to the last W positions (the query included)
    rope_theta: float = 10000.0  # main rope base (ratio-0 layers)
    compress_rope_theta: float = 160000.0  # compress rope base (layers that read a global KV), with YaRN below
    rope_scaling_factor: float = 16.0  # YaRN factor of the compress rope ("rope_scaling.factor" in config.json)
    rope_scaling_original_max_position_embeddings: int = 65536  # YaRN original context
    rope_scaling_beta_fast: float = 32.0  # YaRN ramp, fast end
    rope_scaling_beta_slow: float = 1.0  # YaRN ramp, slow end
    # -- global KV (CSA2) and the indexer
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)  # per layer incl. DSpark layers
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)  # the only layers with a compressor; max = decoder start
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)  # the only layers with indexer queries
    candidate_source_layer_id: int = 20  # publishes the candidate pool (must be the first decoder layer)
    candidate_topk_blocks: int = 2048  # blocks in the pool (0 = no pool)
    candidate_block_size: int = 8  # entries per candidate block
    index_n_heads: int = 32  # indexer query heads
    index_head_dim: int = 128  # indexer query/key width
    index_topk: int = 512  # global entries each query attends to
    # -- MoE FFN (every layer)
    n_routed_experts: int = 384  # routed experts per layer
    num_experts_per_tok: int = 6  # top-k experts per token
    n_shared_experts: int = 1  # shared expert(s), always on (width n_shared_experts * moe_intermediate_size)
    moe_intermediate_size: int = 2304  # SwiGLU width of each expert
    scoring_func: str = "sqrtsoftplus"  # router score: sqrt(softplus(logit)) (or softmax / sigmoid)
    topk_method: str = "noaux_tc"  # the bias picks experts, the unbiased scores weight them
    routed_scaling_factor: float = 1.5  # routed experts' sum is scaled by this
    norm_topk_prob: bool = True  # the chosen scores are normalised to sum 1 before scaling
    swiglu_limit: float = 10.0  # routed experts clamp gate (above) and up (both sides) at this
    # -- mHC residual
    hc_mult: int = 4  # residual streams
    hc_sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations for the stream-mixing matrix
    hc_eps: float = 1e-6  # floor in the mHC normalisations
    # -- Engram (n-gram memory; encoder layers only)
    engram_layer_ids: tuple[int, ...] = (1, 14)  # layers with an Engram memory
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)  # table rows, one per Engram layer
    engram_ngram_size: int = 4  # n-gram size (orders 2..n are hashed)
    engram_n_heads: int = 8  # hash heads per order
    engram_head_dim: int = 256  # width of one table row
    engram_vocab_size: int = 99092  # tokenizer-derived compressed vocabulary
    engram_pad_id: int = 2  # padding id of the compressed vocabulary
    # -- DSpark (multi-token prediction; not run by this engine, counted only)
    num_nextn_predict_layers: int = 3  # DSpark draft layers (`mtp.N.*`)
    dspark_block_size: int = 5  # draft block length
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)  # backbone layers whose attention inputs it reads
    dspark_n_routed_experts: int = 128  # routed experts of each draft layer
    dspark_num_experts_per_tok: int = 3
    dspark_markov_rank: int = 256  # rank of the Markov head
    # -- vision tower (not run by this engine, counted only; 0 layers = none)
    vision_num_hidden_layers: int = 32
    vision_hidden_size: int = 1024
    vision_num_attention_heads: int = 16
    vision_intermediate_size: int = 4096  # inference: the reference does not give it; 4 x hidden (ViT default)
    vision_patch_size: int = 14
    vision_downsample: int = 3  # patches merged per side before the aligner
    image_token_id: int = 129264
    # -- engine
    dtype: str = "bfloat16"  # the dtype the engine computes in (checkpoint storage dtypes are checkpoint.py's)
    # derived in __post_init__
    roles: tuple[V41LayerRole, ...] = field(init=False, repr=False, compare=False)
    decoder_start: int = field(init=False, repr=False, compare=False)  # E = max(kv_source_layer_ids)

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            if list(getattr(self, name)) != sorted(getattr(self, name)):
                raise V41ConfigError(f"{name} must be increasing, got {getattr(self, name)}")
        self._validate()
        object.__setattr__(self, "decoder_start", max(self.kv_source_layer_ids))
        object.__setattr__(self, "roles", self._expand_roles())

    def _validate(self):
        def need(ok, message):
            if not ok:
                raise V41ConfigError(message)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
                     "max_position_embeddings"):
            need(int(getattr(self, name)) > 0, f"{name} must be a positive integer, got {getattr(self, name)!r}")
        L = self.num_hidden_layers
        need(self.num_key_value_heads == 1, f"num_key_value_heads must be 1 (one shared K=V latent), "
                                            f"got {self.num_key_value_heads}")
        need(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim,
             f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most head_dim ({self.head_dim})")
        need(self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads ({self.num_attention_heads}) must split into o_groups ({self.o_groups})")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        need(self.n_shared_experts >= 0 and self.candidate_topk_blocks >= 0 and self.num_nextn_predict_layers >= 0,
             "n_shared_experts, candidate_topk_blocks and num_nextn_predict_layers must not be negative")
        need(self.scoring_func in SCORING_FUNCS,
             f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        need(self.topk_method == "noaux_tc", f"topk_method must be 'noaux_tc', got {self.topk_method!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.rms_norm_eps >= 0 and self.hc_eps > 0, "rms_norm_eps must be >= 0 and hc_eps > 0")
        need(len(self.compress_ratios) == L + self.num_nextn_predict_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries; expected num_hidden_layers + "
             f"num_nextn_predict_layers = {L + self.num_nextn_predict_layers}")
        need(all(r >= 0 for r in self.compress_ratios), f"compress_ratios must not be negative: {self.compress_ratios}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            layers = getattr(self, name)
            need(len(set(layers)) == len(layers), f"{name} has duplicates: {layers}")
            bad = [i for i in layers if not 0 <= i < L]
            need(not bad, f"{name} {bad} out of range 0..{L - 1}")
        sources, ratios = self.kv_source_layer_ids, self.compress_ratios
        need(len(sources) > 0, "kv_source_layer_ids is empty: the first decoder layer must be a KV source")
        E = max(sources)
        need(0 < E < L - 1, f"the last KV source ({E}) is the first decoder layer: it must leave at least one "
                            f"encoder layer and one more decoder layer (num_hidden_layers={L})")
        need(ratios[E] == 1, f"the first decoder layer {E} must write one latent per token (compress ratio 1), "
                             f"got ratio {ratios[E]}")
        for i in range(L):
            below = [s for s in sources if s <= i]
            if not below:
                need(ratios[i] == 0, f"layer {i} lies below the first KV source {sources[0]}, so it has no global KV "
                                     f"to read: its compress ratio must be 0, got {ratios[i]}")
            else:
                need(ratios[i] == ratios[below[-1]] and ratios[i] > 0,
                     f"layer {i} reads KV source {below[-1]} (ratio {ratios[below[-1]]}) but has compress ratio "
                     f"{ratios[i]}: a layer's ratio must equal its source's, and a source's must be positive")
        missing = [s for s in sources if s not in self.index_source_layer_ids]
        need(not missing, f"KV sources {missing} must also be index sources (each source starts a new top-k)")
        early = [i for i in self.index_source_layer_ids if i < sources[0]]
        need(not early, f"index sources {early} lie below the first KV source {sources[0]}: nothing to index")
        need(self.candidate_source_layer_id == E,
             f"candidate_source_layer_id ({self.candidate_source_layer_id}) must be the first decoder layer {E}: the "
             "pool is adapter-free state shared by the decoder")
        late = [i for i in self.engram_layer_ids if i >= E]
        need(not late, f"engram layers {late} lie in the decoder (>= {E}): Engram must stay adapter-independent")
        need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
             f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
             f"{len(self.engram_layer_ids)} engram layers")
        need(self.vision_num_hidden_layers >= 0, "vision_num_hidden_layers must not be negative")

    def _expand_roles(self) -> tuple[V41LayerRole, ...]:
        E, roles, source, selector = self.decoder_start, [], None, None
        for i in range(self.num_hidden_layers):
            is_source, is_index = i in self.kv_source_layer_ids, i in self.index_source_layer_ids
            source = i if is_source else source
            selector = i if is_index else selector
            side = "decoder" if i >= E else "encoder"
            if source is None:
                mode = "swa"
            else:
                mode = f"{side}-" + ("full" if is_source else "reindex" if is_index else "reuse")
            roles.append(V41LayerRole(
                index=i, mode=mode, ratio=self.compress_ratios[i], is_decoder=i >= E, is_kv_source=is_source,
                is_index_source=is_index, is_candidate_source=i == self.candidate_source_layer_id,
                uses_candidates=is_index and i > self.candidate_source_layer_id and self.candidate_topk_blocks > 0,
                kv_source=source, selection_layer=selector if source is not None else None,
                rope="main" if source is None else "compress", has_engram=i in self.engram_layer_ids))
        return tuple(roles)

    # -- derived facts -------------------------------------------------------------------------------------

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def encoder_layers(self) -> range:
        return range(self.decoder_start)

    @property
    def adapter_bound_layers(self) -> range:
        """Decoder layers above the first: their windows depend on the adapter."""
        return range(self.decoder_start + 1, self.num_hidden_layers)

    @property
    def h19_layer(self) -> int:
        return self.decoder_start - 1

    # the `ced` family's names for the same facts, which the server reads off any engine's config
    @property
    def max_context(self) -> int:
        """The longest conversation a state may hold: the context the rope tables are made for."""
        return self.max_position_embeddings

    @property
    def window(self) -> int:
        return self.sliding_window

    @property
    def hc_dim(self) -> int:
        """Rows of one mHC projection: pre (hc) + post (hc) + comb (hc x hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict) -> "V41Config":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - names)
        if unknown:
            raise V41ConfigError(f"unknown V4.1 config fields: {unknown}")
        return cls(**values)

    def replace(self, **changes) -> "V41Config":
        return V41Config.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_name(cls, name: str, **overrides) -> "V41Config":
        if name not in PRESETS:
            raise V41ConfigError(f"unknown V4.1 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    # -- config.json ---------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config_json: dict) -> "V41Config":
        """From the release's composite config.json (`model_type: deepseek_v41`, `text_config`, `vision_config`).
        Keys this engine does not use (token ids, quantization_config, ...) are dropped, listed in the debug log."""
        if config_json.get("model_type") != MODEL_TYPE:
            raise V41ConfigError(f"config.json has model_type {config_json.get('model_type')!r}, expected "
                                 f"{MODEL_TYPE!r}")
        text = config_json.get("text_config")
        if not isinstance(text, dict):
            raise V41ConfigError("config.json has no text_config object (the release nests the text model there)")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        values = {k: v for k, v in text.items() if k in names}
        scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if isinstance(scaling.get("compress"), dict):  # transformers' nesting: {"main": ..., "compress": ...}
            scaling = scaling["compress"]
        if scaling:
            if scaling.get("type", scaling.get("rope_type")) != "yarn":
                raise V41ConfigError(f"text_config.rope_scaling must be YaRN, got {scaling!r}")
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if key in scaling:
                    values[f"rope_scaling_{key}"] = scaling[key]
        vision = config_json.get("vision_config")
        if vision is None:
            values["vision_num_hidden_layers"] = 0
        else:
            for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                        "patch_size", "downsample"):
                if key in vision:
                    values[f"vision_{key}"] = vision[key]
        if "image_token_id" in config_json:
            values["image_token_id"] = config_json["image_token_id"]
        if isinstance(values.get("dtype"), str) or "torch_dtype" in text:
            values["dtype"] = values.get("dtype", text.get("torch_dtype"))
        dropped = sorted(set(text) - names - {"rope_scaling", "rope_parameters", "torch_dtype"})
        if dropped:
            log.debug("deepseek_v41 config: text_config keys not used by this engine: %s", dropped)
        return cls.from_dict(values)

    def to_hf(self) -> dict:
        """The composite config.json this config reads back from (`from_hf(c.to_hf()) == c`)."""
        text = {name: list(v) if isinstance(v, tuple) else v for name, v in self.to_dict().items()
                if not name.startswith(("rope_scaling_", "vision_")) and name != "image_token_id"}
        text["rope_scaling"] = {"type": "yarn", "factor": self.rope_scaling_factor,
                                "original_max_position_embeddings": self.rope_scaling_original_max_position_embeddings,
                                "beta_fast": self.rope_scaling_beta_fast, "beta_slow": self.rope_scaling_beta_slow}
        out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE, "text_config": text,
               "image_token_id": self.image_token_id}
        if self.vision_num_hidden_layers:
            out["vision_config"] = {key: getattr(self, f"vision_{key}") for key in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "patch_size",
                "downsample")}
        return out


# -- parameter counts without weights --------------------------------------------------------------------------

def _moe(C: int, F: int, n_experts: int, n_shared: int) -> int:
    gate = n_experts * C + 2 * n_experts  # gate.weight, gate.bias (selection), gate.bias_vl (image tokens)
    return gate + n_experts * 3 * C * F + 3 * C * F * n_shared


def _attention(config: V41Config) -> int:
    C, H, D, Q = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
    G, R = config.o_groups, config.o_lora_rank
    return (Q * C + Q + H * D * Q  # wq_a, q_norm, wq_b
            + D * C + D  # wkv, kv_norm
            + G * R * (H * D // G) + C * G * R  # wo_a, wo_b
            + H)  # attn_sink


def _mhc(config: V41Config) -> int:
    C, n = config.hidden_size, config.hc_mult
    return 2 * (config.hc_dim * n * C + config.hc_dim + 3)  # hc_{attn,ffn}_{fn,base,scale}


def layer_parameters(config: V41Config, role: V41LayerRole) -> int:
    """Parameters of backbone layer `role.index`, exactly as DeepseekV41ForCausalLM allocates them."""
    C, D, Q = config.hidden_size, config.head_dim, config.q_lora_rank
    n = _attention(config) + _mhc(config) + 2 * C  # + attn_norm, ffn_norm
    n += _moe(C, config.moe_intermediate_size, config.n_routed_experts, config.n_shared_experts)
    if role.is_kv_source:
        n += D * C * (2 if role.ratio > 1 else 1) + D  # compressor.wkv (+ wgate), compressor.norm
        n += config.index_head_dim * D + config.index_head_dim  # indexer.wk, indexer.k_norm
    if role.is_index_source:
        n += config.index_n_heads * config.index_head_dim * Q + config.index_n_heads * C  # indexer.wq_b, weights_proj
    return n


def parameter_counts(config: V41Config) -> dict[str, int]:
    """Parameters per part from the shape alone (no weights): backbone (embed, layers, norm, head), Engram, DSpark,
    vision. The backbone count is exact for this engine's model (a test compares it with a built model). Engram,
    DSpark and vision are counted from the reference's tensor shapes; where a shape is not given, the assumption
    is named beside it."""
    C, V = config.hidden_size, config.vocab_size
    backbone = V * C * (1 if config.tie_word_embeddings else 2) + C
    backbone += sum(layer_parameters(config, role) for role in config.roles)
    # Engram per layer: the n-gram table [rows, head_dim], wkv [(hc+1)*C, (n-1)*heads*head_dim] ([25600, 6144] in
    # the release; the factorisation is inference), q_weight and k_weight [hc, C].
    hashed = (config.engram_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
    engram = sum(rows * config.engram_head_dim + (config.hc_mult + 1) * C * hashed + 2 * config.hc_mult * C
                 for rows in config.engram_num_embeddings)
    # DSpark: each draft layer a full block (SWA attention, 128-expert MoE + shared, mHC, norms), main_proj
    # [C, targets*C] on mtp.0, a rank-r Markov head (assumed [V, r] + [r, C]) and a confidence head [1, C].
    dspark = 0
    if config.num_nextn_predict_layers:
        block = (_attention(config) + _mhc(config) + 2 * C
                 + _moe(C, config.moe_intermediate_size, config.dspark_n_routed_experts, config.n_shared_experts))
        dspark = (config.num_nextn_predict_layers * block + len(config.dspark_target_layer_ids) * C * C
                  + config.dspark_markov_rank * (V + C) + C)
    # Vision: ViT layers (qkv + out, 2-matrix MLP, two norms with bias), patch embedding, aligner w1/w2 onto C,
    # image_start/end/newline. intermediate size is an assumption (see the field).
    vision = 0
    if config.vision_num_hidden_layers:
        h, i = config.vision_hidden_size, config.vision_intermediate_size
        layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
        merged = h * config.vision_downsample ** 2
        vision = (config.vision_num_hidden_layers * layer + 3 * config.vision_patch_size ** 2 * h + h
                  + merged * C + C * C + 3 * C)
    return {"backbone": backbone, "engram": engram, "dspark": dspark, "vision": vision}


PRESETS: dict[str, dict] = {
    # The released DeepSeek-V4.1-Flash text model (reference §1.1): the dataclass defaults.
    "deepseek-v4.1-flash": dict(),
    # Tests: every role at 4+4 layers. Layer 0 window only; 1 an encoder Full source at ratio 2, 2-3 Reuse;
    # 4 the first decoder layer, Full at ratio 1 and candidate source; 5 and 7 Reuse; 6 Reindex inside the pool.
    "v41-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=8, rms_norm_eps=1e-6, max_position_embeddings=4096,
        num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=8, rope_scaling_original_max_position_embeddings=256,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 4, 6),
        candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=2,
        index_n_heads=2, index_head_dim=16, index_topk=4,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        hc_mult=4, hc_sinkhorn_iters=20, engram_layer_ids=(), engram_num_embeddings=(),
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), vision_num_hidden_layers=0, image_token_id=255,
        dtype="float32"),    # The trained demo (`mol2 build demo --family deepseek_v41`, docs/demo_model.md): v41-tiny's roles at a width
    # that trains on two CPU cores, the release's window (128) and mHC (4 streams, Sinkhorn 20); 8 routed experts
    # top-2 + 1 shared. The vocabulary is the demo tokenizer's (the build sizes it to the tokenizer).
    "v41-demo": dict(
        vocab_size=8192, hidden_size=128, num_hidden_layers=8, rms_norm_eps=1e-6, max_position_embeddings=32768,
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        sliding_window=128, rope_scaling_original_max_position_embeddings=2048,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 4, 6),
        candidate_source_layer_id=4, candidate_topk_blocks=16, candidate_block_size=8,
        index_n_heads=4, index_head_dim=32, index_topk=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        hc_mult=4, hc_sinkhorn_iters=20, engram_layer_ids=(), engram_num_embeddings=(),
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), vision_num_hidden_layers=0, image_token_id=8191,
        dtype="float32"),
}
