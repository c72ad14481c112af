"""`mol2 inspect DIR [--json]` / `mol2 inspect --preset NAME`: what a model directory (or a preset) holds.

For a directory: its family (from config.json's `model_type`), parameters per part (backbone, Engram, DSpark, vision),
what its files hold, and one short forward on the CPU. A checkpoint that does not fit its model exits 1 with the
tensor's name. For a preset: the counts alone, from the shape (no weights are made).

Families: `deepseek_v41` (the release's sharded FP8/FP4 layout, ced/deepseek_v41/checkpoint.py) and `ced` (the demo
model, a `save_pretrained` directory). The family comes from ced/families.py; each has an entry in INSPECTORS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("backbone", "engram", "dspark", "vision")


class InspectError(Exception):
    """A directory that cannot be loaded or run; `tensor` names the tensor at fault when there is one."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


@dataclass
class Report:
    family: str
    source: str                                  # the directory, or "preset NAME"
    parameters: dict[str, int]                   # per part
    files: dict = field(default_factory=dict)    # what the checkpoint holds (shards, tensors, bytes)
    forward: dict | None = None                  # tokens, logits shape, finite, seconds

    def to_json(self) -> dict:
        return {"family": self.family, "source": self.source, "parameters": self.parameters,
                "total_parameters": sum(self.parameters.values()), "files": self.files, "forward": self.forward}

    def table(self) -> str:
        lines = [f"{'source':<18} {self.source}", f"{'family':<18} {self.family}"]
        for key, value in self.files.items():
            lines.append(f"{key:<18} {value:,}" if isinstance(value, int) else f"{key:<18} {value}")
        lines.append(f"{'part':<18} {'parameters':>18}")
        for part in PARTS:
            lines.append(f"{part:<18} {self.parameters.get(part, 0):>18,}")
        lines.append(f"{'total':<18} {sum(self.parameters.values()):>18,}")
        if self.forward:
            f = self.forward
            lines.append(f"{'forward':<18} {f['tokens']} tokens -> logits {f['logits_shape']}, "
                         f"{'finite' if f['finite'] else 'NOT FINITE'}, {f['seconds']:.2f} s")
        return "\n".join(lines)


def _forward(model, vocab_size: int, tokens: int) -> dict:
    import torch

    input_ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    try:
        with torch.no_grad():
            out = model(input_ids)
    except RuntimeError as error:
        raise InspectError(f"the forward failed: {str(error).strip().splitlines()[0]}") from None
    logits = out.logits if hasattr(out, "logits") else out
    return {"tokens": tokens, "logits_shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
            "seconds": time.perf_counter() - started}


# --- deepseek_v41 -----------------------------------------------------------------------------------------------------

def _v41_counts(config) -> dict[str, int]:
    from ced.deepseek_v41.config import parameter_counts

    return dict(parameter_counts(config))


def inspect_v41(directory: Path, tokens: int) -> Report:
    import torch

    from ced.deepseek_v41 import checkpoint as K

    try:
        config = K.read_config(directory)
        weight_map = K.read_weight_map(directory)
        headers = K.read_headers(directory, weight_map)
        _, model = K.load_checkpoint(directory, dtype=torch.float32)
    except K.CheckpointError as error:
        raise InspectError(str(error), error.tensor) from None
    except ValueError as error:  # V41ConfigError: a shape the engine refuses (Engram, a broken role table)
        raise InspectError(f"config.json: {error}", "config.json") from None
    files = {"shards": len(set(weight_map.values())), "tensors": len(weight_map),
             "payload_bytes": sum(spec.nbytes() for spec, _ in headers.values())}
    files.update({f"bytes {dtype}": n for dtype, n in K.payload_by_dtype(headers).items()})
    report = Report("deepseek_v41", str(directory), _v41_counts(config), files)
    report.forward = _forward(model, config.vocab_size, tokens)
    return report


# --- ced (the demo model) -----------------------------------------------------------------------------------------

