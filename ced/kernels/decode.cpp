// The decode step's native kernels (ced/kernels/__init__.py loads them; ced/native_decode.py calls decode_step).
//
// Products y = x @ W for a few rows of x (a decode step's batch): each weight is read once, from panels that lie in
// memory in the order the loop reads them, for every row of the call at once. A weight W (in, out) is packed as
// column panels: 64 columns wide while 64 remain, then 16 wide, then one panel of what is left; each panel's `in`
// rows of its width contiguous. Row m of y is accumulated over i = 0 .. in-1 in that order with one fused
// multiply-add per term, whatever the number of rows in the call and whichever panel holds the column: a row's
// result is the same bits alone or in any batch. On them: each row's LoRA, RMSNorm, the SwiGLU FFN block, and a
// layer's attention over the paged pool for one token per row (the ring write, the compressor, the indexer's
// top-k, the window and the selected global entries), with a second thread for the larger work; and decode_step,
// the whole model for one token per row in one call.
//
// Built by ced/kernels/__init__.py with the host's compiler for the host's CPU (-O3 -march=native).
#include <unistd.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

namespace {

using kernels::dot;
using kernels::load;
using kernels::store;
using kernels::v16;

// A panel's weights at input i: 16 * NV columns as NV vectors. From float32 as they lie; from bfloat16 (a
// checkpoint's bfloat16 weights, packed at half the bytes: a decode step of few rows waits on reading them) widened
// exactly, so the products' bits are the same. A 64-wide panel's bfloat16s lie in pairs (pack_weight_bf16): each
// 32-bit word holds column c in its low half and column c + 16 in its high half, so one load gives two vectors, by
// a shift and a mask (one instruction each per 16 weights, where widening 16 bfloat16s takes two).
typedef unsigned u32x16 __attribute__((vector_size(64), aligned(2)));

template <int NV>
inline void load_weights(const float* w, v16* wv) {
  for (int v = 0; v < NV; ++v) wv[v] = load(w + 16 * v);
}

template <int NV>
inline void load_weights(const kernels::bf16* w, v16* wv) {
  if constexpr (NV % 2 == 0) {
    for (int v = 0; v < NV; v += 2) {
      const u32x16 pair = *(const u32x16*)(w + 16 * v);
      wv[v] = (v16)(pair << 16);
      wv[v + 1] = (v16)(pair & 0xffff0000u);
    }
  } else {
    typedef kernels::bf16 u16x16 __attribute__((vector_size(32), aligned(2)));
    for (int v = 0; v < NV; ++v) wv[v] = (v16)(__builtin_convertvector(*(const u16x16*)(w + 16 * v), u32x16) << 16);
  }
}

inline float weight(float w) { return w; }
inline float weight(kernels::bf16 w) {
  const unsigned bits = static_cast<unsigned>(w) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// A panel's weights are fetched this many inputs ahead of their multiplies (1-2 KB): the hardware's prefetcher starts
// again at each 4 KB page and after each short product. One row of the V4.1 demo at 2,048 tokens: ~4 % faster a step
// (8 or 32 inputs: ~3 %); 16 rows of the ced demo 4 % (this machine, in-process A/B; same bits).
constexpr long PREFETCH_INPUTS = 16;

// Rows [0, MR) of x against one panel of 16*NV columns starting at column o0.
template <int MR, int NV, class W>
void tile(const float* x, long ldx, const W* panel, long in, long o0, float* y, long ldy, bool accumulate) {
  v16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = accumulate ? load(y + m * ldy + o0 + 16 * v) : (v16){};
  const W* w = panel;
  for (long i = 0; i < in; ++i, w += 16 * NV) {
    __builtin_prefetch(w + 16 * NV * PREFETCH_INPUTS);
    v16 wv[NV];
    load_weights<NV>(w, wv);
    for (int m = 0; m < MR; ++m) {
      v16 xm = (v16){} + x[m * ldx + i];
      for (int v = 0; v < NV; ++v) acc[m][v] += xm * wv[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) store(y + m * ldy + o0 + 16 * v, acc[m][v]);
}

// Every row against one panel, four rows at a time (16 accumulators of the 32 vector registers).
template <int NV, class W>
void panel_rows(const float* x, long ldx, int M, const W* panel, long in, long o0, float* y, long ldy,
                bool accumulate) {
  int m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NV>(x + m * ldx, ldx, panel, in, o0, y + m * ldy, ldy, accumulate);
  switch (M - m) {
    case 3: tile<3, NV>(x + m * ldx, ldx, panel, in, o0, y + m * ldy, ldy, accumulate); break;
    case 2: tile<2, NV>(x + m * ldx, ldx, panel, in, o0, y + m * ldy, ldy, accumulate); break;
    case 1: tile<1, NV>(x + m * ldx, ldx, panel, in, o0, y + m * ldy, ldy, accumulate); break;
  }
}

long panel_width(long left) { return left >= 64 ? 64 : left >= 16 ? 16 : left; }

// Columns [o_begin, o_end) of y (+)= x @ W, o_begin a multiple of 64 (the 64-wide panels come first).
template <class W>
void gemm_columns(const float* x, long ldx, int M, const W* packed, long in, long out, float* y, long ldy,
                  bool accumulate, long o_begin, long o_end) {
  long o = o_begin;
  const W* panel = packed + o_begin * in;
  for (; o + 64 <= o_end; o += 64, panel += 64 * in) panel_rows<4>(x, ldx, M, panel, in, o, y, ldy, accumulate);
  for (; o + 16 <= o_end; o += 16, panel += 16 * in) panel_rows<1>(x, ldx, M, panel, in, o, y, ldy, accumulate);
  const long width = o_end - o;
  for (int m = 0; m < M; ++m)
    for (long j = 0; j < width; ++j) {
      float sum = accumulate ? y[m * ldy + o + j] : 0.0f;
      for (long i = 0; i < in; ++i) sum = std::fma(x[m * ldx + i], weight(panel[i * width + j]), sum);
      y[m * ldy + o + j] = sum;
    }
}

// A second thread for the larger work of a step: one step reads every weight once, and one core's reads alone do
// not reach the memory's bandwidth. `parallel(n, f)` runs f(i) for i in [0, n) (a product's column panels, a
// batch's rows), each i on whichever thread claims it first: this one and the worker. What f(i) computes does not
// depend on the thread, so the bits do not. A thread that another process keeps off its CPU only holds up the part
// it has claimed: the other claims the rest (a fixed split would wait for the whole of its half). Between jobs the
// worker spins for SPIN_NS, then sleeps on a futex (std::atomic::wait): a step's Python between its products does
// not cost a wake-up each time, and an idle engine holds no CPU.
constexpr long SPIN_NS = 50000;
constexpr long PARALLEL_FLOATS = 1 << 16;  // products of at least this many weights (256 KB) are shared
constexpr long CHUNK_FLOATS = 1 << 14;     // a product's columns are claimed in parts of about this many weights
std::atomic<unsigned> posted{0};           // the last job's ticket: what wakes the worker
// The job's claims: ticket (24 bits) | parts (20) | next unclaimed part (20). A claim is a compare-and-swap of the
// whole word, so a claim on a job that has ended (its ticket gone) fails instead of running a part of the next.
std::atomic<unsigned long> claims{0};
std::atomic<long> parts_done{0};
std::atomic<int> threads{1};
std::atomic_flag busy = ATOMIC_FLAG_INIT;  // the worker serves one caller at a time; another runs alone
pid_t worker_pid = 0;  // the process that started the worker (a forked child has none and starts its own)
struct Job {
  void (*run)(void*, long);
  void* f;
} job;

// Claims and runs the parts of job `ticket` until none is left; returns how many it ran.
long run_parts(unsigned long ticket) {
  long ran = 0;
  unsigned long word = claims.load(std::memory_order_acquire);
  for (;;) {
    const unsigned long parts = (word >> 20) & 0xfffff, next = word & 0xfffff;
    if (word >> 40 != ticket || next >= parts) return ran;
    if (claims.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) {
      job.run(job.f, next);
      parts_done.fetch_add(1, std::memory_order_release);
      ++ran;
      word = claims.load(std::memory_order_acquire);
    }
  }
}

void worker_loop(unsigned seen) {  // `seen`: the last ticket before the worker started
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    unsigned now;
    while ((now = posted.load(std::memory_order_acquire)) == seen) {
      if (std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(SPIN_NS)) {
        posted.wait(seen, std::memory_order_acquire);
      }
    }
    seen = now;
    run_parts(now & 0xffffff);
  }
}

template <class F>
void parallel(long n, bool worth_it, F&& f) {
  if (!worth_it || n < 2 || n > 0xfffff || threads.load() < 2 || busy.test_and_set()) {
    for (long i = 0; i < n; ++i) f(i);
    return;
  }
  if (worker_pid != getpid()) {
    worker_pid = getpid();
    std::thread(worker_loop, posted.load()).detach();
  }
  job = Job{[](void* g, long i) { (*static_cast<F*>(g))(i); }, &f};
  parts_done.store(0, std::memory_order_relaxed);
  const unsigned ticket = posted.load() + 1;
  claims.store((static_cast<unsigned long>(ticket & 0xffffff) << 40) | (static_cast<unsigned long>(n) << 20),
               std::memory_order_release);
  posted.store(ticket, std::memory_order_release);
  posted.notify_one();
  run_parts(ticket & 0xffffff);
  while (parts_done.load(std::memory_order_acquire) != n) {  // a part the worker claimed and still runs
  }
  busy.clear();
}

// A product's columns in parts of whole 64-wide panels, about CHUNK_FLOATS weights each (the last part also takes
// the narrower panels at the end).
template <class W>
void gemm_split(const float* x, long ldx, int M, const W* packed, long in, long out, float* y, long ldy,
                bool accumulate) {
  const long width = std::max(64L, (CHUNK_FLOATS / std::max(in, 1L) + 63) / 64 * 64);
  const long parts = std::max(1L, out / width);
  parallel(parts, in * out >= PARALLEL_FLOATS, [&](long part) {
    gemm_columns(x, ldx, M, packed, in, out, y, ldy, accumulate, part * width,
                 part == parts - 1 ? out : (part + 1) * width);
  });
}

}  // namespace

void kernels::parallel_parts(long n, bool worth_it, void (*run)(void*, long), void* f) {
  parallel(n, worth_it, [&](long i) { run(f, i); });
}

namespace {

// Each thread's arena for kernels::scratch (kernels.h): 4 MB, taken when the thread first needs it.
struct Arena {
  static constexpr std::size_t SIZE = std::size_t(4) << 20, ALIGN = 64;
  char* base = nullptr;
  std::size_t top = 0;  // bytes in use from base (blocks freed below the top wait until nothing lives)
  long live = 0;        // blocks handed out and not yet freed
  ~Arena() { std::free(base); }
};
thread_local Arena arena;

}  // namespace

void* kernels::scratch_alloc(std::size_t bytes) {
  const std::size_t size = (bytes + Arena::ALIGN - 1) / Arena::ALIGN * Arena::ALIGN;
  if (!arena.base) arena.base = static_cast<char*>(std::aligned_alloc(Arena::ALIGN, Arena::SIZE));
  if (!arena.base || size > Arena::SIZE - arena.top) {
    void* block = std::malloc(bytes ? bytes : 1);
    if (!block) throw std::bad_alloc();
    return block;
  }
  char* block = arena.base + arena.top;
  arena.top += size;
  ++arena.live;
  return block;
}

void kernels::scratch_free(void* p, std::size_t bytes) {
  char* block = static_cast<char*>(p);
  if (!arena.base || block < arena.base || block >= arena.base + Arena::SIZE) {
    std::free(p);
    return;
  }
  const std::size_t size = (bytes + Arena::ALIGN - 1) / Arena::ALIGN * Arena::ALIGN;
  if (--arena.live == 0)
    arena.top = 0;
  else if (block + size == arena.base + arena.top)
    arena.top -= size;
}

extern "C" {

// W (in, out), row-major, into `packed` (in * out floats).
void pack_weight(const float* w, long in, long out, float* packed) {
  for (long o = 0, width; o < out; o += width) {
    width = panel_width(out - o);
    for (long i = 0; i < in; ++i, packed += width) std::memcpy(packed, w + i * out + o, width * sizeof(float));
  }
}

// The same panels in bfloat16: each weight's upper 16 bits (the caller checked that the lower ones are zero); in a
// 64-wide panel, columns c and c + 16 of each 32 side by side (load_weights reads them so).
void pack_weight_bf16(const float* w, long in, long out, kernels::bf16* packed) {
  for (long o = 0, width; o < out; o += width) {
    width = panel_width(out - o);
    for (long i = 0; i < in; ++i, packed += width)
      for (long j = 0; j < width; ++j) {
        const long column = width == 64 ? (j & ~31L) + (j & 1) * 16 + (j & 31) / 2 : j;
        unsigned bits;
        std::memcpy(&bits, w + i * out + o + column, sizeof bits);
        packed[j] = static_cast<kernels::bf16>(bits >> 16);
      }
  }
}

// How many threads the larger products use: 1 or 2 (the engine asks for what other processes leave free).
void set_threads(int n) { threads.store(n < 2 ? 1 : 2); }

// y[m, :] (+)= x[m, :] @ W for m < M; x rows ldx apart, y rows ldy apart; W packed by pack_weight.
void gemm_rows(const float* x, long ldx, int M, const float* packed, long in, long out, float* y, long ldy,
               int accumulate) {
  gemm_split(x, ldx, M, packed, in, out, y, ldy, accumulate);
}

enum { MAX_RANK = 1024 };

// y[m] = x[m] @ W, plus each row's own LoRA where `slots` is given: (x[m] @ A[s]) @ B[s], s = slots[m] (a row of
// slot -1, or of a slot whose adapter leaves this linear alone, keeps the base's bits). The rows of one slot go
// together, so each slot's A and B are read once; a row's bits are those it has alone.
int linear(const Linear* L, const float* x, long ldx, int M, const long* slots, float* y, long ldy) {
  if (L->rank > MAX_RANK) return -1;
  if (L->bf16)
    gemm_split(x, ldx, M, static_cast<const kernels::bf16*>(L->panels), L->in, L->out, y, ldy, false);
  else
    gemm_split(x, ldx, M, static_cast<const float*>(L->panels), L->in, L->out, y, ldy, false);
  if (!slots || !L->a) return 0;
  const long in = L->in, out = L->out, rank = L->rank;
  std::vector<char> done(M, 0);
  std::vector<int> rows;
  std::vector<float> xs, ys, down;
  for (int m = 0; m < M; ++m) {
    const long slot = slots[m];
    if (done[m] || slot < 0 || (L->used && !L->used[slot])) continue;
    rows.clear();
    for (int j = m; j < M; ++j)
      if (!done[j] && slots[j] == slot) rows.push_back(j), done[j] = 1;
    const int n = rows.size();
    xs.resize(n * in), ys.resize(n * out), down.resize(n * rank);
    for (int i = 0; i < n; ++i) {
      std::memcpy(xs.data() + i * in, x + rows[i] * ldx, in * sizeof(float));
      std::memcpy(ys.data() + i * out, y + rows[i] * ldy, out * sizeof(float));
    }
    gemm_rows(xs.data(), in, n, L->a + slot * L->a_stride, in, rank, down.data(), rank, 0);
    gemm_rows(down.data(), rank, n, L->b + slot * L->b_stride, rank, out, ys.data(), out, 1);
    for (int i = 0; i < n; ++i) std::memcpy(y + rows[i] * ldy, ys.data() + i * out, out * sizeof(float));
  }
  return 0;
}

// Each row's argmax: out[r] = the first index of the largest of x[r, :n], or of the first NaN where the row has
// one (torch.argmax's answer); a greedy turn's next token. One pass 16 lanes at a time: each lane keeps its largest
// and the run it first lay in (a later equal one does not replace it; offsets as int: rows under 2^31), then the
// lanes' largest, and of the lanes that hold it the first index (8,192 logits: 0.7 us, where a lane-by-lane search
// for the largest's first place took 6).
void argmax_rows(const float* x, long rows, long n, long* out) {
  typedef int i16 __attribute__((vector_size(64)));
  for (long r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    float top = -INFINITY;
    long found = 0, i = 0;
    bool nan = false;
    if (n >= 16) {
      v16 best = load(row);
      i16 at = {}, nans = best != best;  // at: the offset of the run each lane's largest lay in
      for (i = 16; i + 16 <= n; i += 16) {
        const v16 v = load(row + i);
        const i16 larger = v > best;
        best = larger ? v : best;
        at = larger ? (i16){} + static_cast<int>(i) : at;
        nans |= v != v;
      }
      for (int lane = 0; lane < 16; ++lane) {
        nan |= nans[lane] != 0;
        const long index = static_cast<long>(at[lane]) + lane;
        if (lane == 0 || best[lane] > top || (best[lane] == top && index < found)) top = best[lane], found = index;
      }
    } else if (n > 0) {
      top = row[0], i = 1;
      nan = row[0] != row[0];
    }
    for (; i < n; ++i) {  // the last n % 16 (or all of a short row), after every earlier index
      nan |= row[i] != row[i];
      if (row[i] > top) top = row[i], found = i;
    }
    if (nan)  // the first NaN wins, as torch.argmax has it
      for (found = 0; row[found] == row[found]; ++found) {
      }
    out[r] = n > 0 ? found : 0;
  }
}

// argmax_rows of one row of n over the tokens `allowed` lets through, the others counted as -inf: bit j of word w is
// token 32 w + j (xgrammar's bitmask). A grammar row's greedy token, where a masked copy of its logits and its
// argmax cost ~45 us a row a step. Runs of 16 go as in argmax_rows, a run's forbidden lanes at -inf (a run none of
// whose tokens is allowed is skipped). All -inf gives 0, as torch.argmax of the masked copy does.
long argmax_allowed(const float* x, const int* allowed, long n) {
  typedef int i16 __attribute__((vector_size(64)));
  const i16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 none = {};
  none -= INFINITY;
  v16 best = none;
  i16 at = {}, nans = {};
  long i = 0;
  for (; i + 16 <= n; i += 16) {
    const unsigned bits = (static_cast<unsigned>(allowed[i >> 5]) >> (i & 16)) & 0xFFFFu;
    if (!bits) continue;
    const i16 open = ((i16){} + static_cast<int>(bits)) >> lanes & 1;
    v16 v = load(x + i);
    v = open != 0 ? v : none;
    const i16 larger = v > best;
    best = larger ? v : best;
    at = larger ? (i16){} + static_cast<int>(i) : at;
    nans |= v != v;
  }
  float top = -INFINITY;
  long found = 0;
  bool nan = false;
  for (int lane = 0; lane < 16; ++lane) {
    nan |= nans[lane] != 0;
    const long index = static_cast<long>(at[lane]) + lane;
    if (best[lane] > top || (best[lane] == top && index < found)) top = best[lane], found = index;
  }
  if (top == -INFINITY) found = 0;
  for (; i < n; ++i) {  // the last n % 16, after every earlier index
    if (!(allowed[i >> 5] >> (i & 31) & 1)) continue;
    nan |= x[i] != x[i];
    if (x[i] > top) top = x[i], found = i;
  }
  if (nan)  // the first allowed NaN wins, as torch.argmax of the masked copy has it
    for (found = 0; !(allowed[found >> 5] >> (found & 31) & 1) || x[found] == x[found]; ++found) {
    }
  return n > 0 ? found : 0;
}

// RMSNorm of M rows of C: y = (x / sqrt(mean(x^2) + eps)) * w.
void rms_norm(const float* x, int M, long C, const float* w, float eps, float* y) {
  for (int m = 0; m < M; ++m, x += C, y += C) {
    const float sum = dot(x, x, C);
    const float r = 1.0f / std::sqrt(sum / C + eps);
    for (long c = 0; c < C; ++c) y[c] = (x[c] * r) * w[c];
  }
}

// A layer's FFN block on M rows: y = x + down(silu(gate(n)) * up(n)), n = rms_norm(x), each linear with the rows'
// LoRA where `slots` is given.
int swiglu_block(const float* x, int M, const float* norm_w, float eps, const Linear* gate, const Linear* up,
                 const Linear* down, const long* slots, float* y) {
  const long C = gate->in, F = gate->out;
  std::vector<float> n(M * C), g(M * F), u(M * F);
  rms_norm(x, M, C, norm_w, eps, n.data());
  if (linear(gate, n.data(), C, M, slots, g.data(), F) || linear(up, n.data(), C, M, slots, u.data(), F)) return -1;
  kernels::swiglu(g.data(), u.data(), M * F, 0.0f);
  if (linear(down, g.data(), F, M, slots, y, C)) return -1;
  for (long i = 0; i < M * C; ++i) y[i] = x[i] + y[i];
  return 0;
}

// Attention of one query per row (a decode step) over its local window and its selected global entries:
// out[b] (H * D) = softmax([q.k_s * scale, q.g_j * scale]) @ [v_s; w_j] per head, window keys s whose distance
// pos[b] - key_pos[b, s] is outside [0, window) and global entries j not valid[b, j] masked out.
// q: (B, H, D); keys / values: row b, head h, key s at b * kb + h * kh + s * D; key_pos: row b at b * kpos_b;
// k_sel / v_sel: (B, H, K, D) and valid (B, K), or K = 0.
void attend_one(const float* q, int B, long H, long D, const float* keys, const float* values, long kb, long kh,
                long S, const long* key_pos, long kpos_b, const long* pos, long window, const float* k_sel,
                const float* v_sel, const bool* valid, long K, float scale, float* out) {
  std::vector<float> p(S + K);
  for (int b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h) {
      const float* qh = q + (b * H + h) * D;
      const float* kh_ = keys + b * kb + h * kh;
      const float* vh = values + b * kb + h * kh;
      const float* gk = k_sel + (b * H + h) * K * D;
      const float* gv = v_sel + (b * H + h) * K * D;
      float top = -INFINITY;
      for (long s = 0; s < S; ++s) {
        const long distance = pos[b] - key_pos[b * kpos_b + s];
        float score = -INFINITY;
        if (distance >= 0 && distance < window) score = dot(qh, kh_ + s * D, D) * scale;
        p[s] = score;
        top = std::max(top, score);
      }
      for (long j = 0; j < K; ++j) {
        float score = -INFINITY;
        if (valid[b * K + j]) score = dot(qh, gk + j * D, D) * scale;
        p[S + j] = score;
        top = std::max(top, score);
      }
      float total = 0.0f;
      kernels::exp_shifted(p.data(), S + K, top);
      for (long i = 0; i < S + K; ++i) total += p[i];
      float* o = out + (b * H + h) * D;
      for (long d = 0; d < D; ++d) o[d] = 0.0f;
      for (long s = 0; s < S; ++s) {
        const float w = p[s] / total;
        for (long d = 0; d < D; ++d) o[d] += w * vh[s * D + d];
      }
      for (long j = 0; j < K; ++j) {
        const float w = p[S + j] / total;
        for (long d = 0; d < D; ++d) o[d] += w * gv[j * D + d];
      }
    }
}


// -- a decode step's attention over the paged pool (ced/paged.py), in place -----------------------------------

// What every layer of one decode step shares: its rows, their positions, rings and pages. Mirrored by
// ced/kernels DecodeRows.
struct DecodeRows {
  int B;
  const long* slots;       // (B) each row's ring slot
  const long* positions;   // (B) the position of this step's token
  long filled;             // ring places to read (place s holds the latest position p - ((p - s) mod W) <= p)
  long window;             // W: the ring's length and the attention window
  const long* table;       // (B, table_width) page table
  long table_width;
  long page_entries;
  long n_entries;          // global entries the step may read (the longest row's completed blocks)
  long block;              // block size of the global entries
  const float* cos;        // (B, D/2) RoPE at each row's position
  const float* sin;
  const long* lora_slots;  // (B) each row's LoRA slot, or null
};

namespace {

// Llama's rotation of pairs (i, i + D/2) of each of H heads of x (H * D), in place.
void rope(float* x, long H, long D, const float* cos, const float* sin) {
  const long half = D / 2;
  for (long h = 0; h < H; ++h, x += D)
    for (long i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = a * sin[i] + b * cos[i];
    }
}

// The global entry `entry` of row b: its (H, ...) block in a buffer of pages of `page_entries` entries of `width`.
inline long entry_offset(const DecodeRows* r, int b, long entry, long width) {
  const long page = r->table[b * r->table_width + entry / r->page_entries];
  return (page * r->page_entries + entry % r->page_entries) * width;
}

}  // namespace

// The first half of a layer's attention for one token per row: xn = rms_norm(x); q, k, v with the rows' LoRA;
// RoPE on q and k; k and v written into the rings at each row's position. xn (B, C) and q (B, H * D) out.
int attention_pre(const DecodeRows* r, const float* x, const float* norm_w, float eps, const Linear* q_lin,
                  const Linear* k_lin, const Linear* v_lin, long H, long D, float* ring_k, float* ring_v,
                  float* xn, float* q) {
  const int B = r->B;
  const long C = q_lin->in, HD = H * D, half = D / 2;
  std::vector<float> k(B * HD), v(B * HD);
  rms_norm(x, B, C, norm_w, eps, xn);
  if (linear(q_lin, xn, C, B, r->lora_slots, q, HD) || linear(k_lin, xn, C, B, r->lora_slots, k.data(), HD) ||
      linear(v_lin, xn, C, B, r->lora_slots, v.data(), HD))
    return -1;
  for (int b = 0; b < B; ++b) {
    rope(q + b * HD, H, D, r->cos + b * half, r->sin + b * half);
    rope(k.data() + b * HD, H, D, r->cos + b * half, r->sin + b * half);
    const long place = r->positions[b] % r->window;
    for (long h = 0; h < H; ++h) {
      const long at = ((r->slots[b] * H + h) * r->window + place) * D;
      std::memcpy(ring_k + at, k.data() + b * HD + h * D, D * sizeof(float));
      std::memcpy(ring_v + at, v.data() + b * HD + h * D, D * sizeof(float));
    }
  }
  return 0;
}

// A source layer's compressor for one token per row: xn joins the row's pending block (pending: slots of (block,
// C)); a row whose token completes its block pools it into one global entry, as CEDAttention.pool_blocks does:
// K and V the per-head softmax(gate)-weighted sums of the block's k and v (K then RoPE'd at the block's last
// position, this token's: the step's tables), the indexer key index_key(mean of the block's inputs), written at
// entry position // block of the row's pages (gk / gv: (H, D) entries, gi: index_dim).
int compress_rows(const DecodeRows* r, const float* xn, float* pending, const Linear* k_lin, const Linear* v_lin,
                  const Linear* gate, const Linear* index_key, long H, long D, float* gk, float* gv, float* gi) {
  const long C = k_lin->in, m = r->block, HD = H * D, I = index_key->out;
  std::vector<float> k(m * HD), v(m * HD), logits(m * H), mean(C), entry_k(HD), entry_v(HD);
  std::vector<long> block_slots(m);  // the row's LoRA slot for each input of its block (where a placement allows one)
  for (int b = 0; b < r->B; ++b) {
    const long position = r->positions[b];
    float* block = pending + r->slots[b] * m * C;
    std::memcpy(block + (position % m) * C, xn + b * C, C * sizeof(float));
    if (position % m != m - 1) continue;
    const long* slots = r->lora_slots ? (std::fill(block_slots.begin(), block_slots.end(), r->lora_slots[b]),
                                         block_slots.data()) : nullptr;
    if (linear(k_lin, block, C, m, slots, k.data(), HD) || linear(v_lin, block, C, m, slots, v.data(), HD) ||
        linear(gate, block, C, m, slots, logits.data(), H))
      return -1;
    std::fill(entry_k.begin(), entry_k.end(), 0.0f);
    std::fill(entry_v.begin(), entry_v.end(), 0.0f);
    for (long h = 0; h < H; ++h) {  // softmax over the block's positions, per head
      float top = -INFINITY, total = 0.0f;
      for (long j = 0; j < m; ++j) top = std::max(top, logits[j * H + h]);
      for (long j = 0; j < m; ++j) total += (logits[j * H + h] = std::exp(logits[j * H + h] - top));
      for (long j = 0; j < m; ++j) {
        const float weight = logits[j * H + h] / total;
        for (long d = 0; d < D; ++d) {
          entry_k[h * D + d] += weight * k[j * HD + h * D + d];
          entry_v[h * D + d] += weight * v[j * HD + h * D + d];
        }
      }
    }
    rope(entry_k.data(), H, D, r->cos + b * (D / 2), r->sin + b * (D / 2));
    std::fill(mean.begin(), mean.end(), 0.0f);
    for (long j = 0; j < m; ++j)
      for (long c = 0; c < C; ++c) mean[c] += block[j * C + c];
    for (long c = 0; c < C; ++c) mean[c] /= m;
    const long entry = position / m;
    std::memcpy(gk + entry_offset(r, b, entry, HD), entry_k.data(), HD * sizeof(float));
    std::memcpy(gv + entry_offset(r, b, entry, HD), entry_v.data(), HD * sizeof(float));
    if (linear(index_key, mean.data(), C, 1, slots, gi + entry_offset(r, b, entry, I), I)) return -1;
  }
  return 0;
}

// The indexer's choice for one query per row: the top_k global entries by ReLU-weighted score, an entry's block
// ending after the row's position scoring -inf, ties to the most recent; fewer than top_k entries pad invalid.
// As Indexer.select and top_k_recent (ced/model.py) compute it. idx (B, top_k) and valid (B, top_k) out.
int index_select(const DecodeRows* r, const float* xn, const Linear* query, const Linear* weight,
                 const float* index_keys, long heads, long dim, long top_k, long* idx, bool* valid) {
  const int B = r->B;
  const long C = query->in, N = r->n_entries, k = std::min(top_k, N);
  std::vector<float> q(B * heads * dim), w(B * heads);
  if (linear(query, xn, C, B, r->lora_slots, q.data(), heads * dim) ||
      linear(weight, xn, C, B, r->lora_slots, w.data(), heads))
    return -1;
  parallel(B, B > 1, [&](long b) {  // a row per claim, on whichever thread: a row's choice is its own
    std::vector<float> scores(N);
    std::vector<long> order(N);
    for (long n = 0; n < N; ++n) {
      if ((n + 1) * r->block - 1 > r->positions[b]) {
        scores[n] = -INFINITY;
        continue;
      }
      const float* key = index_keys + entry_offset(r, b, n, dim);
      float score = 0.0f;
      for (long h = 0; h < heads; ++h)
        score += w[b * heads + h] * std::max(dot(q.data() + (b * heads + h) * dim, key, dim), 0.0f);
      scores[n] = score;
    }
    for (long n = 0; n < N; ++n) order[n] = n;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](long a, long c) {
      return scores[a] > scores[c] || (scores[a] == scores[c] && a > c);
    });
    for (long j = 0; j < top_k; ++j) {
      idx[b * top_k + j] = j < k ? order[j] : 0;
      valid[b * top_k + j] = j < k && scores[order[j]] > -INFINITY;
    }
  });
  return 0;
}

// The second half: each row's one query over its ring (masked by distance) and, with a selection, its selected
// global entries (gk / gv: pages of (H, D) entries), the rows in two halves where a second thread is free; then o
// with the rows' LoRA and the residual: y = x + o(...).
int attention_post(const DecodeRows* r, const float* x, const float* q, const float* ring_k, const float* ring_v,
                   long H, long D, float scale, const float* gk, const float* gv, const long* idx, const bool* valid,
                   long top_k, const Linear* o_lin, float* y) {
  const int B = r->B;
  const long HD = H * D, S = r->filled, K = (gk && idx) ? top_k : 0;
  std::vector<float> out(B * HD);
  parallel(B, true, [&](long b) {
    std::vector<float> p(S + K);
    for (long h = 0; h < H; ++h) {
      const float* qh = q + b * HD + h * D;
      const float* keys = ring_k + (r->slots[b] * H + h) * r->window * D;
      const float* values = ring_v + (r->slots[b] * H + h) * r->window * D;
      float top = -INFINITY;
      for (long s = 0; s < S; ++s) {  // a place not written yet (its position would be < 0) is masked
        const long position = r->positions[b], distance = ((position - s) % r->window + r->window) % r->window;
        float score = -INFINITY;
        if (distance <= position) score = dot(qh, keys + s * D, D) * scale;
        top = std::max(top, p[s] = score);
      }
      for (long j = 0; j < K; ++j) {
        float score = -INFINITY;
        if (valid[b * K + j]) score = dot(qh, gk + entry_offset(r, b, idx[b * K + j], HD) + h * D, D) * scale;
        top = std::max(top, p[S + j] = score);
      }
      float total = 0.0f;
      kernels::exp_shifted(p.data(), S + K, top);
      for (long i = 0; i < S + K; ++i) total += p[i];
      float* o = out.data() + b * HD + h * D;
      for (long s = 0; s < S; ++s) {
        const float weight = p[s] / total;
        for (long d = 0; d < D; ++d) o[d] += weight * values[s * D + d];
      }
      for (long j = 0; j < K; ++j) {
        if (!valid[b * K + j]) continue;
        const float weight = p[S + j] / total;
        const float* value = gv + entry_offset(r, b, idx[b * K + j], HD) + h * D;
        for (long d = 0; d < D; ++d) o[d] += weight * value[d];
      }
    }
  });
  const long C = o_lin->out;
  if (linear(o_lin, out.data(), HD, B, r->lora_slots, y, C)) return -1;
  for (long i = 0; i < B * C; ++i) y[i] = x[i] + y[i];
  return 0;
}

// One block of a decode step's layer stack: a layer's attention (`ffn_gate` null) or its FFN (`q` null). Mirrored by
// ced/kernels StepBlock; ced/native_decode.py fills it from the layer's modules and the pool's buffers.
struct StepBlock {
  const float* norm;  // the block's RMSNorm weight
  float eps;
  const Linear *q, *k, *v, *o;  // attention
  long heads, head_dim;
  float scale;
  float *ring_k, *ring_v;                         // the layer's window rings
  const Linear *gate, *index_key;                 // a source layer's compressor (null elsewhere)
  float *pending, *own_gk, *own_gv, *own_gi;      // ... its pending blocks and the entries it writes
  const Linear *index_query, *index_weight;       // an index layer's indexer (null elsewhere)
  long index_heads, index_dim;
  const float *src_gk, *src_gv, *src_gi;          // the global source the layer reads (null: none)
  long top_k;
  const Linear *ffn_gate, *ffn_up, *ffn_down;     // FFN
};

}  // extern "C"

