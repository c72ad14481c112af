"""Disaggregated serving: one Triton server prefills and routes, another decodes; the state travels over gRPC.

`--role decode` loads only the decode models of the repository. `--role prefill` serves a generated repository:
the adapter-free models and routers as they are, and in place of each ensemble `mol2*` a relay model of the same
name and the same inputs and outputs, which sends the turn's state to its decode model on the decode server and
commits the state that comes back. The prefill server owns the conversation store; the decode server owns none.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROLES = ("all", "prefill", "decode")
# not from serving.ROOT: serving imports torch, and `mol2 serve --help` reads ROLES and PAIR_SECRET from here
RELAY_MODEL = Path(__file__).resolve().parents[1] / "triton" / "templates" / "relay_model.py"
PAIR_SECRET = Path(__file__).resolve().parents[2] / "artifacts" / "triton" / "pair.secret"  # a pair on one checkout
_ENGINE_STEP = re.compile(r'model_name: "engine([a-z0-9_]*)"')
# What a relay takes and gives beyond its ensemble's: the engine model's stateless inputs (a whole chat or prompt,
# as the OpenAI API sends them; python_backend/triton/front.py), a turn's ids, logprobs, and the counts the API reports
RELAY_INPUTS = {"_text_ids": "TYPE_INT64 dims: [ -1 ]", "messages": "TYPE_STRING dims: [ 1 ]",
                "prompt": "TYPE_STRING dims: [ 1 ]", "logprobs": "TYPE_INT32 dims: [ 1 ]"}
RELAY_OUTPUTS = {"prompt_tokens": "TYPE_INT32 dims: [ 1 ]", "cached_tokens": "TYPE_INT32 dims: [ 1 ]",
                 "finish_reason": "TYPE_STRING dims: [ 1 ]", "logprobs": "TYPE_STRING dims: [ 1 ]"}


def models_of(repository: Path) -> dict[str, str]:
    """Model name -> config.pbtxt text, for every model directory in the repository."""
    return {path.parent.name: path.read_text() for path in sorted(repository.glob("*/config.pbtxt"))}


def decode_models(repository: Path) -> list[str]:
    return [name for name, config in models_of(repository).items()
            if name == "decode" or name.startswith("decode_")]


def single_server_models(repository: Path) -> list[str]:
    """What one server needs: the engines run whole turns, so decode serves only a split server."""
    return [name for name in models_of(repository) if name not in decode_models(repository)]


def relay_config(ensemble_config: str, name: str, decode_url: str) -> str:
    """The ensemble's config turned into a decoupled Python model with the same inputs and outputs."""
    # The single server runs the turn in its `engine<set>` model; split, the same set's `router<set>` routes here
    # and `decode<set>` decodes on the decode server.
    engine = _ENGINE_STEP.search(ensemble_config)
    if engine is None:
        raise ValueError(f"ensemble {name!r} has no engine step: cannot split it for disaggregation")
    router, decode = f"router{engine[1]}", f"decode{engine[1]}"
    head = ensemble_config[:ensemble_config.index("ensemble_scheduling")]
    head = head.replace('platform: "ensemble"', 'backend: "python"\nmodel_transaction_policy { decoupled: true }')
    # text_input becomes one way of several to give the turn (`messages`, `prompt`, `_text_ids`)
    head = head.replace('{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }',
                        '{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] optional: true }')
    head = _with_tensors(head, "input", {name: f"{kind} optional: true" for name, kind in RELAY_INPUTS.items()})
    head = _with_tensors(head, "output", RELAY_OUTPUTS)
    parameters = {"router_model": router, "decode_model": decode, "decode_url": decode_url}
    lines = [f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}' for key, value in parameters.items()]
    return head.rstrip() + "\ninstance_group [ { kind: KIND_CPU count: 1 } ]\n" + "\n".join(lines) + "\n"


def _with_tensors(config: str, block: str, tensors: dict[str, str]) -> str:
    """`config` with these tensors added at the end of its `input [` or `output [` list (those it lacks)."""
    start = config.index(f"\n{block} [")
    end = config.index("\n]", start)
    lines = [f'  {{ name: "{name}" data_type: {kind} }}' for name, kind in tensors.items()
             if f'name: "{name}"' not in config[start:end]]
    if not lines:
        return config
    return config[:end] + ",\n" + ",\n".join(lines) + config[end:]


def build_prefill_repository(source: Path, dest: Path, decode_url: str) -> list[str]:
    """Write the prefill server's repository into `dest` (replaced); returns the relay models written."""
    if not re.match(r"^[A-Za-z0-9_.\-\[\]:]+:\d+$", decode_url):
        raise ValueError(f"--decode-url must be HOST:PORT of the decode server's gRPC endpoint, got {decode_url!r}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    relays = []
    for name, config in models_of(source).items():
        if name in decode_models(source) or name == "engine" or name.startswith("engine_"):
            continue  # decode runs on the decode server; the single server's engine is not needed
        if 'platform: "ensemble"' in config:
            (dest / name / "1").mkdir(parents=True)
            (dest / name / "config.pbtxt").write_text(relay_config(config, name, decode_url))
            shutil.copy2(RELAY_MODEL, dest / name / "1" / "model.py")
            relays.append(name)
        else:
            shutil.copytree(source / name, dest / name)
    return relays
