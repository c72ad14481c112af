"""The benchmark peer: vLLM's CPU build serving a Llama of the demo's size and shape with 4 LoRA adapters.

No weights can be downloaded here, so the peer is built locally (`build_peer`): a `LlamaForCausalLM` with the
demo's dimensions (models/demo/model/config.json: hidden 256, 8 layers, 4 heads of 64, FFN 768, vocab 8192, tied
embeddings), random seeded weights saved in bf16, the demo's own tokenizer.json wrapped as PreTrainedTokenizerFast
(so both servers see the same token counts for the same text), and 4 PEFT LoRA adapters (r=16 on every linear layer,
lora_B non-zero, seeded) in PEFT's on-disk format. Its random weights make its answers noise: the benchmarks only
time it (`ignore_eos` makes every stream run to max_tokens).

vLLM lives in its own venv, `.venv-vllm` (`bash scripts/install_vllm.sh`): it pins a transformers the project's
venv cannot share. `running_vllm(root, port)` starts its OpenAI server there, on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

from python_backend.server.launcher import stop

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DEMO_MODEL = ROOT / "models" / "demo" / "model"
PEER_ROOT = ROOT / "artifacts" / "peer"
ADAPTERS = ("chat", "agent", "coding", "design")  # ours, in order: vLLM's LoRA names a0..a3
LORA_NAMES = {name: f"a{i}" for i, name in enumerate(ADAPTERS)}
MAX_MODEL_LEN = 32768
SKIP_MESSAGE = "vLLM rows skipped: run scripts/install_vllm.sh"
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def vllm_name(adapter: str) -> str:
    """Our adapter name -> the peer's LoRA name (a0..a3); 'base' stays the base model."""
    return LORA_NAMES.get(adapter, adapter)


def _special_tokens(tokenizer_config: dict) -> dict:
    keys = ("bos_token", "eos_token", "pad_token")
    return {key: tokenizer_config[key] for key in keys if key in tokenizer_config}


def build_peer(root: Path = PEER_ROOT, seed: int = 0, force: bool = False) -> Path:
    """model/ (Llama, bf16), its tokenizer, adapters/a0..a3 (PEFT); returns `root`. Skips what is already built
    (`root/built.json` is written last)."""
    root = Path(root)
    marker = root / "built.json"
    if marker.is_file() and not force:
        return root
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    demo = json.loads((DEMO_MODEL / "config.json").read_text())
    tokenizer_config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_MODEL / "tokenizer.json"),
                                        additional_special_tokens=tokenizer_config.get("additional_special_tokens", []),
                                        **_special_tokens(tokenizer_config))
    tokenizer.chat_template = tokenizer_config.get("chat_template")
    config = LlamaConfig(vocab_size=demo["vocab_size"], hidden_size=demo["hidden_size"],
                         intermediate_size=demo["ffn_hidden"], num_hidden_layers=demo["n_layers"],
                         num_attention_heads=demo["n_heads"], num_key_value_heads=demo["n_heads"],
                         head_dim=demo["head_dim"], max_position_embeddings=max(MAX_MODEL_LEN, demo["max_context"]),
                         rms_norm_eps=demo["norm_eps"], rope_theta=demo["rope_theta"],
                         tie_word_embeddings=demo["tie_word_embeddings"], hidden_act="silu",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for index, name in enumerate(LORA_NAMES.values()):
        torch.manual_seed(seed + 1 + index)
        lora = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16),
                              LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LINEAR_MODULES,
                                         task_type="CAUSAL_LM"))
        generator = torch.Generator().manual_seed(seed + 100 + index)
        with torch.no_grad():
            for parameter_name, parameter in lora.named_parameters():
                if "lora_B" in parameter_name:  # PEFT starts B at zero (a no-op adapter): make it a real one
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        lora.save_pretrained(root / "adapters" / name)
    parameters = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"seed": seed, "parameters": parameters, "adapters": LORA_NAMES,
                                  "tokenizer": str(DEMO_MODEL / "tokenizer.json")}, indent=2))
    return root


@lru_cache(maxsize=1)
def vllm_available() -> bool:
    """True when .venv-vllm exists and imports vllm."""
    if not VENV_PYTHON.is_file():
        return False
    try:
        done = subprocess.run([str(VENV_PYTHON), "-c", "import vllm"], capture_output=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def server_command(root: Path, port: int) -> list[str]:
    root = Path(root)
    modules = [f"{name}={root / 'adapters' / name}" for name in LORA_NAMES.values()]
    # --enable-prefix-caching: on by default in vLLM's V1 engine (0.32); named anyway so the peer runs as measured
    return [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "model"),
            "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8", "--max-lora-rank", "16",
            "--lora-modules", *modules, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16", "--enable-prefix-caching"]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
            return response.status == 200 and bool(json.loads(response.read()).get("data"))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def running_vllm(root: Path, port: int, log_path: Path | None = None, timeout_s: float = 900.0,
                 env: dict[str, str] | None = None):
    """vLLM's OpenAI server on 127.0.0.1:`port`, ready (its /v1/models answers) inside the block; its whole
    process group is stopped after it. Yields the base URL."""
    log_path = Path(log_path or ROOT / "artifacts" / "logs" / "vllm.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    # VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache outright. Without it vLLM reserves --gpu-memory-utilization
    # (0.92) of NUMA node 0's memory and refuses to start when that much is not free (seen here: node 0 holds 8 of
    # the machine's 24 GiB, 6.2 free). 4 GiB at 8 KiB a token (bf16) is ~500K tokens: every cell's prompts fit.
    settings = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), **(env or {})}
    process = subprocess.Popen(server_command(root, port), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, cwd=ROOT, env={**os.environ, **settings})
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(port):
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {process.returncode} before it was ready; log {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM was not ready within {timeout_s:.0f} s; log {log_path}")
            time.sleep(1.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)  # its whole process group: vLLM's engine core process too
        log.close()


def main() -> None:
    root = build_peer()
    print(f"peer built in {root}: {json.loads((root / 'built.json').read_text())}")
    print("vLLM available" if vllm_available() else SKIP_MESSAGE)


if __name__ == "__main__":
    main()
