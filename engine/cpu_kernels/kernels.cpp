// Strata's CPU kernels: the decode step's sparse MoE and paged attention, for small batches on one core.
//
// Built on first use by engine/cpu_kernels/__init__.py (torch.utils.cpp_extension, -O3 -march=native) and registered
// as torch ops (strata_cpu::*), which the compiled decode step calls as opaque kernels. Products are written in the
// "dot" form over weights stored [N, K] (every output's row contiguous over K, as the model keeps them), so no
// packed copy of the weights is needed: a tile of MR rows x NR outputs keeps MR*NR vector accumulators over K
// and sums their lanes once at the end. GCC vector extensions give AVX2 (or AVX-512, SSE) code from one source.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int VL = 8;
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline vf load(const at::BFloat16* p) {
  vh h; std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof(v)); return v;
}
typedef int8_t vb __attribute__((vector_size(VL)));
inline vf load(const int8_t* p) {
#if defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vb b; std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vf);
#endif
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VL; ++i) s += v[i];
  return s;
}
// e^x lane by lane, as Cephes' expf: x = n ln2 + r (|r| <= ln2 / 2), e^r by a degree-6 polynomial, times 2^n;
// within 2 ulp of std::exp over [-87.3, 88.0]. Below that 0 (e^-inf = 0, as for masked scores), above 88.72 inf;
// in between e^88.0 (only softmax's x <= 0 and SiLU's e^-x, where it does not matter, reach this code).
typedef int32_t vi __attribute__((vector_size(VL * 4)));
inline vf vexp(vf x) {
  const vi under = x < -87.3365447504f, over = x > 88.7228390520683f, nan = x != x;
  x = x < -87.3365447504f ? vf{} - 87.3365447504f : x;
  x = x > 88.02f ? vf{} + 88.02f : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  fl = fl > fx ? fl - 1.f : fl;                                                        // floor
  vf r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  vf y = ((((((vf{} + 1.9875691500e-4f) * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
           + 1.6666665459e-1f) * r + 5.0000001201e-1f) * (r * r) + r + 1.f;
  vi bits = (__builtin_convertvector(fl, vi) + 127) << 23;
  vf pow2; std::memcpy(&pow2, &bits, sizeof(pow2));
  y = y * pow2;
  y = under ? vf{} : y;
  y = over ? vf{} + INFINITY : y;
  return nan ? x : y;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// The lane sums of up to 4 vectors, written to out[0 .. n).
inline void hsum4(const vf* v, int n, float* out) {
#if defined(__AVX__)
  __m256 a = (__m256)v[0], b = n > 1 ? (__m256)v[1] : _mm256_setzero_ps();
  __m256 c = n > 2 ? (__m256)v[2] : _mm256_setzero_ps(), d = n > 3 ? (__m256)v[3] : _mm256_setzero_ps();
  __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  float s[4];
  _mm_storeu_ps(s, r);
  for (int i = 0; i < n; ++i) out[i] = s[i];
#else
  for (int i = 0; i < n; ++i) out[i] = hsum(v[i]);
#endif
}

// C[m, n] = sum_k A[m, k] * W[n, k] for m < MR, n < NR; A fp32 rows of stride lda, W rows of stride ldw.
template <int MR, int NR, typename W>
inline void tile(const float* A, int64_t lda, const W* Wp, int64_t ldw, int64_t K, float* C, int64_t ldc) {
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = vf{};
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vf w[NR], a[MR];
    for (int n = 0; n < NR; ++n) w[n] = load(Wp + n * ldw + k);
    for (int m = 0; m < MR; ++m) a[m] = load(A + m * lda + k);
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] += a[m] * w[n];
  }
  for (int m = 0; m < MR; ++m) hsum4(acc[m], NR, C + m * ldc);
  if (k < K)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n)
        for (int64_t r = k; r < K; ++r) C[m * ldc + n] += A[m * lda + r] * to_float(Wp[n * ldw + r]);
}

template <int NR, typename W>
inline void outputs_times(const float* A, int64_t lda, int64_t M, const W* Wp, int64_t ldw, int64_t K, float* C,
                          int64_t ldc) {
  // every row of A against these NR weight rows: the weights are read once, A stays in L1
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<3, NR>(A + m * lda, lda, Wp, ldw, K, C + m * ldc, ldc);
  switch (M - m) {
    case 2: tile<2, NR>(A + m * lda, lda, Wp, ldw, K, C + m * ldc, ldc); break;
    case 1: tile<1, NR>(A + m * lda, lda, Wp, ldw, K, C + m * ldc, ldc); break;
    default: break;
  }
}

// C [M, N] = A [M, K] (fp32, stride lda) x W [N, K]^T, output columns [n0, n1).
template <typename W>
void gemm_nt(const float* A, int64_t lda, int64_t M, const W* Wp, int64_t ldw, int64_t n0, int64_t n1, int64_t K,
             float* C, int64_t ldc) {
  constexpr int NR = 3;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) outputs_times<NR>(A, lda, M, Wp + n * ldw, ldw, K, C + n, ldc);
  for (; n < n1; ++n) outputs_times<1>(A, lda, M, Wp + n * ldw, ldw, K, C + n, ldc);
}

