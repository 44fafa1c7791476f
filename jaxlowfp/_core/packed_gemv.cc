// jaxlowfp's native CPU GEMV of a packed NVFP4 weight (issue 44, "a decode path"), an XLA FFI handler.
//
//   y[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = (e2m1(q[n, k]) * e4m3(s[n / R, k / 16])) * g
//
// x: float32 [M, K]; codes: uint8 [N, K/2], two E2M1 codes a byte, element 2j in the low nibble (jaxlowfp.QArray);
// scales: float8_e4m3fn [N / R, K / 16] (R = 1: 1x16 blocks, R = 16: 16x16 tiles); g: the float32 decode scale
// S_dec (a scalar). Output float32 [M, N]. Each decoded weight is exactly the library's dequantize
// (jaxlowfp._core.nvfp4_blocks.dequantize_blocks: q * s is exact in float32, then one rounding by g); only the
// float32 accumulation order differs from XLA's dot. The weight is read packed (4.5 bits a parameter) and decoded
// in registers, never written.
//
// Portable: no -march. An AVX2 + FMA path (function-level target attribute) is taken when the CPU has both
// (__builtin_cpu_supports), else a plain C++ path; attribute isa = 1 forces the plain path (tests).
// Work is split over N on XLA's intra-op thread pool when the weight is large enough.
//
// A second handler, jaxlowfp_lut8_gemv, takes 8-bit codes with one tensor scale (FP8 E4M3, HiF8):
// y[m, n] = sum_k x[m, k] * (lut[q[n, k]] * scale), lut the format's 256 values decoded by the library.
#include <type_traits>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <algorithm>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JAXLOWFP_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float mag;
      if (e == 0) {
        mag = std::ldexp(static_cast<float>(m), -9);  // subnormal: m / 8 * 2^-6
      } else if (e == 15 && m == 7) {
        mag = NAN;  // float8_e4m3fn has no infinity; 0x7f / 0xff are NaN
      } else {
        mag = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      }
      v[b] = sign ? -mag : mag;
    }
  }
};
const E4M3Table kE4M3;

struct Problem {
  const float* x;
  const uint8_t* codes;
  const uint8_t* scales;
  float g;
  int64_t m, k, n, tile_rows;
  float* y;
};

// Weight row n decoded into w[0, K): (q * s) * g, q * s exact in float32, one rounding by g.
void decode_row(const Problem& p, int64_t n, float* w) {
  const int64_t kb = p.k / 16;
  const uint8_t* crow = p.codes + n * (p.k / 2);
  const uint8_t* srow = p.scales + (n / p.tile_rows) * kb;
  for (int64_t b = 0; b < kb; ++b) {
    const float s = kE4M3.v[srow[b]];
    for (int j = 0; j < 8; ++j) {
      const uint8_t c = crow[b * 8 + j];
      w[b * 16 + 2 * j] = (kE2M1[c & 15] * s) * p.g;
      w[b * 16 + 2 * j + 1] = (kE2M1[c >> 4] * s) * p.g;
    }
  }
}

// Rows [n0, n1) of the output, every m, plain C++: each weight row decoded once, whatever M.
void gemv_generic(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t kb = p.k / 16;
  std::vector<float> w(static_cast<size_t>(p.k));
  for (int64_t n = n0; n < n1; ++n) {
    decode_row(p, n, w.data());
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.x + r * p.k;
      float acc = 0.f;
      for (int64_t b = 0; b < kb; ++b) {
        float a = 0.f;
        for (int i = 0; i < 16; ++i) a += xr[b * 16 + i] * w[b * 16 + i];
        acc += a;
      }
      p.y[r * p.n + n] = acc;
    }
  }
}