def check_ced_files(directory: Path) -> None:
    """Names and shapes of a `ced` directory's safetensors against the model its config.json makes (from the headers,
    no payload): transformers would otherwise re-initialise a missing tensor, and names no tensor of a wrong shape.
    Any float dtype is accepted (the demo is published in bf16); a tied head may be absent."""
    import torch

    from ced.deepseek_v41 import checkpoint as K
    from ced.model import CEDForCausalLM, CEDPretrainedConfig

    try:
        with torch.device("meta"):
            model = CEDForCausalLM(CEDPretrainedConfig.from_pretrained(str(directory)))
        found = K.read_headers(directory, K.read_weight_map(directory))
    except K.CheckpointError as error:
        raise InspectError(str(error), error.tensor) from None
    except (OSError, ValueError) as error:
        raise InspectError(f"config.json: {error}", "config.json") from None
    tied = set(model._tied_weights_keys or {}) if model.config.tie_word_embeddings else set()
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in found and name not in tied:
            raise InspectError(f"{name}: missing from the checkpoint (expected {list(shape)})", name)
    for name, (spec, file) in found.items():
        if name not in expected:
            raise InspectError(f"{name}: unexpected: the model has no such tensor (in {file})", name)
        if spec.shape != expected[name]:
            raise InspectError(f"{name}: shape {list(spec.shape)}, the model expects {list(expected[name])}", name)
        if not spec.dtype.is_floating_point:
            raise InspectError(f"{name}: stored as {spec.dtype}, the ced family stores floats", name)


def inspect_ced(directory: Path, tokens: int) -> Report:
    from ced.model import CEDForCausalLM

    check_ced_files(directory)
    try:
        model, info = CEDForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as error:  # transformers names the tensor of a shape mismatch
        raise InspectError(f"cannot load {directory}: {str(error).strip().splitlines()[0]}") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        names = sorted(str(n[0] if isinstance(n, tuple) else n) for n in info.get(kind, ()) if n not in tied)
        if names:
            raise InspectError(f"{names[0]}: {kind.replace('_', ' ')[:-1]} in {directory}"
                               + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""), names[0])
    params = {"backbone": sum(p.numel() for p in model.parameters()), "engram": 0, "dspark": 0, "vision": 0}
    files = {"files": ", ".join(sorted(p.name for p in directory.glob("*.safetensors")))}
    report = Report("ced", str(directory), params, files)
    report.forward = _forward(model.float().eval(), model.ced.vocab_size, tokens)
    return report


def ced_preset_counts(name: str) -> dict[str, int]:
    import torch

    from ced.config import CEDConfig
    from ced.model import CEDForCausalLM, CEDPretrainedConfig

    with torch.device("meta"):
        model = CEDForCausalLM(CEDPretrainedConfig.from_ced(CEDConfig.from_name(name)))
    return {"backbone": sum(p.numel() for p in model.parameters()), "engram": 0, "dspark": 0, "vision": 0}


INSPECTORS = {"deepseek_v41": inspect_v41, "ced": inspect_ced}  # by family name (ced/families.py)


def inspect_directory(directory: Path, tokens: int = 8) -> Report:
    from ced.families import UnknownFamily, family_of

    path = directory / "config.json"
    if not path.is_file():
        raise InspectError(f"{directory} holds no config.json: not a model directory", "config.json")
    try:
        found = family_of(json.loads(path.read_text()))
    except ValueError as error:  # not JSON, or a model_type no family reads (UnknownFamily names them)
        reason = error if isinstance(error, UnknownFamily) else f"not JSON ({error})"
        raise InspectError(f"config.json: {reason}", "config.json") from None
    return INSPECTORS[found.name](directory, tokens)


def inspect_preset(name: str) -> Report:
    from ced.config import PRESETS as CED_PRESETS
    from ced.deepseek_v41.config import PRESETS as V41_PRESETS, V41Config

    if name in V41_PRESETS:
        return Report("deepseek_v41", f"preset {name}", _v41_counts(V41Config.from_name(name)))
    if name in CED_PRESETS:
        return Report("ced", f"preset {name}", ced_preset_counts(name))
    raise InspectError(f"unknown preset {name!r}; deepseek_v41: {sorted(V41_PRESETS)}, ced: {sorted(CED_PRESETS)}")


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    try:
        if args.preset:
            report = inspect_preset(args.preset)
        else:
            report = inspect_directory(Path(args.directory), args.tokens)
            if not report.forward["finite"]:
                raise InspectError(f"{args.directory}: the forward gave non-finite logits")
    except InspectError as error:
        if args.json:
            print(json.dumps({"error": str(error), "tensor": error.tensor}))
        print(f"mol2 inspect: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0


def register(commands, **options) -> None:
    p = commands.add_parser("inspect", **options, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", nargs="?", help="a model directory (config.json + safetensors)")
    p.add_argument("--preset", help="count a preset's parameters without weights instead")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--tokens", type=int, default=8, help="tokens in the short forward (default 8)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.set_defaults(run=lambda args: run(args) if (args.directory is None) != (args.preset is None)
                   else p.error("give a model directory or --preset NAME (one of the two)"))

