"""Native kernels of the decode step (decode.cpp): products of a few rows, RMSNorm, the FFN block, attention.

A decode step multiplies 1 to 16 rows by every weight of the model once, and is otherwise thousands of small torch
operations whose dispatch costs more than their arithmetic. MKL treats the products as GEMMs too small to tune: on
this project's 2-core EPYC its one-row product read the demo's 36 MB of weights at 11-13 GB/s, and 16 rows took
2.3x as long as one, where one core streams 27 GB/s. The kernel reads each weight once, from panels laid out in the
order it reads them, for all rows at once (the demo's products, one thread: 1 row 2.8 -> 1.4-1.9 ms, 16 rows 6.6 ->
4.2-5.1 ms), and gives a row the same bits alone or in any batch. A whole decode step over the paged pool is one
call (ced/native_decode.py); the server's step went from 9.4 to 4.2 ms a token with a call per layer's block and to
about 2 ms with the one call (benchmarks/engine_speed, interleaved). The deepseek_v41 family's step is one call of
v41.cpp's `v41_decode_step` (ced/deepseek_v41/native.py), on the same products.

The library is compiled on first use with the host's C++ compiler for the host's CPU and cached under
artifacts/native/ by a hash of the source, the flags and the CPU; `MOL2_NATIVE=0` turns it off, and without a
compiler the engine says so once and keeps torch's matmul. Only float32 models take this path; a weight whose values
are all bfloat16s (a bfloat16 checkpoint's, upcast) is packed at 2 bytes and widened exactly as it is read, so a
step of few rows, which waits on reading the weights, reads half the bytes for the same bits (`pack_weight`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("decode.cpp", "v41.cpp")]  # one library
HEADER = Path(__file__).with_name("kernels.h")
BUILD_ROOT = Path(__file__).resolve().parents[2] / "artifacts" / "native"
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-std=gnu++20", "-pthread"]
# Up to this many rows a decode step takes the kernels, above it MKL's GEMM, whose blocking wins once the product
# is compute-bound.
MAX_ROWS = 32
_c_long, _c_int, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):  # what -march=native compiles for
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    key = hashlib.sha256(b"\0".join([*(path.read_bytes() for path in [*SOURCES, HEADER]), " ".join(FLAGS).encode(),
                                     compiler.encode(), _cpu_name().encode()])).hexdigest()[:16]
    target = BUILD_ROOT / key / "libdecode.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f"{target.name}.tmp{os.getpid()}")
        subprocess.run([compiler, *FLAGS, "-o", str(scratch), *map(str, SOURCES)], check=True, capture_output=True,
                       text=True)
        os.replace(scratch, target)  # atomic: processes building at once each finish with a whole file
    return target


class LinearSpec(ctypes.Structure):
    """decode.cpp's `Linear`: a packed weight and, where the linear has LoRA slots, the slots' packed A and B."""

    _fields_ = [("panels", _ptr), ("in_features", _c_long), ("out_features", _c_long), ("a", _ptr),
                ("a_stride", _c_long), ("b", _ptr), ("b_stride", _c_long), ("rank", _c_long), ("used", _ptr),
                ("bf16", _c_long)]

    @classmethod
    def of(cls, panels: Tensor, in_features: int, out_features: int,
           lora: tuple[Tensor, Tensor, int] | None = None, used: Tensor | None = None) -> "LinearSpec":
        """The tensors must stay alive and in place while the spec is used (the modules own them). `used` (bool,
        one per slot): the slots whose adapter adapts this linear (None: all of them)."""
        a, b, rank = lora or (None, None, 0)
        return cls(panels.data_ptr(), in_features, out_features, a.data_ptr() if a is not None else None,
                   a.shape[1] if a is not None else 0, b.data_ptr() if b is not None else None,
                   b.shape[1] if b is not None else 0, rank, used.data_ptr() if used is not None else None,
                   panels.dtype == torch.bfloat16)


class DecodeRows(ctypes.Structure):
    """decode.cpp's `DecodeRows`: what every layer of one decode step over the paged pool shares."""

    _fields_ = [("B", _c_int), ("slots", _ptr), ("positions", _ptr), ("filled", _c_long),
                ("window", _c_long), ("table", _ptr), ("table_width", _c_long), ("page_entries", _c_long),
                ("n_entries", _c_long), ("block", _c_long), ("cos", _ptr), ("sin", _ptr), ("lora_slots", _ptr)]


