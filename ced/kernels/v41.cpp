// The deepseek_v41 family's decode step in one call (ced/deepseek_v41/native.py fills the structs and calls it).
//
// B rows, one token each, through every layer as DeepseekV41ForCausalLM computes them (ced/deepseek_v41/model.py):
// per layer the mHC streams collapsed with the previous site's pre-mix, MQA over one shared K = V latent (the
// window of the last W latents and the selected entries of a global KV, a sink per head, the output's rope slice
// turned back, the grouped output projection), the compressor of a KV source, the indexer's top-k and candidate
// pool, the MoE (routed experts grouped by the rows that chose them, a shared expert) and the mHC weights
// (Sinkhorn-Knopp) of both sites. Each row's state is read and written in place: its windows, stores and pending
// group, and what a switch replays (layer E's streams, pre-mix, top-k and pool), at the places the caller
// reserved. Products run on decode.cpp's panels with each row's LoRA; a row's result does not depend on the other
// rows of the call. Same arithmetic as the torch model in another summation order: logits agree to float tolerance.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "kernels.h"

using kernels::dot;

constexpr int MAX_STORES = 8;  // KV sources a model may have (V4.1-Flash has 4)

extern "C" {

// One layer: its attention site and its FFN site. Mirrored by ced/kernels V41Layer.
struct V41Layer {
  const float* attn_norm;
  const Linear *wq_a, *wq_b, *wkv, *wo_a, *wo_b;  // wo_a: o_groups linears, one per group of heads
  const float *q_norm, *kv_norm, *sink;
  int rope;        // 0: the main rope, 1: the compress rope
  int own_store;   // the store this layer's compressor writes (-1: not a KV source)
  int read_store;  // the store it attends to (-1: its window only)
  int ratio;       // the compress ratio of the store it writes
  const Linear *c_wkv, *c_wgate;  // compressor (c_wgate null at ratio 1)
  const float* c_norm;
  const Linear* i_wk;  // indexer keys of the entries it writes
  const float* i_k_norm;
  const Linear *i_wq_b, *i_weights;  // indexer queries (null: not an index source)
  int uses_candidates, candidate_source;
  const float *hc_attn_fn, *hc_attn_base, *hc_attn_scale;
  const float* ffn_norm;
  const float *gate_w, *gate_bias;  // (n_experts, C), (n_experts)
  const Linear* experts;            // n_experts x (w1, w2, w3)
  const Linear* shared;             // (w1, w2, w3), or null
  const float *hc_ffn_fn, *hc_ffn_base, *hc_ffn_scale;
};

// The model's sizes and shared weights. Mirrored by ced/kernels V41Model.
struct V41Model {
  long C, H, D, R, Q, G, hc, vocab, window, index_heads, index_dim, index_topk, cand_blocks, cand_block_size,
      n_experts, top_experts, store_ratio[MAX_STORES];
  int n_layers, decoder_start, sinkhorn_iters, scoring, norm_topk;  // scoring: 0 sqrtsoftplus, 1 sigmoid, 2 softmax
  float eps, hc_eps, routed_scale, swiglu_limit;
  const float* inv_freq[2];  // (R/2): main, compress
  const float *embed, *final_norm;
  const Linear* head;
  const V41Layer* layers;
};

// Where one of a conversation's tails (ced/deepseek_v41/state.py Tail) holds its positions: n of them from `start`,
// `room` free ones after them, `stride` bytes apart from `buf`; keep > 0: it holds at most that many, the oldest
// dropping out. Mirrored by ced/kernels TailMeta; the Tail reads and writes these very fields.
struct TailMeta {
  char* buf;
  long start, n, room, stride, keep;
};

// The rows of one step and where their state lies. Mirrored by ced/kernels V41Rows.
struct V41Rows {
  int B;
  const long* positions;   // (B) this token's position
  const long* lora_slots;  // (B) each row's adapter slot (-1: none), or null
  float* const* windows;   // (B, L): layer l's window of row b: window_n latents, then room for this one
  const long* window_n;
  float* const* latents;  // (B, MAX_STORES): store s of row b: n_entries entries, then room for one more
  float* const* keys;
  const long* n_entries;
  float* const* pending;   // (B, MAX_STORES): the inputs of the group in progress (position % ratio of them), then room
  float* const* stream;    // (B): where this position's layer-E streams (hc, C) go
  float* const* pre;       // (B): ... and its pre-mix (hc)
  long* const* selection_idx;  // (B): ... its top-k (index_topk), or null: not kept
  bool* const* selection_valid;
  long* const* pool_idx;   // (B): ... its candidate pool (cand_blocks), or null
  bool* const* pool_valid;
};

}  // extern "C"

using kernels::scratch;  // a call's temporaries (kernels.h)

