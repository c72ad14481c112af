"""DeepSeek-V4.1's checkpoint as released: native names, per-name storage dtypes, sharded safetensors with an index.

A model directory holds `config.json` (the composite: `architectures`, `model_type: deepseek_v41`, `text_config`,
`quantization_config`), shards `model-0000k-of-0000N.safetensors` and `model.safetensors.index.json`
(`metadata.total_size` = payload bytes, `weight_map` = tensor name -> shard). Facts: ../shared/reference/deepseek_v41.md
§1.1 (config, accounting) and §1.2 (names, shapes, dtypes).

How each tensor is stored is decided by its native name alone (`STORAGE_RULES`, first match wins):

    FP8  `X.weight` float8_e4m3fn + `X.scale` float8_e8m0fnu, one scale per 32x32 block ([ceil(out/32), ceil(in/32)]):
         attention wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b (and wk), shared experts; Engram embed with 1x32 blocks
    FP4  `X.weight` int8 [out, in/2] (two e2m1 per byte, low nibble first) + `X.scale` [out, in/32]: routed experts
    F32  mHC `hc_*`, `attn_sink`, `ffn.gate.bias`/`bias_vl`, the norms (but the compressor's)
    BF16 `embed`, `head`, the compressor, `indexer.weights_proj`, `ffn.gate.weight`, and anything no rule names

A missing tensor, an unexpected one, a wrong shape or dtype, a scale that does not fit its weight, or an index that
names an absent shard is refused before any weight is read, with a `CheckpointError` that names the tensor.
Reading is lazy: the headers first (no payload), then one shard at a time through `safe_open`, each weight
dequantised into the engine's dtype as it is copied in.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from . import quant

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# as released (§1.1): block-wise FP8 with power-of-two scales, experts in FP4
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                       "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
DEFAULT_SHARD_BYTES = 5 * 2**30


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; `tensor` is the native name at fault (or the shard file)."""

    def __init__(self, tensor: str, problem: str):
        super().__init__(f"{tensor}: {problem}")
        self.tensor = tensor


# --- storage rule ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{list(self.shape)} {SAFETENSORS_DTYPE.get(self.dtype, self.dtype)}"


