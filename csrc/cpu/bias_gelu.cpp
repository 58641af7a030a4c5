// CPU GELU(x + bias) (erf form, or the tanh approximation) and its backward.
// Parallel over rows; each row vectorised in fp32 (fp64 for double): the erf form
// with AVX-512 intrinsics where the build has them (one exp for Phi and phi, below),
// else with at::vec::Vectorized (Phi from a branch-free erfc, at::vec's 20-ulp exp);
// the tanh form through a sigmoid.  dbias: per-chunk partial column sums (each thread's in its
// own buffer), added in chunk order in double and rounded once into the bias's dtype.  fp32/fp64
// outputs of tensors larger than the L3 are written with streaming stores (kStreamTraffic*): no
// read-for-ownership of lines that no cache would keep (as in layer_norm.cpp).
#include <cmath>

#include "../common.h"
#include "cpu_util.h"

namespace bertctl::cpu {
namespace {

constexpr double kSqrt1_2 = 0.70710678118654752440;   // 1/sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/sqrt(2*pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
constexpr double kTanhC = 0.044715;

// Phi(v) = erfc(-v / sqrt 2) / 2 through erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2)
// (Numerical Recipes' erfcc: relative error < 1.2e-7), with at::vec's 20-ulp exp: one
// reciprocal estimate + Newton step, ten FMAs and one exp per vector, branch-free and accurate in both tails
// (fp32; fp64 keeps at::vec's erf).
template <typename Vec>
inline Vec normal_cdf_fast(Vec v) {
  using T = typename Vec::value_type;
  const Vec z = v.abs() * Vec(T(kSqrt1_2));
  const Vec t = fast_reciprocal<T>(at::vec::fmadd(Vec(T(0.5)), z, Vec(T(1))));
  static constexpr T c[] = {0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
                            -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223};
  Vec p(c[0]);
  for (int i = 1; i < 10; ++i) p = at::vec::fmadd(p, t, Vec(c[i]));
  const Vec half_tail = Vec(T(0.5)) * t * at::vec::fmadd(z.neg(), z, p).exp_u20();
  return Vec::blendv(Vec(T(1)) - half_tail, half_tail, v < Vec(T(0)));
}

#if defined(CPU_CAPABILITY_AVX512)
// fp32 on AVX-512: one exp serves Phi and phi, so the backward costs about what the forward does.
// With a = |v| (clamped to 20, where every term below is 0 in fp32), z = a / sqrt 2:
//   erfc(z) = t Q(t) exp(-z^2),  t = 1 / (1 + 0.428 z),
// Q a degree-7 polynomial fitted (minimax in relative error, on z in [0, 9.5], where Phi(-a)
// reaches fp32's smallest normal) to erfc(z) exp(z^2) / t: relative error 1e-7 in float64,
// 4e-7 evaluated in fp32.  exp(-a^2/2) = 2^f 2^n, n = round(-a^2 log2(e) / 2), 2^f a degree-5
// minimax polynomial (2e-7) and 2^n exact through vscalefps (underflow to 0 is graceful).
// Then Phi(-a) = tq e with tq = t Q(t) / 2 and e = exp(-a^2/2); phi(a) = e / sqrt(2 pi), and
//   GELU(v)  = max(v, 0) - a Phi(-a)                      (no cancellation in either tail)
//   GELU'(v) = d for v < 0, 1 - d for v >= 0, d = Phi(-a) - a phi(a).
// Relative error (float64 erfc reference, 2M points): < 6e-7 for |v| < 1, < 2e-6 for |v| < 5,
// < 8e-6 down to v = -13, where GELU leaves fp32's normal range: growing as v^2 * 5e-8, the error the
// fp32 rounding of v = x + bias itself brings (GELU's condition number is ~v^2 in the tail).
// About 28 vector ops per 16 values forward, against ~40 for the at::vec form below.
namespace avx512 {

struct Tail {
  __m512 a, tq, e;  // a = min(|v|, 20); Phi(-a) = tq * e
};

inline Tail normal_tail(__m512 v) {
  // min(20, |v|) keeps NaN (the second operand is returned when either is NaN) and clamps inf.
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(20.f), _mm512_abs_ps(v));
  const __m512 den = _mm512_fmadd_ps(a, _mm512_set1_ps(static_cast<float>(0.428 * kSqrt1_2)), _mm512_set1_ps(1.f));
  const __m512 r0 = _mm512_rcp14_ps(den);
  const __m512 t = _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.f)));  // one Newton step
  // Q(t) / 2, Horner.
  static constexpr float q[] = {0.0731505603f, -0.312869936f, 0.395481259f, -0.0946414098f,
                                0.251134068f,  0.202959344f,  0.243408948f, 0.2413771f};
  __m512 p = _mm512_set1_ps(0.5f * q[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.5f * q[i]));
  const __m512 tq = _mm512_mul_ps(t, p);
  // exp(-a^2 / 2) = 2^s
  const __m512 s = _mm512_mul_ps(_mm512_mul_ps(a, a), _mm512_set1_ps(static_cast<float>(-0.5 / 0.69314718055994530942)));
  const __m512 n = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(s, n);  // [-1/2, 1/2]
  static constexpr float c[] = {0.00132764701f, 0.00967554096f, 0.0555071346f, 0.240221202f, 0.693146944f,
                                1.00000012f};
  __m512 e = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 6; ++i) e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(c[i]));
  return {a, tq, _mm512_scalef_ps(e, n)};
}