namespace {

constexpr float NEG_INF = -INFINITY;

// GCC 12 and clang shuffle vectors in registers (15 % faster a step here than adding lanes read one by one); an
// older GCC adds the lanes in the same order.
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLES 1
#endif

// The 16 lanes of v added as a tree (a lane-by-lane sum is a chain of 16 dependent adds): halves, quarters, then
// the four sums in pairs.
inline float hsum(kernels::v16 v) {
#ifdef SHUFFLES
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4_ __attribute__((vector_size(16)));
  const v8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4_ quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
#else
  float half[8], quarter[4];
  for (int i = 0; i < 8; ++i) half[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) quarter[i] = half[i] + half[i + 4];
#endif
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

// sum_i a[i] * b[i], its lanes added by hsum (the indexer's scores of every entry and the window's dots wait on
// the sum). Same order for every call.
inline float dot_tree(const float* a, const float* b, long n) {
  if (n % 16) return dot(a, b, n);
  kernels::v16 acc = {};
  for (long i = 0; i < n; i += 16) acc += kernels::load(a + i) * kernels::load(b + i);
  return hsum(acc);
}

// y[k] = dot_tree(rows + k * n, x) for k < count: eight rows at a time against each load of x (their sums
// independent, so the multiplies do not wait on one another).
void dots_of(const float* rows, long count, const float* x, long n, float* y) {
  if (n % 16) {
    for (long k = 0; k < count; ++k) y[k] = dot(rows + k * n, x, n);
    return;
  }
  long k0 = 0;
  for (; k0 + 8 <= count; k0 += 8) {  // a whole group: its sums stay in registers (a group of `count`'s size spilled)
    kernels::v16 acc[8] = {};
    for (long i = 0; i < n; i += 16) {
      const kernels::v16 xv = kernels::load(x + i);
      for (int k = 0; k < 8; ++k) acc[k] += kernels::load(rows + (k0 + k) * n + i) * xv;
    }
    for (int k = 0; k < 8; ++k) y[k0 + k] = hsum(acc[k]);
  }
  for (; k0 < count; ++k0) y[k0] = dot_tree(rows + k0 * n, x, n);
}

#ifdef SHUFFLES
// Where lane r of a fold of x (m entries of 16 / m partial sums each, in entry order) and y (the next m) reads:
// the entry's partial o, plus `half` for its partial o + 16 / (2m).
constexpr int fold_lane(int m, int r, int half) {
  const int width = 16 / m, kept = width / 2, entry = r / kept, o = r % kept;
  return (entry < m ? entry * width : 16 + (entry - m) * width) + o + (half ? kept : 0);
}

template <int M, int... R>
inline kernels::v16 fold(kernels::v16 x, kernels::v16 y, std::integer_sequence<int, R...>) {
  return __builtin_shufflevector(x, y, fold_lane(M, R, 0)...) + __builtin_shufflevector(x, y, fold_lane(M, R, 1)...);
}

// Lane j = hsum(acc[j]), bit for bit (each level adds what hsum adds at it), for 16 sums at once: 15 folds of two
// vectors in place of 16 trees of one.
inline kernels::v16 sums16(const kernels::v16* acc) {
  const auto lanes = std::make_integer_sequence<int, 16>();
  kernels::v16 two[8], four[4], eight[2];
  for (int j = 0; j < 8; ++j) two[j] = fold<1>(acc[2 * j], acc[2 * j + 1], lanes);
  for (int j = 0; j < 4; ++j) four[j] = fold<2>(two[2 * j], two[2 * j + 1], lanes);
  for (int j = 0; j < 2; ++j) eight[j] = fold<4>(four[2 * j], four[2 * j + 1], lanes);
  return fold<8>(eight[0], eight[1], lanes);
}
#else
inline kernels::v16 sums16(const kernels::v16* acc) {
  kernels::v16 out;
  for (int j = 0; j < 16; ++j) out[j] = hsum(acc[j]);
  return out;
}
#endif

// y[j] = scale * (q . rows[j]) for j < count, each dot as dot_tree sums it (as `dot` where n is not a multiple of
// 16); 16 rows at a time, their dots reduced side by side (sums16).
void value_dots(const float* q, const float* const* rows, long count, long n, float scale, float* y) {
  long j0 = 0;
  if (n % 16 == 0)
    for (; j0 + 16 <= count; j0 += 16) {
      kernels::v16 acc[16] = {};
      for (long i = 0; i < n; i += 16) {
        const kernels::v16 qv = kernels::load(q + i);
        for (int j = 0; j < 16; ++j) acc[j] += kernels::load(rows[j0 + j] + i) * qv;
      }
      kernels::store(y + j0, sums16(acc) * scale);
    }
  for (long j = j0; j < count; ++j) y[j] = dot_tree(q, rows[j], n) * scale;
}

// The indexer's ReLU-weighted scores of `count` keys (rows of dI: keys + entry * dI, entry = entries[j] where given,
// else j) against nI heads' queries q (nI, dI): sum_h weight[h] * max(q_h . key, 0), heads in order, each
// dot as dot_tree sums it. 16 keys at a time where dI is a multiple of 16: their 16 dots of a head reduced side by
// side (sums16).
void index_scores(const float* q, const float* weight, long nI, long dI, const float* keys, const long* entries,
                  long count, float* scores) {
  auto key = [&](long j) { return keys + (entries ? entries[j] : j) * dI; };
  long j0 = 0;
  if (dI % 16 == 0)
    for (; j0 + 16 <= count; j0 += 16) {
      for (long j = j0 + 16; j < std::min(count, j0 + 32); ++j)  // the next 16 keys
        for (long i = 0; i < dI; i += 16) __builtin_prefetch(key(j) + i);
      kernels::v16 total = {};
      for (long h = 0; h < nI; ++h) {
        kernels::v16 acc[16] = {};
        for (long i = 0; i < dI; i += 16) {
          const kernels::v16 qv = kernels::load(q + h * dI + i);
          for (int j = 0; j < 16; ++j) acc[j] += kernels::load(key(j0 + j) + i) * qv;
        }
        const kernels::v16 dots = sums16(acc);
        total += weight[h] * (dots < 0.0f ? (kernels::v16){} : dots);  // std::max(dot, 0) lane by lane
      }
      kernels::store(scores + j0, total);
    }
  for (long j = j0; j < count; ++j) {
    float total = 0.0f;
    for (long h = 0; h < nI; ++h) total += weight[h] * std::max(dot_tree(q + h * dI, key(j), dI), 0.0f);
    scores[j] = total;
  }
}

// o (D) = sum_j weights[j] * rows[j], j in order, 64 dims at a time in registers.
void weighted_rows(const float* weights, const float* const* rows, long n, long D, float* o) {
  using kernels::load, kernels::v16;
  long d = 0;
  for (; d + 64 <= D; d += 64) {
    v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (long j = 0; j < n; ++j) {
      const float* row = rows[j] + d;
      const v16 w = (v16){} + weights[j];
      a0 += w * load(row), a1 += w * load(row + 16), a2 += w * load(row + 32), a3 += w * load(row + 48);
    }
    kernels::store(o + d, a0), kernels::store(o + d + 16, a1), kernels::store(o + d + 32, a2);
    kernels::store(o + d + 48, a3);
  }
  for (; d < D; ++d) {
    float sum = 0.0f;
    for (long j = 0; j < n; ++j) sum += weights[j] * rows[j][d];
    o[d] = sum;
  }
}

// out[h] (D) = sum_j weights[h, j] * rows[j] for every head h: four heads at a time against each read of a row
// (MQA: the heads share their keys and values), 64 dims at a time in registers; j in order, as weighted_rows.
void weighted_heads(const float* weights, long H, const float* const* rows, long n, long D, float* out) {
  using kernels::load, kernels::v16;
  if (D % 64) {
    for (long h = 0; h < H; ++h) weighted_rows(weights + h * n, rows, n, D, out + h * D);
    return;
  }
  for (long h0 = 0; h0 < H; h0 += 4) {
    const long heads = std::min(4L, H - h0);
    for (long d = 0; d < D; d += 64) {
      v16 acc[4][4] = {};
      for (long j = 0; j < n; ++j) {
        const float* row = rows[j] + d;
        const v16 r0 = load(row), r1 = load(row + 16), r2 = load(row + 32), r3 = load(row + 48);
        for (long h = 0; h < heads; ++h) {
          const v16 w = (v16){} + weights[(h0 + h) * n + j];
          acc[h][0] += w * r0, acc[h][1] += w * r1, acc[h][2] += w * r2, acc[h][3] += w * r3;
        }
      }
      for (long h = 0; h < heads; ++h)
        for (int v = 0; v < 4; ++v) kernels::store(out + (h0 + h) * D + d + 16 * v, acc[h][v]);
    }
  }
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Interleaved pairs (2i, 2i+1) of the trailing R dims of each of `heads` heads of width D, rotated by the angles
// pos * inv_freq (sign -1: back).
void rope(float* x, long heads, long D, long R, const float* inv_freq, long pos, float sign) {
  for (long i = 0; i < R / 2; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = sign * std::sin(angle);
    for (long h = 0; h < heads; ++h) {
      float* pair = x + h * D + D - R + 2 * i;
      const float a = pair[0], b = pair[1];
      pair[0] = a * c - b * s;
      pair[1] = a * s + b * c;
    }
  }
}

// The largest of the 16 lanes (of numbers: a NaN lane may or may not be passed over), halves against halves: four
// steps, where lane after lane was a chain of fifteen.
inline float hmax(kernels::v16 v) {
#ifdef SHUFFLES
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4_ __attribute__((vector_size(16)));
  const v8 lo8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 hi8 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 half = lo8 < hi8 ? hi8 : lo8;
  const v4_ lo4 = __builtin_shufflevector(half, half, 0, 1, 2, 3);
  const v4_ hi4 = __builtin_shufflevector(half, half, 4, 5, 6, 7);
  const v4_ quarter = lo4 < hi4 ? hi4 : lo4;
  return std::max(std::max(quarter[0], quarter[1]), std::max(quarter[2], quarter[3]));
#else
  float top = v[0];
  for (int lane = 1; lane < 16; ++lane) top = std::max(top, v[lane]);
  return top;
#endif
}

// The k best of `n` candidates (scores[i], entry i, or entries[i] where given: increasing in i), ties to the
// higher entry, best first; fewer than k (or -inf ones) leave invalid places of entry 0: as _top_k over
// top_k_recent (model.py) picks and orders them. The order is strict, so the k and their order are those a full
// sort gives. Where there are at least k runs of 16, the k-th best of the runs' maxima bounds the k best from below
// (k runs each hold one score that high), so only the scores that reach it are sorted: a few more than k, whatever
// the order of the scores. Otherwise the k kept so far are a heap with the worst on top.
void top_k(const float* scores, const long* entries, long n, long k, long* idx, char* valid) {
  struct Candidate {
    float score;
    long entry;
  };
  auto better = [](const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.entry > b.entry);
  };
  auto entry = [&](long i) { return entries ? entries[i] : i; };
  scratch<Candidate> best;
  const long runs = n / 16;
  if (k > 0 && runs >= k) {
    scratch<float> maxima(runs);
    for (long r = 0; r < runs; ++r) maxima[r] = hmax(kernels::load(scores + 16 * r));
    scratch<float> ranked(maxima);
    std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(), std::greater<float>());
    const float bound = ranked[k - 1];
    for (long r = 0; r < runs; ++r)
      if (maxima[r] >= bound)
        for (long i = 16 * r; i < 16 * r + 16; ++i)
          if (scores[i] >= bound) best.push_back({scores[i], entry(i)});
    for (long i = 16 * runs; i < n; ++i)
      if (scores[i] >= bound) best.push_back({scores[i], entry(i)});
    std::partial_sort(best.begin(), best.begin() + k, best.end(), better);
    best.resize(k);
  } else {
    const long kept = std::min(k, n);
    best.resize(kept);
    for (long i = 0; i < kept; ++i) best[i] = {scores[i], entry(i)};
    std::make_heap(best.begin(), best.end(), better);  // "largest" under `better` on top: the worst kept
    for (long i = kept; i < n && kept > 0; ++i)
      if (scores[i] >= best.front().score) {  // a later candidate of the worst's score has the higher entry
        std::pop_heap(best.begin(), best.end(), better);
        best.back() = {scores[i], entry(i)};
        std::push_heap(best.begin(), best.end(), better);
      }
    std::sort(best.begin(), best.end(), better);
  }
  for (long j = 0; j < k; ++j) {
    valid[j] = j < static_cast<long>(best.size()) && best[j].score > NEG_INF;
    idx[j] = valid[j] ? best[j].entry : 0;
  }
}

// hc_weights (model.py) of one position's streams x (n, C): pre (n), post (n) and the doubly stochastic comb (n, n)
// after Sinkhorn-Knopp, from the site's projection fn ((2 + n) * n, n * C), base and scale (3).
void hc_mix(const float* fn, const float* base, const float* scale, const float* x, long n, long C, int iters,
            float eps, float hc_eps, float* pre, float* post, float* comb) {
  const long width = n * C;
  const float r = 1.0f / std::sqrt(dot(x, x, width) / width + eps);
  scratch<float> mixes((2 + n) * n);
  dots_of(fn, (2 + n) * n, x, width, mixes.data());
  for (float& mix : mixes) mix *= r;
  for (long j = 0; j < n; ++j) {
    pre[j] = sigmoid(mixes[j] * scale[0] + base[j]) + hc_eps;
    post[j] = 2.0f * sigmoid(mixes[n + j] * scale[1] + base[n + j]);
  }
  for (long i = 0; i < n; ++i) {  // softmax over each row of comb
    float* row = comb + i * n;
    float top = NEG_INF, total = 0.0f;
    for (long j = 0; j < n; ++j) top = std::max(top, row[j] = mixes[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j]);
    for (long j = 0; j < n; ++j) total += (row[j] = std::exp(row[j] - top));
    for (long j = 0; j < n; ++j) row[j] = row[j] / total + hc_eps;
  }
  // Sinkhorn-Knopp: each column (then row, column, ...) of comb over its sum + hc_eps, one division per line
  auto normalise = [&](bool rows) {
    const long line = rows ? n : 1, step = rows ? 1 : n;
    for (long k = 0; k < n; ++k) {
      float sum = 0.0f;
      for (long e = 0; e < n; ++e) sum += comb[k * line + e * step];
      const float inverse = 1.0f / (sum + hc_eps);
      for (long e = 0; e < n; ++e) comb[k * line + e * step] *= inverse;
    }
  };
  normalise(false);
  for (int it = 1; it < iters; ++it) normalise(true), normalise(false);
}

// hc_weights and hc_expand (model.py) on one row's streams x (hc, C): the site's output `out` (C) spread by post,
// the streams mixed by comb^T; `pre` (hc) is the pre-mix the next site collapses with.
void hc_site(const V41Model* m, const float* fn, const float* base, const float* scale, float* x, const float* out,
             float* pre) {
  const long n = m->hc, C = m->C;
  scratch<float> post(n), comb(n * n), mixed(n * C);
  hc_mix(fn, base, scale, x, n, C, m->sinkhorn_iters, m->eps, m->hc_eps, pre, post.data(), comb.data());
  for (long j = 0; j < n; ++j) {  // stream j: post[j] * out + sum_i comb[i][j] * x[i]
    float* stream = mixed.data() + j * C;
    for (long i = 0; i < n; ++i)
      for (long c = 0; c < C; ++c) stream[c] = (i ? stream[c] : 0.0f) + comb[i * n + j] * x[i * C + c];
    for (long c = 0; c < C; ++c) stream[c] = post[j] * out[c] + stream[c];
  }
  std::memcpy(x, mixed.data(), n * C * sizeof(float));
}

// sum_j pre[j] * x[j] over the hc streams of each row, then the RMSNorm of weight `norm`: (B, C).
void collapse_norm(const V41Model* m, int B, const float* x, const float* pre, const float* norm, float* h, float* xn) {
  const long n = m->hc, C = m->C;
  for (int b = 0; b < B; ++b)
    for (long c = 0; c < C; ++c) {
      float sum = 0.0f;
      for (long j = 0; j < n; ++j) sum += pre[b * n + j] * x[(b * n + j) * C + c];
      h[b * C + c] = sum;
    }
  rms_norm(h, B, C, norm, m->eps, xn);
}

struct Step {  // what a step carries from layer to layer
  const V41Model* m;
  const V41Rows* r;
  int B;
  scratch<float> x, pre;      // (B, hc, C) the streams, (B, hc) the pre-mix of the last site
  scratch<long> sel_idx, pool_idx;
  scratch<char> sel_valid, pool_valid, has_sel, has_pool;
  scratch<long> entries;      // (B, MAX_STORES) each store's entries after this step's compressors
};

// A KV source's compressor for each row whose group completes at this position: the group's inputs pooled
// (softmax-gated per dim at ratio >= 2), normed, its indexer key, both rotated at the group's first position.
int compress(Step& s, const V41Layer* L, const float* xn) {
  const V41Model* m = s.m;
  const long C = m->C, D = m->D, I = m->index_dim, ratio = L->ratio;
  scratch<float> kv(ratio * D), gate(ratio * D), latent(D), key(I), normed(D);
  for (int b = 0; b < s.B; ++b) {
    const long pos = s.r->positions[b], place = pos % ratio;
    float* group = s.r->pending[b * MAX_STORES + L->own_store];
    if (ratio > 1) std::memcpy(group + place * C, xn + b * C, C * sizeof(float));
    if (place != ratio - 1) continue;
    const float* inputs = ratio > 1 ? group : xn + b * C;
    if (linear(L->c_wkv, inputs, C, ratio, nullptr, kv.data(), D)) return -1;
    if (ratio > 1) {
      if (linear(L->c_wgate, inputs, C, ratio, nullptr, gate.data(), D)) return -1;
      for (long d = 0; d < D; ++d) {
        float top = NEG_INF, total = 0.0f, sum = 0.0f;
        for (long j = 0; j < ratio; ++j) top = std::max(top, gate[j * D + d]);
        for (long j = 0; j < ratio; ++j) total += std::exp(gate[j * D + d] - top);
        for (long j = 0; j < ratio; ++j) sum += kv[j * D + d] * (std::exp(gate[j * D + d] - top) / total);
        latent[d] = sum;
      }
    } else {
      std::memcpy(latent.data(), kv.data(), D * sizeof(float));
    }
    rms_norm(latent.data(), 1, D, L->c_norm, m->eps, normed.data());
    if (linear(L->i_wk, normed.data(), D, 1, nullptr, key.data(), I)) return -1;
    rms_norm(key.data(), 1, I, L->i_k_norm, m->eps, key.data());
    const long entry = s.entries[b * MAX_STORES + L->own_store], first = entry * ratio;
    rope(normed.data(), 1, D, m->R, m->inv_freq[L->rope], first, 1.0f);
    rope(key.data(), 1, I, m->R, m->inv_freq[L->rope], first, 1.0f);
    std::memcpy(s.r->latents[b * MAX_STORES + L->own_store] + entry * D, normed.data(), D * sizeof(float));
    std::memcpy(s.r->keys[b * MAX_STORES + L->own_store] + entry * I, key.data(), I * sizeof(float));
    s.entries[b * MAX_STORES + L->own_store] = entry + 1;
  }
  return 0;
}

// An index source's choice for each row with entries in the store it reads: the top-k entries by ReLU-weighted
// score (inside the candidate pool where the layer uses one and the row has it), and at the candidate source the
// pool of the best blocks.
int index(Step& s, const V41Layer* L, const float* xn, const float* q_res) {
  const V41Model* m = s.m;
  const long C = m->C, nI = m->index_heads, dI = m->index_dim, K = m->index_topk, P = m->cand_blocks;
  const long bs = m->cand_block_size, ratio = m->store_ratio[L->read_store];
  scratch<float> q(s.B * nI * dI), w(s.B * nI);
  if (linear(L->i_wq_b, q_res, m->Q, s.B, s.r->lora_slots, q.data(), nI * dI) ||
      linear(L->i_weights, xn, C, s.B, s.r->lora_slots, w.data(), nI))
    return -1;
  kernels::parallel_for(s.B, s.B > 1, [&](long b) {  // rows apart: each row reads entries compress wrote already
    const long N = s.entries[b * MAX_STORES + L->read_store], pos = s.r->positions[b];
    if (N == 0) return;
    float* qb = q.data() + b * nI * dI;
    rope(qb, nI, dI, m->R, m->inv_freq[L->rope], pos, 1.0f);
    scratch<float> head_weight(nI);  // w_h / sqrt(nI) / sqrt(dI): what a head's ReLU score is weighted by
    for (long h = 0; h < nI; ++h) head_weight[h] = w[b * nI + h] / std::sqrt(static_cast<float>(nI * dI));
    const float* keys = s.r->keys[b * MAX_STORES + L->read_store];
    const long seen = std::min(N, (pos + 1) / ratio);  // entries whose group ends at or before this position
    const long* sel_from = nullptr;  // the scored entries: 0 .. N-1, or the pool's (sel_from)
    scratch<long> pooled;
    scratch<float> scores;
    if (L->uses_candidates && s.has_pool[b]) {  // only the entries of the pool's blocks, in entry order
      scratch<long> blocks;
      for (long j = 0; j < P; ++j)
        if (s.pool_valid[b * P + j]) blocks.push_back(s.pool_idx[b * P + j]);
      std::sort(blocks.begin(), blocks.end());
      for (long block : blocks)
        for (long e = block * bs; e < std::min(N, (block + 1) * bs); ++e) pooled.push_back(e);
      while (!pooled.empty() && pooled.back() >= seen) pooled.pop_back();
      scores.resize(pooled.size());
      index_scores(qb, head_weight.data(), nI, dI, keys, pooled.data(), pooled.size(), scores.data());
      sel_from = pooled.data();
    } else {
      scores.assign(N, NEG_INF);
      index_scores(qb, head_weight.data(), nI, dI, keys, nullptr, seen, scores.data());
      if (L->candidate_source && P) {  // the pool: the blocks of the best entry scores
        const long n_blocks = (N + bs - 1) / bs;
        scratch<float> block_best(n_blocks);
        for (long block = 0; block < n_blocks; ++block) {  // a block's entries in order, its best in a register
          float best = NEG_INF;
          for (long e = block * bs; e < std::min(N, (block + 1) * bs); ++e) best = std::max(best, scores[e]);
          block_best[block] = best;
        }
        top_k(block_best.data(), nullptr, n_blocks, P, s.pool_idx.data() + b * P, s.pool_valid.data() + b * P);
        s.has_pool[b] = 1;
      }
    }
    top_k(scores.data(), sel_from, scores.size(), K, s.sel_idx.data() + b * K, s.sel_valid.data() + b * K);
    s.has_sel[b] = 1;
  });
  return 0;
}

// A layer's attention site on every row.
int attention_site(Step& s, const V41Layer* L, int layer) {
  const V41Model* m = s.m;
  const V41Rows* r = s.r;
  const int B = s.B;
  const long C = m->C, H = m->H, D = m->D, Q = m->Q, G = m->G, n = m->hc;
  const long Ro = L->wo_a[0].out, L_count = m->n_layers;
  scratch<float> h(B * C), xn(B * C), qa(B * Q), q_res(B * Q), kv(B * D), q(B * H * D), out(B * H * D),
      grouped(B * G * Ro), y(B * C);
  collapse_norm(m, B, s.x.data(), s.pre.data(), L->attn_norm, h.data(), xn.data());
  if (linear(L->wq_a, xn.data(), C, B, r->lora_slots, qa.data(), Q) ||
      linear(L->wkv, xn.data(), C, B, r->lora_slots, kv.data(), D))
    return -1;
  rms_norm(qa.data(), B, Q, L->q_norm, m->eps, q_res.data());
  for (int b = 0; b < B; ++b) {  // the new latent, rotated, into the row's window
    float* latent = kv.data() + b * D;
    rms_norm(latent, 1, D, L->kv_norm, m->eps, latent);
    rope(latent, 1, D, m->R, m->inv_freq[L->rope], r->positions[b], 1.0f);
    std::memcpy(r->windows[b * L_count + layer] + r->window_n[b * L_count + layer] * D, latent, D * sizeof(float));
  }
  if (L->own_store >= 0 && compress(s, L, xn.data())) return -1;
  if (L->i_wq_b && index(s, L, xn.data(), q_res.data())) return -1;
  if (linear(L->wq_b, q_res.data(), Q, B, r->lora_slots, q.data(), H * D)) return -1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const long K = m->index_topk;
  kernels::parallel_for(B, B > 1, [&](long b) {
    const long pos = r->positions[b], held = r->window_n[b * L_count + layer];
    const float* keys = r->windows[b * L_count + layer];
    const bool global = L->read_store >= 0 && s.entries[b * MAX_STORES + L->read_store] > 0 && s.has_sel[b];
    const float* latents = global ? r->latents[b * MAX_STORES + L->read_store] : nullptr;
    // K = V: the window's latents within distance W - 1 (a chunk's rows may hold older ones: left out, so a row
    // sums the same terms in the same order whatever its tail holds), then the selected entries
    scratch<const float*> values;
    values.reserve(m->window + K);
    for (long j = std::max(0L, held - m->window + 1); j <= held; ++j) values.push_back(keys + j * D);
    for (long j = 0; j < K; ++j)
      if (global && s.sel_valid[b * K + j]) values.push_back(latents + s.sel_idx[b * K + j] * D);
    const long S = values.size();
    float* qb = q.data() + b * H * D;
    rope(qb, H, D, m->R, m->inv_freq[L->rope], pos, 1.0f);
    scratch<float> weights(H * S);  // (H, S): each head's scores, then its softmax weights
    for (long head = 0; head < H; ++head)
      value_dots(qb + head * D, values.data(), S, D, scale, weights.data() + head * S);
    for (long head = 0; head < H; ++head) {  // one softmax over [window | selected entries | sink]
      float* w = weights.data() + head * S;
      const float top = std::max(*std::max_element(w, w + S), L->sink[head]);
      float total = 0.0f;
      kernels::exp_shifted(w, S, top);
      for (long j = 0; j < S; ++j) total += w[j];
      total += std::exp(L->sink[head] - top);
      for (long j = 0; j < S; ++j) w[j] /= total;
    }
    weighted_heads(weights.data(), H, values.data(), S, D, out.data() + b * H * D);
    rope(out.data() + b * H * D, H, D, m->R, m->inv_freq[L->rope], pos, -1.0f);
  });
  const long group_in = H * D / G;
  for (long g = 0; g < G; ++g)
    if (linear(L->wo_a + g, out.data() + g * group_in, H * D, B, r->lora_slots, grouped.data() + g * Ro, G * Ro))
      return -1;
  if (linear(L->wo_b, grouped.data(), G * Ro, B, r->lora_slots, y.data(), C)) return -1;
  kernels::parallel_for(B, B > 1, [&](long b) {
    hc_site(m, L->hc_attn_fn, L->hc_attn_base, L->hc_attn_scale, s.x.data() + b * n * C, y.data() + b * C,
            s.pre.data() + b * n);
  });
  return 0;
}

// One expert (w1, w2, w3) on M rows: y = w2(silu(w1 x) * w3 x), gate and up clamped at `limit` (0: not).
int expert(const Linear* w, const float* x, int M, const long* slots, float limit, float* y) {
  const long C = w[0].in, F = w[0].out;
  scratch<float> g(M * F), u(M * F);
  if (linear(w + 0, x, C, M, slots, g.data(), F) || linear(w + 2, x, C, M, slots, u.data(), F)) return -1;
  kernels::swiglu(g.data(), u.data(), M * F, limit);
  return linear(w + 1, g.data(), F, M, slots, y, C);
}

// A layer's FFN site on every row: the gate's top experts per row, each expert once over the rows that chose it.
int ffn_site(Step& s, const V41Layer* L) {
  const V41Model* m = s.m;
  const int B = s.B;
  const long C = m->C, E = m->n_experts, k = m->top_experts, n = m->hc;
  scratch<float> h(B * C), xn(B * C), routed(B * C, 0.0f), weights(B * k), scores(E), biased(E);
  scratch<long> ids(B * k);
  collapse_norm(m, B, s.x.data(), s.pre.data(), L->ffn_norm, h.data(), xn.data());
  for (int b = 0; b < B; ++b) {
    for (long e = 0; e < E; ++e) {
      const float logit = dot(L->gate_w + e * C, xn.data() + b * C, C);
      scores[e] = m->scoring == 0 ? std::sqrt(logit > 20.0f ? logit : std::log1p(std::exp(logit)))
                  : m->scoring == 1 ? sigmoid(logit) : logit;
    }
    if (m->scoring == 2) {
      float top = *std::max_element(scores.begin(), scores.end()), total = 0.0f;
      for (long e = 0; e < E; ++e) total += (scores[e] = std::exp(scores[e] - top));
      for (long e = 0; e < E; ++e) scores[e] /= total;
    }
    scratch<long> order(E);
    for (long e = 0; e < E; ++e) order[e] = e, biased[e] = scores[e] + L->gate_bias[e];
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](long a, long c) { return biased[a] > biased[c] || (biased[a] == biased[c] && a < c); });
    float sum = 0.0f;
    for (long j = 0; j < k; ++j) sum += scores[order[j]];
    for (long j = 0; j < k; ++j) {
      ids[b * k + j] = order[j];
      weights[b * k + j] = (m->norm_topk ? scores[order[j]] / (sum + 1e-20f) : scores[order[j]]) * m->routed_scale;
    }
  }
  // Each chosen expert once, over the rows that chose it, and the shared expert over every row: one task each, on
  // both threads (each into a part of `outputs` of its own), then added to each row in expert order, the shared one
  // last. The B * k choices sorted by expert (a counting sort: rows in order within an expert) lay out each
  // expert's rows, inputs and outputs side by side, so a step allocates a few buffers, not a few per expert.
  scratch<long> start(E + 1, 0), chosen(B * k), slots(B * k);
  for (long i = 0; i < B * k; ++i) ++start[ids[i] + 1];
  for (long e = 0; e < E; ++e) start[e + 1] += start[e];
  scratch<long> fill(start.begin(), start.end() - 1);
  for (long i = 0; i < B * k; ++i) chosen[fill[ids[i]]++] = i;  // choice i = b * k + j: row b's j-th
  scratch<float> x(B * k * C), outputs(B * k * C + B * C);  // the shared expert's after the routed ones'
  float* shared_out = outputs.data() + B * k * C;
  std::atomic<int> failed{0};
  kernels::parallel_for(E + 1, B > 1, [&](long task) {  // task 0: the shared expert (the largest, claimed first)
    if (task == 0) {
      if (L->shared && expert(L->shared, xn.data(), B, s.r->lora_slots, 0.0f, shared_out)) failed = 1;
      return;
    }
    const long e = task - 1, from = start[e], M = start[e + 1] - from;
    if (M == 0) return;
    for (long r = from; r < from + M; ++r) {
      const long b = chosen[r] / k;
      std::memcpy(x.data() + r * C, xn.data() + b * C, C * sizeof(float));
      slots[r] = s.r->lora_slots ? s.r->lora_slots[b] : -1;
    }
    if (expert(L->experts + 3 * e, x.data() + from * C, M, s.r->lora_slots ? slots.data() + from : nullptr,
               m->swiglu_limit, outputs.data() + from * C))
      failed = 1;
  });
  if (failed) return -1;
  for (long r = 0; r < B * k; ++r)  // expert by expert, rows in order within one
    for (long c = 0; c < C; ++c) routed[chosen[r] / k * C + c] += outputs[r * C + c] * weights[chosen[r]];
  if (L->shared)
    for (long i = 0; i < B * C; ++i) routed[i] += shared_out[i];
  kernels::parallel_for(B, B > 1, [&](long b) {
    hc_site(m, L->hc_ffn_fn, L->hc_ffn_base, L->hc_ffn_scale, s.x.data() + b * n * C, routed.data() + b * C,
            s.pre.data() + b * n);
  });
  return 0;
}

}  // namespace