template <typename W>
void gemm_nt_parallel(const float* A, int64_t lda, int64_t M, const W* Wp, int64_t ldw, int64_t N, int64_t K,
                      float* C, int64_t ldc) {
  constexpr int64_t chunk = 48;   // output columns per task (a multiple of the tile's 3)
  at::parallel_for(0, (N + chunk - 1) / chunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      gemm_nt(A, lda, M, Wp, ldw, i * chunk, std::min(N, (i + 1) * chunk), K, C, ldc);
  });
}

// out[j] = silu(gate[j]) * up[j]
inline void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + VL <= n; j += VL) {
    vf g = load(gate + j);
    vf r = g / (1.f + vexp(-g)) * load(up + j);
    std::memcpy(out + j, &r, sizeof(r));
  }
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

template <typename T>
void rows_to_float(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// out [T, H] = sum over each token's k experts of weight * w2[e] (silu(w13[e][:I] x) * w13[e][I:] x).
template <typename X, typename W>
void moe_impl(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids,
              const at::Tensor& weights, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2, k = ids.size(1);
  const int64_t P = T * k;
  const X* xp = x.data_ptr<X>();
  const W* w13p = w13.data_ptr<W>();
  const W* w2p = w2.data_ptr<W>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<float> wts(P);
  rows_to_float(weights.data_ptr<X>(), P, wts.data());
  // pairs sorted by expert (counting sort, stable)
  std::vector<int64_t> count(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "strata_cpu::moe: expert id ", idp[p], " out of range [0, ", E, ")");
    ++count[idp[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[next[idp[p]]++] = p;
  }
  std::vector<float> xs(P * H), gu(P * I2), act(P * I), ys(P * H);
  for (int64_t i = 0; i < P; ++i) rows_to_float(xp + (order[i] / k) * H, H, xs.data() + i * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = count[e], n = count[e + 1] - r0;
    if (n == 0) continue;
    gemm_nt_parallel(xs.data() + r0 * H, H, n, w13p + e * I2 * H, H, I2, H, gu.data() + r0 * I2, I2);
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* g = gu.data() + r * I2;
      float* a = act.data() + r * I;
      silu_mul(g, g + I, I, a);
    }
    gemm_nt_parallel(act.data() + r0 * I, I, n, w2p + e * H * I, I, H, I, ys.data() + r0 * H, H);
  }
  // each token's pairs summed in rank order (as the reference paths do), whatever the expert order
  std::vector<int64_t> where(P);
  for (int64_t i = 0; i < P; ++i) where[order[i]] = i;
  X* op = out.data_ptr<X>();
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const float w = wts[t * k + j];
      const float* y = ys.data() + where[t * k + j] * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += w * y[h];
    }
    for (int64_t h = 0; h < H; ++h) op[t * H + h] = static_cast<X>(acc[h]);
  }
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids,
               const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && ids.dim() == 2, "strata_cpu::moe: bad ranks");
  TORCH_CHECK(w13.size(1) == 2 * w2.size(2) && w13.size(2) == x.size(1) && w2.size(1) == x.size(1),
              "strata_cpu::moe: w13 [E, 2I, H] and w2 [E, H, I] must match x [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.sizes() == ids.sizes(), "strata_cpu::moe: bad ids/weights");
  TORCH_CHECK(x.scalar_type() == weights.scalar_type(), "strata_cpu::moe: weights must be in x's dtype");
  auto xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous(), idc = ids.contiguous(),
       wc = weights.contiguous();
  auto out = at::empty_like(xc);
  const auto xt = x.scalar_type(), wt = w13.scalar_type();
  TORCH_CHECK(w2.scalar_type() == wt, "strata_cpu::moe: w13 and w2 must share a dtype");
  if (xt == at::kFloat && wt == at::kFloat) moe_impl<float, float>(xc, w13c, w2c, idc, wc, out);
  else if (xt == at::kBFloat16 && wt == at::kBFloat16)
    moe_impl<at::BFloat16, at::BFloat16>(xc, w13c, w2c, idc, wc, out);
  else TORCH_CHECK(false, "strata_cpu::moe: float32 or bfloat16 only, got ", xt, " / ", wt);
  return out;
}