inline __m512 gelu(__m512 v) {
  const Tail p = normal_tail(v);
  const __m512 relu = _mm512_max_ps(_mm512_setzero_ps(), v);  // NaN kept (second operand)
  return _mm512_fnmadd_ps(_mm512_mul_ps(p.a, p.tq), p.e, relu);
}

inline __m512 gelu_grad(__m512 v) {
  const Tail p = normal_tail(v);
  const __m512 d = _mm512_mul_ps(_mm512_fnmadd_ps(p.a, _mm512_set1_ps(static_cast<float>(kInvSqrt2Pi)), p.tq), p.e);
  const __mmask16 nonneg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_mask_sub_ps(d, nonneg, _mm512_set1_ps(1.f), d);
}

}  // namespace avx512
#endif

template <typename Vec, typename acc_t>
inline Vec gelu(Vec v, bool tanh_form) {
  if (tanh_form) {
    // 0.5 v (1 + tanh(u)) = v * sigmoid(2u): no cancellation in 1 + tanh.
    Vec u = Vec(acc_t(kSqrt2OverPi)) * (v + Vec(acc_t(kTanhC)) * v * v * v);
    return v / (Vec(acc_t(1)) + fast_exp<acc_t>(Vec(acc_t(-2)) * u));
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return Vec(avx512::gelu(v));
#endif
  if constexpr (std::is_same_v<acc_t, float>) return v * normal_cdf_fast(v);
  return Vec(acc_t(0.5)) * v * (Vec(acc_t(1)) + (v * Vec(acc_t(kSqrt1_2))).erf());
}

// d GELU(v) / dv
template <typename Vec, typename acc_t>
inline Vec gelu_grad(Vec v, bool tanh_form) {
  if (tanh_form) {
    Vec v2 = v * v;
    Vec u = Vec(acc_t(kSqrt2OverPi)) * (v + Vec(acc_t(kTanhC)) * v2 * v);
    Vec s = Vec(acc_t(1)) / (Vec(acc_t(1)) + fast_exp<acc_t>(Vec(acc_t(-2)) * u));  // (1 + tanh u) / 2
    Vec du = Vec(acc_t(kSqrt2OverPi)) * (Vec(acc_t(1)) + Vec(acc_t(3 * kTanhC)) * v2);
    return s + Vec(acc_t(2)) * v * s * (Vec(acc_t(1)) - s) * du;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return Vec(avx512::gelu_grad(v));
#endif
  Vec pdf = Vec(acc_t(kInvSqrt2Pi)) * fast_exp<acc_t>(Vec(acc_t(-0.5)) * v * v);
  if constexpr (std::is_same_v<acc_t, float>) return normal_cdf_fast(v) + v * pdf;
  Vec cdf = Vec(acc_t(0.5)) * (Vec(acc_t(1)) + (v * Vec(acc_t(kSqrt1_2))).erf());
  return cdf + v * pdf;
}

// Outputs (y, dx) are written with streaming stores once the op moves more bytes than the L3
// holds (see the same thresholds in layer_norm.cpp): a store that misses the cache first reads
// its line from memory, a third more traffic for an op that reads x and writes y.  Below that,
// ordinary stores leave the output in cache for the next op.  16-bit tensors go through
// converted rows and ordinary stores.
constexpr int64_t kStreamTrafficForward = int64_t(32) << 20;
constexpr int64_t kStreamTrafficBackward = int64_t(16) << 20;

template <bool Large, typename scalar_t, typename acc_t>
void bias_gelu_chunk(const scalar_t* x, const acc_t* b_in, bool tanh_form, scalar_t* y, int64_t cols,
                     int64_t begin, int64_t end) {
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t ld = (cols + 15) / 16 * 16;
  RowBuffer<acc_t> bufs(3 * ld);  // this thread's copy of the bias, and 16-bit conversion rows
  acc_t *b = bufs.get(0), *in_buf = bufs.get(ld), *out_buf = bufs.get(2 * ld);
  std::copy(b_in, b_in + cols, b);
  for (int64_t r = begin; r < end; ++r) {
    const acc_t* xr = load_row<acc_t>(x + r * cols, in_buf, cols);
    acc_t* o = out_row<acc_t>(y + r * cols, out_buf);
    for_each_vector<Large>(o, cols, [&](int64_t j, auto load, auto store) {
      store(gelu<Vec, acc_t>(load(xr, j) + load(b, j), tanh_form), o, j);
    });
    store_row<acc_t>(o, y + r * cols, cols);
  }
  if constexpr (Large) stream_fence();
}

template <typename scalar_t>
void bias_gelu_rows(const at::Tensor& x_, const at::Tensor& b_, bool tanh_form, at::Tensor& y_) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto b = param_acc<acc_t>(b_);
  const scalar_t* x = x_.data_ptr<scalar_t>();
  scalar_t* y = y_.data_ptr<scalar_t>();
  const bool large = std::is_same_v<acc_t, scalar_t> && 2 * static_cast<int64_t>(y_.nbytes()) >= kStreamTrafficForward;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    if (large)
      bias_gelu_chunk<true>(x, b.data(), tanh_form, y, cols, begin, end);
    else
      bias_gelu_chunk<false>(x, b.data(), tanh_form, y, cols, begin, end);
  });
}