#ifdef JAXLOWFP_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// MR rows of x (MR <= 4) against weight rows [n0, n1): two accumulators per x row (the two halves of a block).
template <int MR>
__attribute__((target("avx2,fma"))) void gemv_avx2_rows(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t kb = p.k / 16, half = p.k / 2;
  const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 gv = _mm256_set1_ps(p.g);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const float* xs[MR];
  for (int r = 0; r < MR; ++r) xs[r] = p.x + (m0 + r) * p.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* crow = p.codes + n * half;
    const uint8_t* srow = p.scales + (n / p.tile_rows) * kb;
    __m256 acc0[MR], acc1[MR];
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; ++b) {
      // the block's 8 magnitudes, exactly (|q| * s) * g: q * s is exact in float32, one rounding by g
      const __m256 t = _mm256_mul_ps(_mm256_mul_ps(lut, _mm256_set1_ps(kE4M3.v[srow[b]])), gv);
      uint64_t raw;
      std::memcpy(&raw, crow + b * 8, 8);
      const __m128i v = _mm_cvtsi64_si128(static_cast<long long>(raw));
      const __m128i lo = _mm_and_si128(v, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
      const __m128i e = _mm_unpacklo_epi8(lo, hi);  // the 16 codes in element order
      const __m256i c0 = _mm256_cvtepu8_epi32(e);
      const __m256i c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(e, 8));
      // magnitude from the low 3 bits (the permute's index), sign from bit 3 (moved to bit 31)
      const __m256 w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, c0),
                                      _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c0, 28), sign)));
      const __m256 w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, c1),
                                      _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c1, 28), sign)));
      for (int r = 0; r < MR; ++r) {
        acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[r] + b * 16), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[r] + b * 16 + 8), acc1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) p.y[(m0 + r) * p.n + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
  }
}

// Calls rows(R, m0) over an M-row problem 4 rows at a time (R, the rows of this step, 1..4, a compile-time int):
// the NVFP4 kernel's two accumulators a row fill the 16 vector registers at 4 rows.
template <typename F>
void by_four_rows(int64_t m, F&& rows) {
  for (int64_t m0 = 0; m0 < m; m0 += 4) {
    switch (m - m0 < 4 ? m - m0 : 4) {
      case 1: rows(std::integral_constant<int, 1>{}, m0); break;
      case 2: rows(std::integral_constant<int, 2>{}, m0); break;
      case 3: rows(std::integral_constant<int, 3>{}, m0); break;
      default: rows(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

// MR rows of x against weight row n, already decoded in w: the FMAs of gemv_avx2_rows in its order, so a row's
// result does not depend on M.
template <int MR>
__attribute__((target("avx2,fma"))) void decoded_rows(const Problem& p, const float* w, int64_t m0, int64_t n) {
  const int64_t kb = p.k / 16;
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    const __m256 w0 = _mm256_loadu_ps(w + b * 16), w1 = _mm256_loadu_ps(w + b * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const float* xr = p.x + (m0 + r) * p.k + b * 16;
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) p.y[(m0 + r) * p.n + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// decode_row with gemv_avx2_rows's in-register decode (the same values), stored.
__attribute__((target("avx2,fma"))) void decode_row_avx2(const Problem& p, int64_t n, float* w) {
  const int64_t kb = p.k / 16;
  const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 gv = _mm256_set1_ps(p.g);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const uint8_t* crow = p.codes + n * (p.k / 2);
  const uint8_t* srow = p.scales + (n / p.tile_rows) * kb;
  for (int64_t b = 0; b < kb; ++b) {
    const __m256 t = _mm256_mul_ps(_mm256_mul_ps(lut, _mm256_set1_ps(kE4M3.v[srow[b]])), gv);
    uint64_t raw;
    std::memcpy(&raw, crow + b * 8, 8);
    const __m128i v = _mm_cvtsi64_si128(static_cast<long long>(raw));
    const __m128i e = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m256i c0 = _mm256_cvtepu8_epi32(e);
    const __m256i c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(e, 8));
    _mm256_storeu_ps(w + b * 16, _mm256_xor_ps(_mm256_permutevar8x32_ps(t, c0),
                                               _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c0, 28), sign))));
    _mm256_storeu_ps(w + b * 16 + 8, _mm256_xor_ps(_mm256_permutevar8x32_ps(t, c1),
                                                   _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c1, 28), sign))));
  }
}