namespace {

// The blocks in order on x (B, C), in place, as CEDLayer.attention_block and ffn_block (ced/model.py) compute
// them. idx / valid (B, top_k) carry the latest index layer's choice from layer to layer; `selected` says whether
// they hold one.
int run_blocks(const DecodeRows* r, const StepBlock* blocks, int n, float* x, long C, long* idx, bool* valid,
               bool& selected) {
  const int B = r->B;
  std::vector<float> y(B * C), xn(B * C), q;
  for (const StepBlock* s = blocks; s < blocks + n; ++s) {
    if (s->q == nullptr) {
      if (swiglu_block(x, B, s->norm, s->eps, s->ffn_gate, s->ffn_up, s->ffn_down, r->lora_slots, y.data()))
        return -1;
    } else {
      q.resize(B * s->heads * s->head_dim);
      if (attention_pre(r, x, s->norm, s->eps, s->q, s->k, s->v, s->heads, s->head_dim, s->ring_k, s->ring_v,
                        xn.data(), q.data()))
        return -1;
      if (s->gate && compress_rows(r, xn.data(), s->pending, s->k, s->v, s->gate, s->index_key, s->heads,
                                   s->head_dim, s->own_gk, s->own_gv, s->own_gi))
        return -1;
      const bool has_entries = s->src_gk && r->n_entries > 0;  // none before the source's first block ends
      if (s->index_query) {
        selected = has_entries;
        if (has_entries && index_select(r, xn.data(), s->index_query, s->index_weight, s->src_gi, s->index_heads,
                                        s->index_dim, s->top_k, idx, valid))
          return -1;
      }
      const bool reads = has_entries && selected;
      if (attention_post(r, x, q.data(), s->ring_k, s->ring_v, s->heads, s->head_dim, s->scale,
                         reads ? s->src_gk : nullptr, reads ? s->src_gv : nullptr, reads ? idx : nullptr,
                         reads ? valid : nullptr, s->top_k, s->o, y.data()))
        return -1;
    }
    std::memcpy(x, y.data(), B * C * sizeof(float));
  }
  return 0;
}

}  // namespace