// y [M, N] = x [M, K] x w [N, K]^T (+ bias), fp32 accumulation, w stored by rows; y in x's dtype, rounded once.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "strata_cpu::linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "strata_cpu::linear: w must be stored by rows (contiguous [N, K])");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (w.scalar_type() == at::kFloat)
    gemm_nt_parallel(xf.data_ptr<float>(), K, M, w.data_ptr<float>(), K, N, K, y.data_ptr<float>(), N);
  else if (w.scalar_type() == at::kBFloat16)
    gemm_nt_parallel(xf.data_ptr<float>(), K, M, w.data_ptr<at::BFloat16>(), K, N, K, y.data_ptr<float>(), N);
  else TORCH_CHECK(false, "strata_cpu::linear: float32 or bfloat16 weights only");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "strata_cpu::linear: bias [N]");
    y.add_(bias->to(at::kFloat));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Asks for `count` cache rows (K or V of one head, D elements) two groups of 4 ahead: the rows of a sequence's
// blocks are scattered over the cache and come from memory. Measured in the compiled step (fp32, batch 32, context
// 96, 1 thread, 16 interleaved rounds in one process): 1.09x the step without it. The same ahead of the MoE
// kernel's weight tiles measured 1.00x (the hardware prefetcher follows their rows), so it has none.
template <typename C>
inline void prefetch_keys(const C* const* rows, int64_t count, int64_t D) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(C))) __builtin_prefetch(rows[j] + d);
}

// y [M, N] = (x [M, K] x q [N, K]^T) * scale [N] (+ bias): int8 weights, per output channel (W8A16's layout),
// fp32 accumulation; y in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && q.scalar_type() == at::kChar,
              "strata_cpu::int8_linear: x [M, K], q [N, K] int8");
  TORCH_CHECK(q.is_contiguous() && scale.numel() == q.size(0), "strata_cpu::int8_linear: q by rows, scale [N]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_nt_parallel(xf.data_ptr<float>(), K, M, q.data_ptr<int8_t>(), K, N, K, y.data_ptr<float>(), N);
  y.mul_(scale.to(at::kFloat).reshape({1, N}));
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// q . k for one query (NV vectors of D, pre-scaled, fp32) against 4 keys; the sums written to out[0..4).
template <int NV, typename C>
inline void dots4(const float* q, const C* const* keys, float* out) {
  vf acc[4] = {vf{}, vf{}, vf{}, vf{}};
  for (int i = 0; i < NV; ++i) {
    vf x = load(q + i * VL);
    for (int j = 0; j < 4; ++j) acc[j] += x * load(keys[j] + i * VL);
  }
  hsum4(acc, 4, out);
}

// One decode token per sequence over its paged K/V: out [B, Hq, D] = softmax(q k^T * scale) v, keys 0 .. len-1
// of sequence b (or the last `window` of them), key s in block tables[b, s / bs] at slot s % bs. The cache is
// block-major [nb, L, 2, bs, Hkv, D] (K then V of each layer); a KV head's G = Hq / Hkv query heads share its keys.
// NV = D / 8 vectors per row, a compile-time constant so that a row's accumulators stay in registers.
template <int NV, typename Q, typename C>
void attention_impl(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& tables,
                    const at::Tensor& lengths, double scale, int64_t window, at::Tensor& out) {
  constexpr int64_t D = NV * VL;
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t L = cache.size(1), bs = cache.size(3), Hkv = cache.size(4), W = tables.size(1), G = Hq / Hkv;
  const int64_t nb = cache.size(0);
  const C* cp = cache.data_ptr<C>();
  const Q* qp = q.data_ptr<Q>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  Q* op = out.data_ptr<Q>();
  const int64_t row = Hkv * D, half = bs * row, block = 2 * L * half;   // strides of a slot, a K (or V), a block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), scores;
    std::vector<const C*> keys, values;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, len = lp[b];
      TORCH_CHECK(len >= 1 && len <= W * bs, "strata_cpu::decode_attention: length ", len, " outside the table");
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      const int64_t padded = (n + 3) / 4 * 4;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * float(scale);
      keys.resize(padded);
      values.resize(n);
      for (int64_t s = start; s < len; ++s) {
        const int64_t blk = tp[b * W + s / bs];
        TORCH_CHECK(blk >= 0 && blk < nb, "strata_cpu::decode_attention: block id ", blk, " out of range");
        keys[s - start] = cp + blk * block + layer * 2 * half + (s % bs) * row + h * D;
        values[s - start] = keys[s - start] + half;
      }
      for (int64_t i = n; i < padded; ++i) keys[i] = keys[0];      // padding: computed, never read
      scores.resize(G * padded);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * padded;
        for (int64_t i = 0; i < padded; i += 4) {
          if (g == 0 && i + 8 < n) prefetch_keys(keys.data() + i + 8, std::min<int64_t>(4, n - i - 8), D);
          dots4<NV>(qs.data() + g * D, keys.data() + i, sc + i);
        }
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sc[i]);
        vf total = vf{};
        float tail = 0.f;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
          vf e = vexp(load(sc + i) - mx);
          std::memcpy(sc + i, &e, sizeof(e));
          total += e;
        }
        for (; i < n; ++i) tail += (sc[i] = std::exp(sc[i] - mx));
        const float inv = 1.f / (hsum(total) + tail);
        vf acc[NV];
        for (int v = 0; v < NV; ++v) acc[v] = vf{};
        for (int64_t s = 0; s < n; ++s) {
          if (s % 4 == 0 && s + 8 < n) prefetch_keys(values.data() + s + 8, std::min<int64_t>(4, n - s - 8), D);
          const float p = sc[s];
          for (int v = 0; v < NV; ++v) acc[v] += p * load(values[s] + v * VL);
        }
        Q* o = op + (b * Hq + h * G + g) * D;
        for (int v = 0; v < NV; ++v)
          for (int j = 0; j < VL; ++j) o[v * VL + j] = static_cast<Q>(acc[v][j] * inv);
      }
    }
  });
}