void gemv_avx2(const Problem& p, int64_t n0, int64_t n1) {
  if (p.m <= 4) {  // one step: decode in registers
    by_four_rows(p.m, [&](auto r, int64_t m0) { gemv_avx2_rows<decltype(r)::value>(p, m0, n0, n1); });
    return;
  }
  // M > 4: each weight row decoded once (the same values), then every 4-row step reads it from L1
  std::vector<float> w(static_cast<size_t>(p.k));
  for (int64_t n = n0; n < n1; ++n) {
    decode_row_avx2(p, n, w.data());
    by_four_rows(p.m, [&](auto r, int64_t m0) { decoded_rows<decltype(r)::value>(p, w.data(), m0, n); });
  }
}

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

using Kernel = void (*)(const Problem&, int64_t, int64_t);

struct Shared {
  Problem p;
  Kernel kern;
  int64_t per = 0, total = 0;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;  // guarded by mu
  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < total;) {
      const int64_t a = c * per, b = std::min(p.n, a + per);
      kern(p, a, b);
      std::lock_guard<std::mutex> lock(mu);
      if (++done == total) cv.notify_all();
    }
  }
};

Kernel pick(int64_t isa) {
#ifdef JAXLOWFP_X86
  if (isa == 0 && has_avx2()) return gemv_avx2;
#endif
  (void)isa;
  return gemv_generic;
}

ffi::Error Nvfp4GemvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                         ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> y,
                         int64_t tile_rows, int64_t isa, int64_t threads) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || yd.size() != 2 || g.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxlowfp_nvfp4_gemv: x, codes, scales, y must be 2-D and g one element");
  }
  if (scales.element_type() != ffi::F8E4M3FN) {
    return ffi::Error::InvalidArgument("jaxlowfp_nvfp4_gemv: scales must be float8_e4m3fn");
  }
  const int64_t m = xd[0], k = xd[1], n = cd[0];
  if (tile_rows != 1 && tile_rows != 16) {
    return ffi::Error::InvalidArgument("jaxlowfp_nvfp4_gemv: tile_rows must be 1 or 16");
  }
  if (k % 16 != 0 || cd[1] * 2 != k || sd[1] * 16 != k || sd[0] * tile_rows != n || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument(
        "jaxlowfp_nvfp4_gemv: shapes disagree (x [M, K], codes [N, K/2], scales [N/R, K/16], y [M, N], K % 16 == 0)");
  }
  Problem p{x.typed_data(), codes.typed_data(), reinterpret_cast<const uint8_t*>(scales.untyped_data()),
            g.typed_data()[0], m, k, n, tile_rows, y->typed_data()};
  if (m == 0 || n == 0) return ffi::Error::Success();
  Kernel kern = pick(isa);
  // parallel over N in chunks of 16 rows (whole tiles), when there is enough work to pay for the scheduling
  int64_t nt = threads > 0 ? threads : pool.num_threads();
  const int64_t work = m * n * k;
  if (nt > 1 && work < (int64_t{1} << 21)) nt = 1;  // under 2M multiply-adds one thread is faster
  const int64_t chunks = (n + 15) / 16;
  if (nt > chunks) nt = chunks;
  if (nt <= 1) {
    kern(p, 0, n);
    return ffi::Error::Success();
  }
  // Chunks are taken from a shared counter by this thread and by the pool's tasks: this thread never waits for a
  // chunk that no one has started, so a busy (or absent) pool cannot deadlock it; the shared state outlives
  // tasks that start late and find nothing left.
  auto sh = std::make_shared<Shared>();
  sh->p = p;
  sh->kern = kern;
  sh->per = 16 * ((chunks + 4 * nt - 1) / (4 * nt));  // about 4 chunks a thread, whole 16-row tiles
  sh->total = (n + sh->per - 1) / sh->per;
  for (int64_t t = 1; t < nt; ++t) pool.Schedule([sh] { sh->run(); });
  sh->run();
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done == sh->total; });
  return ffi::Error::Success();
}

// ---- 8-bit codes with one tensor scale (FP8 E4M3, HiF8): w[n, k] = lut[q[n, k]] * scale, lut the format's 256
// values (given by the caller, decoded by the library itself), one rounding: exactly QArray.dequantize.

