"""One real tritonserver for the serving tests: the tiny preset, two PEFT adapters and a seeded MoL2 head, on
loopback ports, started from a copy of this repository's model_repository/ (plus a second adapter set built with
`mol2 repo build`) with MOL2_* settings pointing at a temp dir."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ced import CEDConfig, CEDForCausalLM
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter
from mol2_router.config import RouterConfig
from mol2_router.data import Candidate
from mol2_router.features import RouteTokenizer
from mol2_router.head import PointerHead
from mol2_router.router import MoL2Router
from python_backend.server.launcher import Ports, running
from python_backend.server.repo_build import build
from python_backend.server.roles import build_prefill_repository, decode_models
from python_backend.core.seal import SECRET_VARIABLE, create_secret_file
from python_backend.core.settings import ROOT

ADAPTERS = {"chat": "small talk and jokes", "coding": "Python code"}


@pytest.fixture(scope="session")
def served_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    config = CEDConfig.from_name("tiny")  # no tokenizer.json: text is UTF-8 bytes (ids >= 256 print nothing)
    model = CEDForCausalLM.from_ced(config, seed=0)
    model.save_pretrained(root / "model")
    # An untrained MoL2 head (seeded): it routes deterministically, which is all the serving path needs.
    torch.manual_seed(0)
    head = PointerHead(RouterConfig(hidden_size=config.hidden_size))
    candidates = [Candidate(name, description) for name, description in ADAPTERS.items()]
    MoL2Router(head, model.get_input_embeddings().weight, RouteTokenizer("bytes"), candidates).save(
        root / "router", backbone=root / "model")
    entries = []
    for seed, (name, description) in enumerate(ADAPTERS.items(), start=1):
        make_random_adapter(model, root / "adapters" / name, decoder_modules_regex(config, ATTENTION + FFN),
                            rank=4, seed=seed, scale=0.2)
        entries.append({"name": name, "path": f"adapters/{name}", "description": description})
    (root / "adapter_set.json").write_text(json.dumps({"route_prompt": "Pick one.", "adapters": entries}))
    swapped = [dict(entry, name=f"alt_{entry['name']}") for entry in entries]  # same weights, other names
    (root / "alt_set.json").write_text(json.dumps({"route_prompt": "Pick one.", "adapters": swapped}))
    return root


@pytest.fixture(scope="session")
def start_server(served_dir):
    """A context manager: a tritonserver on fresh loopback ports with MOL2_* settings pointing at `served_dir`
    (its conversation store in `served_dir / store`)."""
    secret = create_secret_file(served_dir / "server.secret")

    def server_on(repository, store: str = "conversations", extra_args=(), log: str = "tritonserver.log",
                  engine: str = "torch"):
        settings = {"MOL2_ENGINE": engine, "MOL2_MODEL_DIR": str(served_dir / "model"),
                    "MOL2_ADAPTER_SET": str(served_dir / "adapter_set.json"),
                    "MOL2_STORE_DIR": str(served_dir / store), "MOL2_ROUTER_DIR": str(served_dir / "router"),
                    SECRET_VARIABLE: str(secret)}  # one for every server: a disaggregated pair shares it
        ports = Ports.free()
        return running(repository, ports, served_dir / "triton", served_dir / log, env=settings,
                       extra_args=list(extra_args))

    return server_on


@pytest.fixture(scope="session")
def repository(served_dir):
    """A copy of model_repository/, plus a second adapter set built with `mol2 repo build`."""
    repository = served_dir / "model_repository"
    shutil.copytree(ROOT / "model_repository", repository)
    build(served_dir / "alt_set.json", repository, name="alt")
    return repository


@pytest.fixture(scope="session")
def server(start_server, repository):
    with start_server(repository) as ports:
        yield ports


@pytest.fixture(scope="session")
def disaggregated(start_server, repository, served_dir):
    """A disaggregated pair, (prefill, decode): the decode models on one server, the relays on the other (shared by
    test_disaggregated.py and test_openai_disaggregated.py, so it starts once)."""
    decode_args = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in decode_models(repository))]
    with start_server(repository, store="decode-store", extra_args=decode_args, log="decode.log") as decode:
        prefill_repository = served_dir / "prefill_repository"
        build_prefill_repository(repository, prefill_repository, decode.grpc_url)
        with start_server(prefill_repository, store="prefill-store", log="prefill.log") as prefill:
            yield prefill, decode