class StepBlock(ctypes.Structure):
    """decode.cpp's `StepBlock`: one layer's attention or FFN in a decode step over the paged pool."""

    _fields_ = [("norm", _ptr), ("eps", ctypes.c_float), *((name, ctypes.POINTER(LinearSpec)) for name in "qkvo"),
                ("heads", _c_long), ("head_dim", _c_long), ("scale", ctypes.c_float), ("ring_k", _ptr),
                ("ring_v", _ptr), ("gate", ctypes.POINTER(LinearSpec)), ("index_key", ctypes.POINTER(LinearSpec)),
                ("pending", _ptr), ("own_gk", _ptr), ("own_gv", _ptr), ("own_gi", _ptr),
                ("index_query", ctypes.POINTER(LinearSpec)), ("index_weight", ctypes.POINTER(LinearSpec)),
                ("index_heads", _c_long), ("index_dim", _c_long), ("src_gk", _ptr), ("src_gv", _ptr),
                ("src_gi", _ptr), ("top_k", _c_long), ("ffn_gate", ctypes.POINTER(LinearSpec)),
                ("ffn_up", ctypes.POINTER(LinearSpec)), ("ffn_down", ctypes.POINTER(LinearSpec))]


class StepModel(ctypes.Structure):
    """decode.cpp's `StepModel`: the whole model for a decode step (its two stages' blocks and what lies around)."""

    _fields_ = [("embed", _ptr), ("hidden", _c_long), ("shared", ctypes.POINTER(StepBlock)), ("n_shared", _c_int),
                ("decoder", ctypes.POINTER(StepBlock)), ("n_decoder", _c_int), ("top_k", _c_long),
                ("stream_ring", _ptr), ("sel_idx_ring", _ptr), ("sel_valid_ring", _ptr), ("final_norm", _ptr),
                ("final_eps", ctypes.c_float), ("head", ctypes.POINTER(LinearSpec))]


MAX_STORES = 8  # v41.cpp's: the KV sources a deepseek_v41 model may have


class V41Layer(ctypes.Structure):
    """v41.cpp's `V41Layer`: one deepseek_v41 layer's weights (attention site and FFN site) as the kernel reads them."""

    _fields_ = [("attn_norm", _ptr), *((name, ctypes.POINTER(LinearSpec)) for name in ("wq_a", "wq_b", "wkv", "wo_a",
                                                                                         "wo_b")),
                ("q_norm", _ptr), ("kv_norm", _ptr), ("sink", _ptr), ("rope", _c_int), ("own_store", _c_int),
                ("read_store", _c_int), ("ratio", _c_int), ("c_wkv", ctypes.POINTER(LinearSpec)),
                ("c_wgate", ctypes.POINTER(LinearSpec)), ("c_norm", _ptr), ("i_wk", ctypes.POINTER(LinearSpec)),
                ("i_k_norm", _ptr), ("i_wq_b", ctypes.POINTER(LinearSpec)), ("i_weights", ctypes.POINTER(LinearSpec)),
                ("uses_candidates", _c_int), ("candidate_source", _c_int), ("hc_attn_fn", _ptr),
                ("hc_attn_base", _ptr), ("hc_attn_scale", _ptr), ("ffn_norm", _ptr), ("gate_w", _ptr),
                ("gate_bias", _ptr), ("experts", ctypes.POINTER(LinearSpec)), ("shared", ctypes.POINTER(LinearSpec)),
                ("hc_ffn_fn", _ptr), ("hc_ffn_base", _ptr), ("hc_ffn_scale", _ptr)]


class V41Model(ctypes.Structure):
    """v41.cpp's `V41Model`: a deepseek_v41 model's sizes and shared weights."""

    _fields_ = [*((name, _c_long) for name in ("C", "H", "D", "R", "Q", "G", "hc", "vocab", "window", "index_heads",
                                               "index_dim", "index_topk", "cand_blocks", "cand_block_size",
                                               "n_experts", "top_experts")),
                ("store_ratio", _c_long * MAX_STORES),
                *((name, _c_int) for name in ("n_layers", "decoder_start", "sinkhorn_iters", "scoring", "norm_topk")),
                *((name, ctypes.c_float) for name in ("eps", "hc_eps", "routed_scale", "swiglu_limit")),
                ("inv_freq", _ptr * 2), ("embed", _ptr), ("final_norm", _ptr), ("head", ctypes.POINTER(LinearSpec)),
                ("layers", ctypes.POINTER(V41Layer))]