struct Lut8Problem {
  const float* x;
  const uint8_t* codes;
  const float* lut;
  float s;
  int64_t m, k, n;
  float* y;
};

void lut8_generic(const Lut8Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* crow = p.codes + n * p.k;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.x + r * p.k;
      float acc = 0.f;
      for (int64_t i = 0; i < p.k; ++i) acc += xr[i] * (p.lut[crow[i]] * p.s);
      p.y[r * p.n + n] = acc;
    }
  }
}

#ifdef JAXLOWFP_X86
template <int MR>
__attribute__((target("avx2,fma"))) void lut8_avx2_rows(const Lut8Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  const __m256 sv = _mm256_set1_ps(p.s);
  const int64_t k8 = p.k & ~int64_t{7};
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* crow = p.codes + n * p.k;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k8; i += 8) {
      uint64_t raw;
      std::memcpy(&raw, crow + i, 8);
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
      const __m256 w = _mm256_mul_ps(_mm256_i32gather_ps(p.lut, idx, 4), sv);
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p.x + (m0 + r) * p.k + i), acc[r]);
    }
    for (int r = 0; r < MR; ++r) {
      float t = hsum(acc[r]);
      const float* xr = p.x + (m0 + r) * p.k;
      for (int64_t i = k8; i < p.k; ++i) t += xr[i] * (p.lut[crow[i]] * p.s);  // the tail: K % 8
      p.y[(m0 + r) * p.n + n] = t;
    }
  }
}

void lut8_avx2(const Lut8Problem& p, int64_t n0, int64_t n1) {
  // one accumulator a row: up to 8 rows a step (M <= 8, decode, reads each weight once), a row's sum in one order
  for (int64_t m0 = 0; m0 < p.m; m0 += 8) {
    switch (p.m - m0 < 8 ? p.m - m0 : 8) {
      case 1: lut8_avx2_rows<1>(p, m0, n0, n1); break;
      case 2: lut8_avx2_rows<2>(p, m0, n0, n1); break;
      case 3: lut8_avx2_rows<3>(p, m0, n0, n1); break;
      case 4: lut8_avx2_rows<4>(p, m0, n0, n1); break;
      case 5: lut8_avx2_rows<5>(p, m0, n0, n1); break;
      case 6: lut8_avx2_rows<6>(p, m0, n0, n1); break;
      case 7: lut8_avx2_rows<7>(p, m0, n0, n1); break;
      default: lut8_avx2_rows<8>(p, m0, n0, n1); break;
    }
  }
}
#endif

ffi::Error Lut8GemvImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> lut,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int64_t isa) {
  auto xd = x.dimensions(), cd = codes.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || yd.size() != 2 || lut.element_count() != 256 ||
      scale.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxlowfp_lut8_gemv: x, codes, y 2-D, lut 256 values, scale one");
  }
  if (codes.element_type() != ffi::U8 && codes.element_type() != ffi::F8E4M3FN) {
    return ffi::Error::InvalidArgument("jaxlowfp_lut8_gemv: codes must be uint8 or float8_e4m3fn");
  }
  if (cd[1] != xd[1] || yd[0] != xd[0] || yd[1] != cd[0]) {
    return ffi::Error::InvalidArgument("jaxlowfp_lut8_gemv: shapes disagree (x [M, K], codes [N, K], y [M, N])");
  }
  Lut8Problem p{x.typed_data(), reinterpret_cast<const uint8_t*>(codes.untyped_data()), lut.typed_data(),
                scale.typed_data()[0], xd[0], xd[1], cd[0], y->typed_data()};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
#ifdef JAXLOWFP_X86
  if (isa == 0 && has_avx2()) {
    lut8_avx2(p, 0, p.n);
    return ffi::Error::Success();
  }
#endif
  (void)isa;
  lut8_generic(p, 0, p.n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlowfpNvfp4Gemv, Nvfp4GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()  // float8_e4m3fn scales (no native C++ type in the FFI)
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("tile_rows")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlowfpLut8Gemv, Lut8GemvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()  // uint8 (HiF8) or float8_e4m3fn (FP8) codes
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa"));