template <typename Q, typename C>
void attention_dispatch(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& tables,
                        const at::Tensor& lengths, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: attention_impl<8, Q, C>(q, cache, layer, tables, lengths, scale, window, out); break;
    case 128: attention_impl<16, Q, C>(q, cache, layer, tables, lengths, scale, window, out); break;
    case 256: attention_impl<32, Q, C>(q, cache, layer, tables, lengths, scale, window, out); break;
    case 32: attention_impl<4, Q, C>(q, cache, layer, tables, lengths, scale, window, out); break;
    case 16: attention_impl<2, Q, C>(q, cache, layer, tables, lengths, scale, window, out); break;
    default: TORCH_CHECK(false, "strata_cpu::decode_attention: head_dim 16, 32, 64, 128 or 256 only, got ", q.size(2));
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& tables,
                            const at::Tensor& lengths, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 6 && tables.dim() == 2 && lengths.dim() == 1,
              "strata_cpu::decode_attention: q [B, Hq, D], cache [nb, L, 2, bs, Hkv, D], tables [B, W], lengths [B]");
  TORCH_CHECK(cache.is_contiguous(), "strata_cpu::decode_attention: the cache must be contiguous");
  TORCH_CHECK(cache.size(5) == q.size(2) && q.size(1) % cache.size(4) == 0 && layer >= 0 && layer < cache.size(1),
              "strata_cpu::decode_attention: q and cache disagree");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "strata_cpu::decode_attention: tables and lengths must be int64");
  auto qc = q.contiguous(), tc = tables.contiguous(), lc = lengths.contiguous();
  auto out = at::empty_like(qc);
  const auto qt = q.scalar_type(), ct = cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat)
    attention_dispatch<float, float>(qc, cache, layer, tc, lc, scale, window, out);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16)
    attention_dispatch<at::BFloat16, at::BFloat16>(qc, cache, layer, tc, lc, scale, window, out);
  else TORCH_CHECK(false, "strata_cpu::decode_attention: float32 or bfloat16 q and cache only");
  return out;
}

}  // namespace

TORCH_LIBRARY(strata_cpu, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor cache, int layer, Tensor tables, Tensor lengths, float scale, "
        "int window) -> Tensor");
  m.def("moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) {
  m.impl("moe", &moe);
  m.impl("linear", &linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("decode_attention", &decode_attention);
}
