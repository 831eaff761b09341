// e^x and 2^x over 16 floats with AVX-512: e^x for the decode attention's softmax and the fused
// layer's SiLU, 2^x for the prefill attention's softmax (its scores are in log2 units). Two
// polynomials, not one: e^x as 2^(x log2 e) would round x log2 e first, an error growing with |x|
// (up to 3.8e-6 at -87, from that rounding alone) on paths whose fp32 results are held to
// transformers'. x86-64 only: include it inside an `#if defined(__x86_64__)` guard.
#pragma once

#include <immintrin.h>

namespace minivllm {

// c[0] r^(N-1) + c[1] r^(N-2) + ... + c[N-1] by Horner's rule, one multiply-add a coefficient.
template <int N>
__attribute__((target("avx512f,fma"))) inline __m512 horner512(__m512 r, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
  return p;
}

// 2^(x log2 e) split into an integer power (by scalef) and a degree-6 polynomial on
// [-ln2/2, ln2/2] (Cephes' expf coefficients, about 1 ulp); x is clamped below at -87.
__attribute__((target("avx512f,fma"))) inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  static constexpr float kCoefficients[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const __m512 p = _mm512_fmadd_ps(_mm512_mul_ps(horner512(r, kCoefficients), r), r,
                                   _mm512_add_ps(r, _mm512_set1_ps(1.0f)));  // 1 + r + r^2 p(r)
  return _mm512_scalef_ps(p, n);
}

// 2^x over 16 floats for x <= 0 (a softmax's scores minus their maximum, in log2 units): the
// integer part by scalef, the fraction r in [-0.5, 0.5] by 2^r's Taylor polynomial of degree 6
// (relative error 1.6e-7, 2.4e-7 evaluated in float32: 2-4 ulp); x is clamped below at -126.
// Four operations fewer than exp512: scores pre-scaled by log2 e need no ln 2 reduction.
__attribute__((target("avx512f,fma"))) inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  static constexpr float kCoefficients[] = {1.5403530393e-4f, 1.3333558146e-3f, 9.6181291076e-3f, 5.5504108665e-2f,
                                            2.4022650696e-1f, 6.9314718056e-1f, 1.0f};  // (ln 2)^k / k!
  return _mm512_scalef_ps(horner512(r, kCoefficients), n);
}

// 2^x over 16 finite floats: exp2_512 without its clamp (-inf gives NaN, and x below -126 leaves
// the scaling to scalef, which still gives 0 or a subnormal), and a degree-5 minimax polynomial
// for 2^r on [-0.5, 0.5] (relative error 2.3e-7 evaluated in float32, as the degree-6 Taylor's
// 2.4e-7): two operations fewer for the prefill attention's probabilities.
__attribute__((target("avx512f,fma"))) inline __m512 exp2_finite_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  static constexpr float kCoefficients[] = {1.3276470126584172e-3f, 9.675540961325169e-3f, 5.550713464617729e-2f,
                                            2.4022120237350464e-1f, 6.931469440460205e-1f, 1.0000001192092896f};
  return _mm512_scalef_ps(horner512(r, kCoefficients), n);
}

// 2^x over 16 finite floats for probabilities that are rounded to bfloat16 next (the AMX
// attention's P): a degree-3 polynomial fitted for relative error on [-0.5, 0.5] (7.5e-5 evaluated
// in float32, 26 times below bfloat16's half ulp, 2^-9), two multiply-adds fewer than
// exp2_finite_512. The row sums taken from these floats carry the same 7.5e-5.
__attribute__((target("avx512f,fma"))) inline __m512 exp2_bf16_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  static constexpr float kCoefficients[] = {5.51716685e-2f, 2.42611140e-1f, 6.93260968e-1f, 9.99928057e-1f};
  return _mm512_scalef_ps(horner512(r, kCoefficients), n);
}

// 2^x over 16 floats for probabilities rounded to bfloat16 next, in five operations: the
// fraction r = x - floor(x) in [0, 1) by vreduceps, a degree-3 polynomial fitted for relative error
// there (7.5e-5 evaluated in float32, as exp2_bf16_512's on [-0.5, 0.5]), and scalef, which scales
// by 2^floor(x) itself, so no rounded copy of x is needed. x = -inf gives 0 or NaN by the CPU's
// reading of vreduceps: callers clear masked lanes.
__attribute__((target("avx512f,avx512dq,fma"))) inline __m512 exp2_floor_bf16_512(__m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  static constexpr float kCoefficients[] = {7.802402973175049e-2f, 2.2606706619262695e-1f, 6.958339810371399e-1f,
                                            9.999251365661621e-1f};
  return _mm512_scalef_ps(horner512(r, kCoefficients), x);
}

}  // namespace minivllm
