// y = x @ W for a few rows of x (a decode step's batch): each weight is read once, from panels that lie in memory
// in the order the loop reads them, for every row of the call at once.
//
// A weight W (in, out) is packed as column panels: 64 columns wide while 64 remain, then 16 wide, then one panel of
// what is left; each panel's `in` rows of its width contiguous. Row m of y is accumulated over i = 0 .. in-1 in
// that order with one fused multiply-add per term, whatever the number of rows in the call and whichever panel
// holds the column: a row's result is the same bits alone or in any batch.
//
// Built by ced/kernels/__init__.py with the host's compiler for the host's CPU (-O3 -march=native).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned access to 16 floats

inline v16 load(const float* p) { return *(const v16u*)p; }
inline void store(float* p, v16 v) { *(v16u*)p = v; }

// Rows [0, MR) of x against one panel of 16*NV columns starting at column o0.
template <int MR, int NV>
void tile(const float* x, long ldx, const float* panel, long in, long o0, float* y, long ldy, bool accumulate) {
  v16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = accumulate ? load(y + m * ldy + o0 + 16 * v) : (v16){};
  const float* w = panel;
  for (long i = 0; i < in; ++i, w += 16 * NV) {
    v16 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(w + 16 * v);
    for (int m = 0; m < MR; ++m) {
      v16 xm = (v16){} + x[m * ldx + i];
      for (int v = 0; v < NV; ++v) acc[m][v] += xm * wv[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) store(y + m * ldy + o0 + 16 * v, acc[m][v]);
}

// Every row against one panel, four rows at a time (16 accumulators of the 32 vector registers).
template <int NV>
void panel_rows(const float* x, long ldx, int M, const float* panel, long in, long o0, float* y, long ldy,
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

}  // namespace

extern "C" {

// W (in, out), row-major, into `packed` (in * out floats).
void pack_weight(const float* w, long in, long out, float* packed) {
  for (long o = 0, width; o < out; o += width) {
    width = panel_width(out - o);
    for (long i = 0; i < in; ++i, packed += width) std::memcpy(packed, w + i * out + o, width * sizeof(float));
  }
}

// y[m, :] (+)= x[m, :] @ W for m < M; x rows ldx apart, y rows ldy apart; W packed by pack_weight.
void gemm_rows(const float* x, long ldx, int M, const float* packed, long in, long out, float* y, long ldy,
               int accumulate) {
  long o = 0;
  const float* panel = packed;
  for (; o + 64 <= out; o += 64, panel += 64 * in) panel_rows<4>(x, ldx, M, panel, in, o, y, ldy, accumulate);
  for (; o + 16 <= out; o += 16, panel += 16 * in) panel_rows<1>(x, ldx, M, panel, in, o, y, ldy, accumulate);
  const long width = out - o;
  for (int m = 0; m < M; ++m)
    for (long j = 0; j < width; ++j) {
      float sum = accumulate ? y[m * ldy + o + j] : 0.0f;
      for (long i = 0; i < in; ++i) sum += x[m * ldx + i] * panel[i * width + j];
      y[m * ldy + o + j] = sum;
    }
}

// A linear of the model: its packed weight and, where it has LoRA slots, the slots' packed A (in, rank) and B
// (rank, out), a_stride / b_stride floats apart (a == nullptr: none). Mirrored by ced/kernels LinearSpec.
struct Linear {
  const float* panels;
  long in, out;
  const float* a;
  long a_stride;
  const float* b;
  long b_stride;
  long rank;
};

enum { MAX_RANK = 1024 };

// y[m] = x[m] @ W, plus each row's own LoRA where `slots` is given: (x[m] @ A[s]) @ B[s], s = slots[m] (a row of
// slot -1 keeps the base's bits).
int linear(const Linear* L, const float* x, long ldx, int M, const long* slots, float* y, long ldy) {
  if (L->rank > MAX_RANK) return -1;
  gemm_rows(x, ldx, M, L->panels, L->in, L->out, y, ldy, 0);
  if (!slots || !L->a) return 0;
  float down[MAX_RANK];
  for (int m = 0; m < M; ++m) {
    if (slots[m] < 0) continue;
    gemm_rows(x + m * ldx, ldx, 1, L->a + slots[m] * L->a_stride, L->in, L->rank, down, L->rank, 0);
    gemm_rows(down, L->rank, 1, L->b + slots[m] * L->b_stride, L->rank, L->out, y + m * ldy, ldy, 1);
  }
  return 0;
}

// RMSNorm of M rows of C: y = (x / sqrt(mean(x^2) + eps)) * w.
void rms_norm(const float* x, int M, long C, const float* w, float eps, float* y) {
  for (int m = 0; m < M; ++m, x += C, y += C) {
    float sum = 0.0f;
    for (long c = 0; c < C; ++c) sum += x[c] * x[c];
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
  for (long i = 0; i < M * F; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
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
        if (distance >= 0 && distance < window) {
          float dot = 0.0f;
          for (long d = 0; d < D; ++d) dot += qh[d] * kh_[s * D + d];
          score = dot * scale;
        }
        p[s] = score;
        top = std::max(top, score);
      }
      for (long j = 0; j < K; ++j) {
        float score = -INFINITY;
        if (valid[b * K + j]) {
          float dot = 0.0f;
          for (long d = 0; d < D; ++d) dot += qh[d] * gk[j * D + d];
          score = dot * scale;
        }
        p[S + j] = score;
        top = std::max(top, score);
      }
      float total = 0.0f;
      for (long i = 0; i < S + K; ++i) total += (p[i] = std::exp(p[i] - top));
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

}  // extern "C"