// One thread's rows [begin, end): their dx, and their column sums of dx into db (this chunk's
// partial).  The partial is updated in the thread's own line-aligned buffer (a shared one
// bounced lines between the cores at the boundary of two threads' partials).
template <bool Large, typename scalar_t, typename acc_t>
void bias_gelu_backward_chunk(const scalar_t* dy, const scalar_t* x, const acc_t* b_in, bool tanh_form,
                              scalar_t* dx, acc_t* db, int64_t cols, int64_t begin, int64_t end) {
  using Vec = at::vec::Vectorized<acc_t>;
  // Rows of whole lines plus one vector: dbp is read and written a full vector at a time, also at
  // a row's partial tail vector, whose lanes past the row end then add d = 0 to the padding.
  const int64_t ld = (cols + 15) / 16 * 16 + Vec::size();
  RowBuffer<acc_t> bufs(5 * ld);
  acc_t *b = bufs.get(0), *dbp = bufs.get(ld), *in_buf = bufs.get(2 * ld), *g_buf = bufs.get(3 * ld);
  acc_t* out_buf = bufs.get(4 * ld);
  std::copy(b_in, b_in + cols, b);
  std::fill(dbp, dbp + cols, acc_t(0));
  for (int64_t r = begin; r < end; ++r) {
    const acc_t* xr = load_row<acc_t>(x + r * cols, in_buf, cols);
    const acc_t* g = load_row<acc_t>(dy + r * cols, g_buf, cols);
    acc_t* o = out_row<acc_t>(dx + r * cols, out_buf);
    for_each_vector<Large>(o, cols, [&](int64_t j, auto load, auto store) {
      // Zero-padded partial loads give d = 0 past the row's end, which adds nothing to dbp.
      const Vec d = load(g, j) * gelu_grad<Vec, acc_t>(load(xr, j) + load(b, j), tanh_form);
      store(d, o, j);
      (Vec::loadu(dbp + j) + d).store(dbp + j);
    });
    store_row<acc_t>(o, dx + r * cols, cols);
  }
  if constexpr (Large) stream_fence();
  std::copy(dbp, dbp + cols, db);
}

template <typename scalar_t>
void bias_gelu_backward_rows(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& b_, bool tanh_form,
                             at::Tensor& dx_, at::Tensor& db) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto b = param_acc<acc_t>(b_);
  const scalar_t* dy = dy_.data_ptr<scalar_t>();
  const scalar_t* x = x_.data_ptr<scalar_t>();
  scalar_t* dx = dx_.data_ptr<scalar_t>();
  const int64_t chunks = num_chunks(rows, cols);
  const bool large = std::is_same_v<acc_t, scalar_t> && 3 * static_cast<int64_t>(dx_.nbytes()) >= kStreamTrafficBackward;
  std::vector<acc_t> db_part(chunks * cols);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t r0 = c * rows / chunks, r1 = (c + 1) * rows / chunks;
      acc_t* dbp = db_part.data() + c * cols;
      if (large)
        bias_gelu_backward_chunk<true>(dy, x, b.data(), tanh_form, dx, dbp, cols, r0, r1);
      else
        bias_gelu_backward_chunk<false>(dy, x, b.data(), tanh_form, dx, dbp, cols, r0, r1);
    }
  });
  sum_partials(db_part.data(), chunks, cols, db);
}

at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias, std::string approximate) {
  const char* op = "bertctl::bias_gelu";
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least one dimension");
  check_param(x, bias, op, "bias");
  const bool tanh_form = gelu_tanh(approximate);
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_bias_gelu_cpu",
                                  [&] { bias_gelu_rows<scalar_t>(xc, bias, tanh_form, y); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const at::Tensor& bias, std::string approximate) {
  const char* op = "bertctl::bias_gelu_backward";
  check_same(x, grad_y, op, "grad_y");
  check_param(x, bias, op, "bias");
  const bool tanh_form = gelu_tanh(approximate);
  auto xc = x.contiguous(), dyc = grad_y.contiguous();
  auto dx = at::empty_like(xc);
  auto db = at::empty({last_dim(x)}, bias.options());  // in the bias's dtype, as autograd wants it
  if (x.numel() == 0) {
    db.zero_();
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_bias_gelu_backward_cpu", [&] {
      bias_gelu_backward_rows<scalar_t>(dyc, xc, bias, tanh_form, dx, db);
    });
  }
  return {dx, db};
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) {
  m.impl("bias_gelu", &bertctl::cpu::bias_gelu_cpu);
  m.impl("bias_gelu_backward", &bertctl::cpu::bias_gelu_backward_cpu);
}