class V41Rows(ctypes.Structure):
    """v41.cpp's `V41Rows`: the rows of one deepseek_v41 decode step and where their state lies."""

    _fields_ = [("B", _c_int), *((name, _ptr) for name in (
        "positions", "lora_slots", "windows", "window_n", "latents", "keys", "n_entries", "pending", "stream", "pre",
        "selection_idx", "selection_valid", "pool_idx", "pool_valid"))]


class TailMeta(ctypes.Structure):
    """v41.cpp's `TailMeta`: where a ced.deepseek_v41.state.Tail holds its positions (its own fields: the kernel
    advances it in place)."""

    _fields_ = [(name, _c_long) for name in ("buf", "start", "n", "room", "stride", "keep")]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("MOL2_NATIVE", "1") == "0":
        return None
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        log.warning("no C++ compiler on PATH: decode steps use torch's matmul (install g++ for the native kernel)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("the native decode kernel did not build, decode steps use torch's matmul: %s", detail)
        return None
    spec, rows = ctypes.POINTER(LinearSpec), ctypes.POINTER(DecodeRows)
    signatures = {
        "pack_weight": (None, [_ptr, _c_long, _c_long, _ptr]),
        "pack_weight_bf16": (None, [_ptr, _c_long, _c_long, _ptr]),
        "set_threads": (None, [_c_int]),
        "linear": (_c_int, [spec, _ptr, _c_long, _c_int, _ptr, _ptr, _c_long]),
        "rms_norm": (None, [_ptr, _c_int, _c_long, _ptr, ctypes.c_float, _ptr]),
        "argmax_rows": (None, [_ptr, _c_long, _c_long, _ptr]),
        "argmax_allowed": (_c_long, [_ptr, _ptr, _c_long]),
        "swiglu_block": (_c_int, [_ptr, _c_int, _ptr, ctypes.c_float, spec, spec, spec, _ptr, _ptr]),
        "attend_one": (None, [_ptr, _c_int, _c_long, _c_long, _ptr, _ptr, _c_long, _c_long, _c_long, _ptr,
                              _c_long, _ptr, _c_long, _ptr, _ptr, _ptr, _c_long, ctypes.c_float, _ptr]),
        "decode_step": (_c_int, [rows, ctypes.POINTER(StepModel), _ptr, _ptr]),
        "v41_decode_step": (_c_int, [ctypes.POINTER(V41Rows), ctypes.POINTER(V41Model), _ptr, _ptr]),
        "v41_step_tails": (_c_int, [_c_int, _ptr, _c_long, _c_long, _c_long, _ptr, _ptr, ctypes.POINTER(V41Model),
                                    _ptr, _ptr]),
        "v41_run": (_c_int, [ctypes.POINTER(V41Rows), ctypes.POINTER(V41Model), _ptr, _c_int, _c_int, _ptr, _ptr,
                             _c_int]),
        "v41_hc_weights": (None, [_ptr, _c_long, _c_long, _c_long, _ptr, _ptr, _ptr, _c_int, ctypes.c_float,
                                  ctypes.c_float, _ptr, _ptr, _ptr]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_LIB: ctypes.CDLL | None | bool = False  # False: not loaded yet


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are turned off or cannot be built."""
    global _LIB
    if _LIB is False:
        _LIB = _load()
    return _LIB


def available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and library() is not None


def pack(weight_t: Tensor) -> Tensor:
    """A weight as (in, out), into the kernel's panels: a flat float32 tensor of in * out."""
    weight_t = weight_t.detach().to(torch.float32).contiguous()
    packed = torch.empty(weight_t.numel(), dtype=torch.float32)
    library().pack_weight(weight_t.data_ptr(), weight_t.shape[0], weight_t.shape[1], packed.data_ptr())
    return packed


def bf16_exact(weight: Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 (as a bfloat16 checkpoint's weights are after the float32
    upcast, or FP8 / FP4 ones times a power-of-two scale): then half the bytes hold it exactly."""
    weight = weight.detach()
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))


def pack_weight(weight_t: Tensor) -> Tensor:
    """A model's weight (in, out) into the kernel's panels, at half the bytes where its values are bfloat16s (a
    decode step of few rows waits on reading its weights; the products widen them exactly, so their bits do not
    change): a flat bfloat16 or float32 tensor of in * out. LoRA slots, written in place as adapters change,
    keep `pack`'s float32."""
    if not bf16_exact(weight_t):
        return pack(weight_t)
    weight_t = weight_t.detach().to(torch.float32).contiguous()
    packed = torch.empty(weight_t.numel(), dtype=torch.bfloat16)
    library().pack_weight_bf16(weight_t.data_ptr(), weight_t.shape[0], weight_t.shape[1], packed.data_ptr())
    return packed


_turned_off = 0  # turned_off() depth


@contextlib.contextmanager
def turned_off():
    """Torch's arithmetic for every call inside (a benchmark's baseline, interleaved with the kernels' rows)."""
    global _turned_off
    _turned_off += 1
    try:
        yield
    finally:
        _turned_off -= 1


def usable() -> bool:
    """Whether the kernels are built and not turned off: all a caller that is never differentiated nor traced (an
    engine's call on a conversation's buffers in place) needs to know."""
    return not _turned_off and library() is not None


def enabled() -> bool:
    """Whether the kernels may run now inside a model's forward: usable, and neither gradients (the kernels have no
    backward) nor a tracer or compiler watching (they see torch operations only)."""
    return (usable() and not torch.is_grad_enabled() and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling() and not torch.onnx.is_in_onnx_export())


def takes(x: Tensor) -> bool:
    """Whether work on x (B, C) or (B, 1, C) goes to the kernels: one position per row (a decode step; a chunk of
    a prefill or replay keeps MKL's arithmetic, so a replayed window has the bits of the one-pass oracle), few
    rows, float32 on the CPU, while `enabled()`."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and (x.dim() == 2 or x.shape[-2] == 1)
            and x.numel() <= MAX_ROWS * x.shape[-1] and enabled())


def set_threads(n: int) -> None:
    """Threads of the larger products from now on: 2 where two CPUs are free, else 1 (`step_threads` asks)."""
    if library() is not None:
        _LIB.set_threads(n)


# The kernels' second thread runs on a CPU that others use for up to half its time: its parts are claimed as it
# comes free, so a slice it loses costs little (measured, 16 rows beside a process busy 35 % / 60 % of one CPU: a step
# 11 % / 19 % faster on two threads than on one; beside one busy 100 %: no faster, with a longer tail). Torch's
# chunk threads split their work in fixed parts, so they keep FreeCpus's stricter default.
KERNEL_SHARED_OK = 0.5


@contextlib.contextmanager
def step_threads(free_cpus, most: int):
    """A decode step's larger products on a second thread where a CPU is mostly free (`free_cpus`, a
    ced.cpu_share.FreeCpus; up to `most`), then back to one: only while torch itself runs on one thread, whose pool
    would otherwise spin against the kernels' worker (measured: a step 4x slower)."""
    set_threads(1 if torch.get_num_threads() > 1 else free_cpus.threads(most, KERNEL_SHARED_OK))
    try:
        yield
    finally:
        set_threads(1)


def check(code: int) -> None:
    """A kernel's return code: -1 where a LoRA rank is above the kernel's limit, -2 where `v41_run` was asked to
    start at a site whose inputs it does not read (a caller's bug)."""
    if code == -2:
        raise RuntimeError("v41_run starts at the embedding (site 0) or after layer E's attention (site 2E + 1) only")
    if code:
        raise ValueError("a LoRA rank above the native kernel's limit (1024)")


def matmul(x: Tensor, spec: LinearSpec, slots: Tensor | None = None) -> Tensor:
    """x (..., in) @ W, plus each row's own LoRA where `slots` (one per row of x, long, -1: none) is given."""
    x = x.contiguous()
    rows = x.numel() // spec.in_features
    y = x.new_empty(*x.shape[:-1], spec.out_features)
    check(_LIB.linear(spec, x.data_ptr(), spec.in_features, rows, None if slots is None else slots.data_ptr(),
                      y.data_ptr(), spec.out_features))
    return y


def argmax_rows(logits: Tensor) -> list[int]:
    """Each row's argmax of logits (B, V) (or of one row (V,)), as torch.argmax picks it (the first of equals; a
    NaN wins): one pass 16 lanes at a time where the kernels are usable (torch's argmax over the demo's 8,192
    logits costs a decode step ~20 us, ~25 on the caches a step leaves; a 16-row step ~120 us), torch's otherwise."""
    if not (logits.is_contiguous() and logits.dtype is torch.float32 and logits.is_cpu and logits.dim() in (1, 2)
            and usable()):  # the cheapest checks first: a greedy step runs this on the caches a step leaves
        return logits.argmax(dim=-1).reshape(-1).tolist()
    B = logits.shape[0] if logits.dim() == 2 else 1
    if B == 1:  # a lone row's pick in a scalar: an array type per call costs it ~5 us on those caches
        pick = ctypes.c_long()
        _LIB.argmax_rows(logits.data_ptr(), 1, logits.shape[-1], ctypes.byref(pick))
        return [pick.value]
    rows = (ctypes.c_long * B)()
    _LIB.argmax_rows(logits.data_ptr(), B, logits.shape[-1], rows)
    return rows[:]


def argmax_allowed(logits: Tensor, allowed: Tensor) -> int | None:
    """The argmax of logits (V,) over the tokens `allowed` (an int32 token bitmask, xgrammar's layout) lets through,
    as torch.argmax picks it from a copy with the others at -inf; None where the kernels are not usable."""
    if not (logits.is_contiguous() and logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 1
            and allowed.is_contiguous() and allowed.dtype is torch.int32 and allowed.numel() * 32 >= logits.numel()
            and usable()):
        return None
    return _LIB.argmax_allowed(logits.data_ptr(), allowed.data_ptr(), logits.numel())


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    _LIB.rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, y.data_ptr())
    return y


def swiglu_block(x: Tensor, norm_weight: Tensor, eps: float, gate: LinearSpec, up: LinearSpec, down: LinearSpec,
                 slots: Tensor | None) -> Tensor:
    """x + down(silu(gate(n)) * up(n)) with n the RMSNorm of x, in one call."""
    x = x.contiguous()
    y = torch.empty_like(x)
    check(_LIB.swiglu_block(x.data_ptr(), x.numel() // x.shape[-1], norm_weight.data_ptr(), eps, gate, up, down,
                            None if slots is None else slots.data_ptr(), y.data_ptr()))
    return y


def attend_one(q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, positions: Tensor, window: int,
               scale: float, selected: tuple[Tensor, Tensor, Tensor] | None) -> Tensor:
    """One query per row: q (B, H, 1, D) over window keys / values (B, H, S, D) (rows and heads at any stride)
    at key_pos (B or 1, S), masked outside [0, window) of positions (B or 1, 1), and the selected global entries
    (k_sel, v_sel (B, H, 1, K, D), valid (B, 1, K)); out (B, 1, H * D)."""
    B, H, _, D = q.shape
    q, key_pos = q.contiguous(), key_pos.contiguous()
    positions = positions.expand(B, 1).contiguous()  # rows that share their positions (1, 1): one each
    if keys.stride(3) != 1 or keys.stride(2) != D or keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    k_sel, v_sel, valid = ((t.contiguous() for t in selected) if selected is not None else (q, q, q))
    K = k_sel.shape[-2] if selected is not None else 0
    out = q.new_empty(B, 1, H * D)
    _LIB.attend_one(q.data_ptr(), B, H, D, keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
                    keys.shape[2], key_pos.data_ptr(), key_pos.stride(0) if key_pos.shape[0] > 1 else 0,
                    positions.data_ptr(), window, k_sel.data_ptr(), v_sel.data_ptr(), valid.data_ptr(), K, scale,
                    out.data_ptr())
    return out


def v41_hc_weights(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float,
                   hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The deepseek_v41 mHC weights (ced/deepseek_v41/model.py hc_weights) of streams x (..., n, C): pre and post
    (..., n), comb (..., n, n), each position as a decode step computes it."""
    n, C = x.shape[-2:]
    x = x.contiguous()
    rows = x.numel() // (n * C)
    pre, post, comb = x.new_empty(*x.shape[:-1]), x.new_empty(*x.shape[:-1]), x.new_empty(*x.shape[:-1], n)
    _LIB.v41_hc_weights(x.data_ptr(), rows, n, C, fn.data_ptr(), base.data_ptr(), scale.data_ptr(), iters, eps,
                        hc_eps, pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    return pre, post, comb