# the names safetensors writes in its header, used in messages so they read like the release's header checks
SAFETENSORS_DTYPE = {torch.float8_e4m3fn: "F8_E4M3", quant.UE8M0_DTYPE: "F8_E8M0", torch.int8: "I8",
                     torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


@dataclass(frozen=True)
class Storage:
    """How one logical tensor lies on disk. `block` is the scale's block (FP8) or (1, values per scale) (FP4)."""

    kind: str                                   # "fp8" | "fp4" | "bf16" | "f32"
    block: tuple[int, int] = (quant.BLOCK, quant.BLOCK)

    def files(self, name: str, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        """The tensors this logical tensor becomes: the weight, and its `.scale` when quantised."""
        if self.kind in ("bf16", "f32"):
            return {name: TensorSpec(shape, torch.bfloat16 if self.kind == "bf16" else torch.float32)}
        if len(shape) != 2 or not name.endswith(".weight"):
            raise CheckpointError(name, f"{self.kind} storage needs a 2-D `.weight`, not shape {list(shape)}")
        scale = quant.scale_shape(shape, self.block)
        if self.kind == "fp8":
            return {name: TensorSpec(shape, torch.float8_e4m3fn),
                    scale_name(name): TensorSpec(scale, quant.UE8M0_DTYPE)}
        if shape[1] % 2:
            raise CheckpointError(name, f"FP4 packs two values per byte: input dimension {shape[1]} is odd")
        return {name: TensorSpec((shape[0], shape[1] // 2), torch.int8),
                scale_name(name): TensorSpec(scale, quant.UE8M0_DTYPE)}

    def encode(self, name: str, value: Tensor) -> dict[str, Tensor]:
        if self.kind == "bf16":
            return {name: value.detach().to(torch.bfloat16).contiguous()}
        if self.kind == "f32":
            return {name: value.detach().to(torch.float32).contiguous()}
        if self.kind == "fp8":
            weight, scale = quant.quantize_fp8(value.detach(), self.block)
        else:
            weight, scale = quant.quantize_fp4(value.detach(), self.block[1])
        return {name: weight, scale_name(name): scale}

    def decode(self, name: str, stored: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        weight = stored[name]
        if self.kind in ("bf16", "f32"):
            return weight.to(dtype)
        scale = stored[scale_name(name)]
        if self.kind == "fp8":
            return quant.dequantize_fp8(weight, scale, self.block, dtype)
        return quant.dequantize_fp4(weight, scale, self.block[1], dtype)


FP8, FP8_ROWS, FP4 = Storage("fp8"), Storage("fp8", (1, quant.BLOCK)), Storage("fp4", (1, quant.BLOCK))
BF16, F32 = Storage("bf16"), Storage("f32")

# (pattern searched in the native name, storage, source). "§" = the reference file; "inferred" = not stated there.
STORAGE_RULES: tuple[tuple[str, Storage, str], ...] = (
    (r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$", FP4, "§1.2 MoE: I8 [out, in/2] + scale [out, in/32]"),
    (r"(^|\.)engram\.embed\.weight$", FP8_ROWS, "§1.2 Engram: [N, 256] FP8 + [N, 8] scale"),
    (r"(^|\.)hc_[a-z_]+$", F32, "§1.2 mHC: F32"),
    (r"(^|\.)attn_sink$", F32, "§1.2 attention: sink F32"),
    (r"(^|\.)ffn\.gate\.bias(_vl)?$", F32, "§1.2 MoE: both biases F32"),
    (r"(^|\.)(attn_norm|ffn_norm)\.weight$", F32, "§1.2 mHC row: F32"),
    (r"(^|\.)(embed|head)\.weight$", BF16, "§1.2 head BF16; embed inferred from the BF16 accounting (§1.1)"),
    (r"(^|\.)attn\.compressor\.", BF16, "§1.2 compressor: BF16 (norm included)"),
    (r"(^|\.)attn\.indexer\.weights_proj\.weight$", BF16, "§1.2 indexer: weights_proj BF16"),
    (r"(^|\.)attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$", FP8, "§1.2 attention: FP8 + 32x32 scale"),
    (r"(^|\.)attn\.indexer\.wq_b\.weight$", FP8, "§1.2 indexer: wq_b FP8"),
    (r"(^|\.)attn\.indexer\.wk\.weight$", FP8, "inferred: a dense projection like wq_b"),
    (r"(^|\.)ffn\.shared_experts\.w[123]\.weight$", FP8, "§1.2 MoE: shared experts FP8"),
    (r"(^|\.)engram\.wkv\.weight$", FP8, "§1.1 accounting: Engram in F8_E4M3"),
    (r"(^|\.)ffn\.gate\.weight$", BF16, "inferred: router kept in BF16"),
    (r"norm\.(weight|bias)$", F32, "inferred: the other norms like attn_norm"),
)
_RULES = tuple((re.compile(pattern), storage) for pattern, storage, _ in STORAGE_RULES)


def storage_for(name: str) -> Storage:
    """The storage of a native name: the first rule that matches; BF16 when none does (DSpark projections, vision)."""
    return next((storage for pattern, storage in _RULES if pattern.search(name)), BF16)


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def stored_specs(logical: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[TensorSpec, str]]:
    """{native name: shape} of the model -> {file tensor name: (spec, the logical name it belongs to)}."""
    specs = {}
    for name, shape in logical.items():
        for file_name, spec in storage_for(name).files(name, tuple(shape)).items():
            if file_name in specs:
                raise CheckpointError(file_name, f"named twice (by {specs[file_name][1]} and {name})")
            specs[file_name] = (spec, name)
    return specs


def fake_quantize(state_dict: Mapping[str, Tensor], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Each weight as it comes back from the checkpoint: stored, then dequantised into `dtype`."""
    out = {}
    for name, value in state_dict.items():
        storage = storage_for(name)
        out[name] = storage.decode(name, storage.encode(name, value), dtype)
    return out


# --- writing --------------------------------------------------------------------------------------------------------

def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(specs: Mapping[str, tuple[TensorSpec, str]], max_shard_bytes: int) -> list[list[str]]:
    """Logical names in order, packed into shards of at most `max_shard_bytes` (a weight and its scale together;
    one bigger than the limit gets a shard of its own)."""
    sizes: dict[str, int] = {}
    for spec, logical in specs.values():
        sizes[logical] = sizes.get(logical, 0) + spec.nbytes()
    shards: list[list[str]] = [[]]
    filled = 0
    for logical, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(logical)
        filled += size
    return shards


def composite_config(config) -> dict:
    """config.json as released: the composite around `text_config`, with `quantization_config`. Takes a V41Config
    (its `to_hf()`), a text_config dict, or an already composite dict."""
    hf = config.to_hf() if hasattr(config, "to_hf") else dict(config)
    if "text_config" not in hf:
        hf = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": hf}
    hf.setdefault("architectures", [ARCHITECTURE])
    hf.setdefault("model_type", MODEL_TYPE)
    hf.setdefault("quantization_config", dict(QUANTIZATION_CONFIG))
    return hf


@dataclass(frozen=True)
class WriteSummary:
    directory: Path
    shards: int
    tensors: int            # tensors in the files (weights and scales)
    parameters: int         # logical parameters
    payload_bytes: int      # = metadata.total_size

    @property
    def bytes_per_parameter(self) -> float:
        return self.payload_bytes / max(self.parameters, 1)


def write_checkpoint(directory: str | Path, config, state_dict: Mapping[str, Tensor],
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: Callable[[int], None] | None = None) -> WriteSummary:
    """Write `state_dict` (native names, any float dtype) as the release lays it out. Shards are quantised and
    written one at a time; `progress(n)` is called with the number of logical tensors each shard finished. Shards
    of an earlier write that the new index does not name are removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specs = stored_specs({name: tuple(value.shape) for name, value in state_dict.items()})
    shards = plan_shards(specs, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, start=1):
        file = shard_name(number, len(shards))
        tensors = {}
        for name in names:
            tensors.update(storage_for(name).encode(name, state_dict[name]))
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        (directory / file).chmod(0o644)  # safetensors creates 0600; a model directory is read by servers
        weight_map.update(dict.fromkeys(tensors, file))
        if progress:
            progress(len(names))
    for stale in set(directory.glob("model-*-of-*.safetensors")) - {directory / f for f in weight_map.values()}:
        stale.unlink()
    payload = sum(spec.nbytes() for spec, _ in specs.values())
    index = {"metadata": {"total_size": payload}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(composite_config(config), indent=2) + "\n")
    return WriteSummary(directory, len(shards), len(specs), sum(v.numel() for v in state_dict.values()), payload)


# --- reading --------------------------------------------------------------------------------------------------------

def read_weight_map(directory: str | Path) -> dict[str, str]:
    """tensor name -> shard file, from the index (or every tensor of a lone model.safetensors). A shard the index
    names that is absent is refused, naming the shard and the first tensor it should hold."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(INDEX_FILE, f"not a safetensors index ({error})") from None
    elif (directory / SINGLE_FILE).exists():
        with _open(directory, SINGLE_FILE) as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
    else:
        raise CheckpointError(INDEX_FILE, f"{directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    for name, file in weight_map.items():
        if not (directory / file).is_file():
            raise CheckpointError(name, f"the index puts it in shard {file}, which is absent from {directory}")
    return weight_map


def _open(directory: Path, file: str):
    """safe_open, with a damaged header refused by the shard's name."""
    try:
        return safe_open(directory / file, "pt")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(file, f"not a readable safetensors file ({error})") from None


def payload_by_dtype(headers: Mapping[str, tuple[TensorSpec, str]]) -> dict[str, int]:
    """Bytes per safetensors dtype (F8_E4M3, F8_E8M0, I8, BF16, F32), the release's accounting (§1.1)."""
    out: dict[str, int] = {}
    for spec, _ in headers.values():
        key = SAFETENSORS_DTYPE[spec.dtype]
        out[key] = out.get(key, 0) + spec.nbytes()
    return dict(sorted(out.items()))


def read_headers(directory: str | Path, weight_map: Mapping[str, str]) -> dict[str, tuple[TensorSpec, str]]:
    """{tensor name: (shape and dtype from the shard's header, shard)}; no payload is read. A tensor the index
    places in a shard that lacks it, or a shard tensor the index does not list, is refused."""
    directory = Path(directory)
    found: dict[str, tuple[TensorSpec, str]] = {}
    for file in sorted(set(weight_map.values())):
        with _open(directory, file) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _TORCH_DTYPE.get(piece.get_dtype())
                if dtype is None:
                    raise CheckpointError(name, f"stored as {piece.get_dtype()}, a dtype the release does not use")
                if name not in weight_map:
                    raise CheckpointError(name, f"in shard {file} but not in {INDEX_FILE}")
                if weight_map[name] != file:
                    raise CheckpointError(name, f"in shard {file} but the index says {weight_map[name]}")
                found[name] = (TensorSpec(tuple(piece.get_shape()), dtype), file)
    for name, file in weight_map.items():
        if name not in found:
            raise CheckpointError(name, f"the index puts it in shard {file}, which does not hold it")
    return found


_TORCH_DTYPE = {name: dtype for dtype, name in SAFETENSORS_DTYPE.items()}


def validate(expected: Mapping[str, tuple[TensorSpec, str]], found: Mapping[str, tuple[TensorSpec, str]]) -> None:
    """Refuse the first misfit between what the model expects and what the files hold, by name: a missing tensor, an
    unexpected one, a wrong dtype, a wrong shape; a scale whose shape does not fit its weight says so."""
    for name, (spec, logical) in expected.items():
        if name not in found:
            what = f"the scale of {logical}" if name != logical else "a tensor of the model"
            raise CheckpointError(name, f"missing from the checkpoint ({what}, expected {spec})")
    for name in found:
        if name not in expected:
            raise CheckpointError(name, f"unexpected: the model has no such tensor (in shard {found[name][1]})")
    for name, (spec, logical) in expected.items():
        have = found[name][0]
        if have.dtype != spec.dtype:
            raise CheckpointError(name, f"stored as {SAFETENSORS_DTYPE.get(have.dtype, have.dtype)}, the release "
                                        f"stores it as {SAFETENSORS_DTYPE.get(spec.dtype, spec.dtype)}")
        if have.shape != spec.shape:
            if name != logical:
                storage, (rows, cols) = storage_for(logical), expected[logical][0].shape
                shape = [rows, 2 * cols] if storage.kind == "fp4" else [rows, cols]  # FP4: two values per byte
                raise CheckpointError(name, f"scale shape {list(have.shape)} does not fit its weight {logical} "
                                            f"{shape}: {storage.block[0]}x{storage.block[1]} blocks need "
                                            f"{list(spec.shape)}")
            raise CheckpointError(name, f"shape {list(have.shape)}, the model expects {list(spec.shape)}")


def check_checkpoint(directory: str | Path, logical: Mapping[str, tuple[int, ...]],
                     skip_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """Validate a directory against the model's {native name: shape} from headers alone; returns the weight map.
    Tensors under `skip_prefixes` that the model lacks (DSpark, vision: load-and-skip) are left out unchecked."""
    weight_map = read_weight_map(directory)
    found = read_headers(directory, weight_map)
    found = {n: v for n, v in found.items() if n in logical or not n.startswith(skip_prefixes)}
    validate(stored_specs(logical), found)
    return weight_map


def iter_weights(directory: str | Path, logical: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32,
                 weight_map: Mapping[str, str] | None = None) -> Iterator[tuple[str, Tensor]]:
    """(native name, dequantised tensor in `dtype`), shard by shard in file order; validates first unless given the
    weight map `check_checkpoint` returned. Only the shard being read (and a scale's shard) is open at a time."""
    directory = Path(directory)
    weight_map = weight_map if weight_map is not None else check_checkpoint(directory, logical)
    specs = stored_specs(logical)
    members: dict[str, list[str]] = {}
    for file_name, (_, name) in specs.items():
        members.setdefault(name, []).append(file_name)
    by_shard: dict[str, list[str]] = {}
    for name in logical:
        by_shard.setdefault(weight_map[name], []).append(name)
    for file in sorted(by_shard):
        with safe_open(directory / file, "pt") as f:
            for name in by_shard[file]:
                stored = {}
                for member in members[name]:
                    if weight_map[member] == file:
                        stored[member] = f.get_tensor(member)
                    else:  # a scale written into another shard
                        with safe_open(directory / weight_map[member], "pt") as other:
                            stored[member] = other.get_tensor(member)
                yield name, storage_for(name).decode(name, stored, dtype)


# --- the deepseek_v41 model -----------------------------------------------------------------------------------------

def read_config(directory: str | Path):
    """config.json -> V41Config; a directory of another family is refused."""
    from .config import V41Config

    path = Path(directory) / "config.json"
    hf = json.loads(path.read_text())
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointError("config.json", f"model_type {hf.get('model_type')!r}, not {MODEL_TYPE!r}")
    return V41Config.from_hf(hf)


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """{native name: shape} of `DeepseekV41ForCausalLM(config)`, from a model on the meta device (no memory)."""
    from .model import DeepseekV41ForCausalLM

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32):
    """(config, model) from a released-format directory: headers validated against the model built from its
    config (computing in `dtype`), then weights read shard by shard, dequantised, copied in. The model keeps its
    own float32 tensors (mHC, sinks, gate biases) in float32. DSpark and vision tensors are skipped (logged)."""
    from .model import SKIPPED_PREFIXES, DeepseekV41ForCausalLM, skipped_tensors

    config = read_config(directory).replace(dtype=str(dtype).removeprefix("torch."))
    logical = expected_shapes(config)
    weight_map = check_checkpoint(directory, logical, SKIPPED_PREFIXES)
    skipped_tensors([name for name in weight_map if name not in logical])
    model = DeepseekV41ForCausalLM(config)  # built on the CPU: its rope tables are made at init
    params = model.state_dict()
    with torch.no_grad():
        for name, value in iter_weights(directory, logical, torch.float32, weight_map):
            params[name].copy_(value)  # float32 -> the parameter's dtype: one rounding, as a direct decode
    return config, model.eval()


def synthetic_state_dict(config, seed: int = 0) -> dict[str, Tensor]:
    """Random float32 weights under the model's native names and shapes: 2-D and larger ~ N(0, 1/in), norms near
    1, the other vectors (sinks, biases, mHC) small. Generated name by name from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        if len(shape) >= 2:
            out[name] = noise / math.sqrt(shape[-1])
        elif re.search(r"norm\.weight$", name):
            out[name] = 1 + 0.1 * noise
        else:
            out[name] = 0.1 * noise
    return out


def write_synthetic(directory: str | Path, config, seed: int = 0, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Callable[[int], None] | None = None) -> WriteSummary:
    return write_checkpoint(directory, config, synthetic_state_dict(config, seed), max_shard_bytes, progress)