extern "C" {

// Sites [from_site, to_site) of B rows, one position each: layer l's attention site is site 2l, its FFN site 2l + 1.
// A decode step is every site (0 .. 2L); a prefill chunk the adapter-free ones (0 .. 2E + 1), where its rows may be
// consecutive positions of one conversation (each row's places then point into the same tails, each row's window
// count and store entries those of its own position: the rows of a site run in order where they write what a later
// row reads, so a chunk computes what its tokens one step at a time would); a replay the decoder's (2E + 1 .. 2L),
// starting from the layer-E streams, pre-mix and choices at each row's `stream` / `pre` / `selection` places.
// `h19` (B, C), where given, gets each row's streams into layer E averaged over the streams; `logits` the
// next-token logits of rows logits_from .. B - 1 where the last site is run. Nonzero: a LoRA rank over the limit.
int v41_run(const V41Rows* r, const V41Model* m, const long* tokens, int from_site, int to_site, float* h19,
            float* logits, int logits_from) {
  const int B = r->B, E = m->decoder_start;
  const long C = m->C, n = m->hc, K = m->index_topk, P = m->cand_blocks;
  Step s{m, r, B, scratch<float>(B * n * C), scratch<float>(B * n, 0.0f), scratch<long>(B * K, 0),
         scratch<long>(B * std::max(P, 1L), 0), scratch<char>(B * K, 0), scratch<char>(B * std::max(P, 1L), 0),
         scratch<char>(B, 0), scratch<char>(B, 0), scratch<long>(r->n_entries, r->n_entries + B * MAX_STORES)};
  const int layer_e_attention = 2 * E;
  for (int b = 0; b < B; ++b) {
    if (from_site == 0) {
      for (long j = 0; j < n; ++j) std::memcpy(s.x.data() + (b * n + j) * C, m->embed + tokens[b] * C, C * sizeof(float));
      s.pre[b * n] = 1.0f;  // the first site collapses onto stream 0 (every stream holds the embedding)
    } else if (from_site == layer_e_attention + 1) {  // a replay: what layer E's attention left at this position
      std::memcpy(s.x.data() + b * n * C, r->stream[b], n * C * sizeof(float));
      std::memcpy(s.pre.data() + b * n, r->pre[b], n * sizeof(float));
      if (r->selection_idx[b]) {
        s.has_sel[b] = 1;
        for (long j = 0; j < K; ++j)
          s.sel_idx[b * K + j] = r->selection_idx[b][j], s.sel_valid[b * K + j] = r->selection_valid[b][j];
      }
      if (r->pool_idx[b]) {
        s.has_pool[b] = 1;
        for (long j = 0; j < P; ++j)
          s.pool_idx[b * P + j] = r->pool_idx[b][j], s.pool_valid[b * P + j] = r->pool_valid[b][j];
      }
    } else {
      return -2;  // no other starting site holds what it would need
    }
  }
  for (int site = from_site; site < to_site; ++site) {
    const int layer = site / 2;
    const V41Layer* L = m->layers + layer;
    if (site % 2) {
      if (ffn_site(s, L)) return -1;
      continue;
    }
    if (site == layer_e_attention && h19)
      for (int b = 0; b < B; ++b)
        for (long c = 0; c < C; ++c) {
          float sum = 0.0f;
          for (long j = 0; j < n; ++j) sum += s.x[(b * n + j) * C + c];
          h19[b * C + c] = sum / static_cast<float>(n);
        }
    if (attention_site(s, L, layer)) return -1;
    if (site == layer_e_attention) {  // what a switch replays from
      for (int b = 0; b < B; ++b) {
        std::memcpy(r->stream[b], s.x.data() + b * n * C, n * C * sizeof(float));
        std::memcpy(r->pre[b], s.pre.data() + b * n, n * sizeof(float));
        if (r->selection_idx[b])
          for (long j = 0; j < K; ++j)
            r->selection_idx[b][j] = s.sel_idx[b * K + j], r->selection_valid[b][j] = s.sel_valid[b * K + j];
        if (r->pool_idx[b])
          for (long j = 0; j < P; ++j)
            r->pool_idx[b][j] = s.pool_idx[b * P + j], r->pool_valid[b][j] = s.pool_valid[b * P + j];
      }
    }
  }
  if (!logits || to_site != 2 * m->n_layers || logits_from >= B) return 0;
  const int rows = B - logits_from;
  scratch<float> h(rows * C), xn(rows * C);
  collapse_norm(m, rows, s.x.data() + logits_from * n * C, s.pre.data() + logits_from * n, m->final_norm, h.data(),
                xn.data());
  return linear(m->head, xn.data(), C, rows, nullptr, logits, m->vocab);
}

// One decode step of B rows: the next-token logits (B, vocab) out; every row's state written at its reserved
// places. Returns nonzero where a LoRA rank is above the kernels' limit.
int v41_decode_step(const V41Rows* r, const V41Model* m, const long* tokens, float* logits) {
  return v41_run(r, m, tokens, 0, 2 * m->n_layers, nullptr, logits, 0);
}

enum { TAILS_NEED_ROOM = 1, TAILS_OUT_OF_STEP = 2 };

// A decode step of B rows from their tails: each row's places found in its tails, the step run (v41_decode_step), and
// the tails advanced past what it wrote; the Python of a step then only appends the tokens. `tails[b]`: row b's tails
// in order: the window of each layer, each store's latents, keys and pending inputs (stores by slot), then stream,
// pre and the first `n_choices` of selection idx / valid and pool idx / valid, which a row keeps from position
// `choices_from` on. Returns TAILS_NEED_ROOM, having done nothing, where a tail it would write is full (the caller
// makes room, then calls again), TAILS_OUT_OF_STEP where a store's pending group does not match a row's position
// (torch's path says what is wrong), else v41_decode_step's code.
int v41_step_tails(int B, TailMeta* const* const* tails, long n_stores, long choices_from, long n_choices,
                   const long* positions, const long* lora_slots, const V41Model* m, const long* tokens,
                   float* logits) {
  const long L = m->n_layers, S = MAX_STORES, k = L + 3 * n_stores;  // k: stream's place in a row's tails
  for (int b = 0; b < B; ++b) {
    TailMeta* const* t = tails[b];
    const long written = k + 2 + (positions[b] >= choices_from ? n_choices : 0);
    for (long i = 0; i < written; ++i) {
      const bool pending_of_ratio_one = i >= L && i < k && (i - L) % 3 == 2 && m->store_ratio[(i - L) / 3] == 1;
      if (!pending_of_ratio_one && (t[i]->room < 1 || !t[i]->buf)) return TAILS_NEED_ROOM;
    }
    for (long s = 0; s < n_stores; ++s)
      if (m->store_ratio[s] > 1 && t[L + 3 * s + 2]->n != positions[b] % m->store_ratio[s]) return TAILS_OUT_OF_STEP;
  }
  auto at = [](const TailMeta* t, long i) { return t->buf + (t->start + i) * t->stride; };
  scratch<float*> windows(B * L), latents(B * S), keys(B * S), pending(B * S), stream(B), pre(B);
  scratch<long> window_n(B * L), n_entries(B * S);
  scratch<long*> sel_idx(B), pool_idx(B);
  scratch<bool*> sel_valid(B), pool_valid(B);
  for (int b = 0; b < B; ++b) {
    TailMeta* const* t = tails[b];
    for (long l = 0; l < L; ++l) {
      windows[b * L + l] = reinterpret_cast<float*>(at(t[l], 0));
      window_n[b * L + l] = t[l]->n;
    }
    for (long s = 0; s < n_stores; ++s) {
      const TailMeta *entries = t[L + 3 * s], *index_keys = t[L + 3 * s + 1], *inputs = t[L + 3 * s + 2];
      latents[b * S + s] = reinterpret_cast<float*>(at(entries, 0));
      keys[b * S + s] = reinterpret_cast<float*>(at(index_keys, 0));
      n_entries[b * S + s] = entries->n;
      pending[b * S + s] = m->store_ratio[s] > 1 ? reinterpret_cast<float*>(at(inputs, 0)) : nullptr;
    }
    stream[b] = reinterpret_cast<float*>(at(t[k], t[k]->n));
    pre[b] = reinterpret_cast<float*>(at(t[k + 1], t[k + 1]->n));
    if (positions[b] < choices_from) continue;
    if (n_choices >= 2) {
      sel_idx[b] = reinterpret_cast<long*>(at(t[k + 2], t[k + 2]->n));
      sel_valid[b] = reinterpret_cast<bool*>(at(t[k + 3], t[k + 3]->n));
    }
    if (n_choices >= 4) {
      pool_idx[b] = reinterpret_cast<long*>(at(t[k + 4], t[k + 4]->n));
      pool_valid[b] = reinterpret_cast<bool*>(at(t[k + 5], t[k + 5]->n));
    }
  }
  const V41Rows rows{B, positions, lora_slots, windows.data(), window_n.data(), latents.data(), keys.data(),
                     n_entries.data(), pending.data(), stream.data(), pre.data(), sel_idx.data(), sel_valid.data(),
                     pool_idx.data(), pool_valid.data()};
  if (const int code = v41_decode_step(&rows, m, tokens, logits)) return code;
  auto advance = [](TailMeta* t) {
    ++t->n, --t->room;
    if (t->keep > 0 && t->n > t->keep) t->start += t->n - t->keep, t->n = t->keep;
  };
  for (int b = 0; b < B; ++b) {
    TailMeta* const* t = tails[b];
    for (long l = 0; l < L; ++l) advance(t[l]);
    for (long s = 0; s < n_stores; ++s) {
      TailMeta* inputs = t[L + 3 * s + 2];
      if ((positions[b] + 1) % m->store_ratio[s] == 0) {  // the group is complete: one more entry, none pending
        advance(t[L + 3 * s]), advance(t[L + 3 * s + 1]);
        inputs->start += inputs->n, inputs->n = 0;
      } else {
        advance(inputs);
      }
    }
    const long kept = 2 + (positions[b] >= choices_from ? n_choices : 0);
    for (long i = 0; i < kept; ++i) advance(t[k + i]);
  }
  return 0;
}

// hc_weights (model.py) of `rows` positions' streams x (rows, n, C): pre and post (rows, n), comb (rows, n, n); each
// position's the same bits as in a decode step, whatever the number of rows (prefill and replay chunks take it).
void v41_hc_weights(const float* x, long rows, long n, long C, const float* fn, const float* base,
                    const float* scale, int iters, float eps, float hc_eps, float* pre, float* post, float* comb) {
  kernels::parallel_for(rows, rows > 1, [&](long t) {
    hc_mix(fn, base, scale, x + t * n * C, n, C, iters, eps, hc_eps, pre + t * n, post + t * n, comb + t * n * n);
  });
}

}  // extern "C"