extern "C" {

// The whole model for a decode step: its blocks in two stages and what lies around them. Mirrored by ced/kernels
// StepModel; ced/native_decode.py fills it.
struct StepModel {
  const float* embed;          // (V, C) the token embedding
  long hidden;                 // C
  const StepBlock* shared;     // layers 0..E-1 and layer E's attention
  int n_shared;
  const StepBlock* decoder;    // layer E's FFN and layers E+1..L-1
  int n_decoder;
  long top_k;
  float* stream_ring;          // (slots, W, C) the replay rings: layer E's post-attention stream ...
  long* sel_idx_ring;          // (slots, W, top_k) ... and its top-k choice
  bool* sel_valid_ring;
  const float* final_norm;
  float final_eps;
  const Linear* head;          // (C, V)
};

// One decode step of B rows (each one token) as BatchedEngine.step runs it through CEDForCausalLM's shared_stage,
// the replay rings and decoder_stage (ced/model.py, ced/batched.py): the next-token logits (B, V) out.
int decode_step(const DecodeRows* r, const StepModel* m, const long* tokens, float* logits) {
  const int B = r->B;
  const long C = m->hidden, K = m->top_k, W = r->window;
  std::vector<float> x(B * C), normed(B * C);
  std::vector<long> idx(B * K, 0);
  std::unique_ptr<bool[]> valid(new bool[B * K]());
  bool selected = false;
  for (int b = 0; b < B; ++b) std::memcpy(x.data() + b * C, m->embed + tokens[b] * C, C * sizeof(float));
  if (run_blocks(r, m->shared, m->n_shared, x.data(), C, idx.data(), valid.get(), selected)) return -1;
  for (int b = 0; b < B; ++b) {  // what a switch replays: an invalid place kept as entry 0 (BatchedEngine._keep_stream)
    const long place = r->slots[b] * W + r->positions[b] % W;
    std::memcpy(m->stream_ring + place * C, x.data() + b * C, C * sizeof(float));
    for (long j = 0; j < K; ++j) {
      const bool kept = selected && valid[b * K + j];
      m->sel_valid_ring[place * K + j] = kept;
      m->sel_idx_ring[place * K + j] = kept ? idx[b * K + j] : 0;
    }
  }
  if (run_blocks(r, m->decoder, m->n_decoder, x.data(), C, idx.data(), valid.get(), selected)) return -1;
  rms_norm(x.data(), B, C, m->final_norm, m->final_eps, normed.data());
  return linear(m->head, normed.data(), C, B, r->lora_slots, logits, m->head->out);
}

}  // extern "C"
