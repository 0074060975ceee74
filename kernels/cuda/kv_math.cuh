// kv_math.cuh: the per-element and per-group arithmetic of kvown's kernels, for the device AND the host.
//
// Owns: every bit-level rule the CUDA kernels in kv_kernels.cu apply (E2M1 / E4M3 / fp16 / bf16
// conversions, the NVFP4 group quantiser and dequantiser, the block checksum terms, the pattern and
// canary words). The kernels only load, call these functions and store.
//
// Rules:
//   1. Every function here is `__host__ __device__` (KV_HD) and uses only integer and IEEE float32
//      operations whose result is fixed by the standard: + - * / and comparisons, no fma, no
//      intrinsics with approximate results, no library calls (NVRTC has no headers, and the host
//      build must give the same bits). Build flags: NVRTC `--fmad=false --ftz=false
//      --prec-div=true`; g++ `-ffp-contract=off`, never -ffast-math.
//   2. The torch reference in kernels/nvfp4.py and kernels/blocks.py states the same rules in
//      vectorised torch; tests/kernels/test_host_math.py checks this file's host build against it
//      bit for bit, and tests/gpu checks the kernels against it.
//   3. Integer words are little-endian: byte k of a buffer is byte (k % 4) of 32-bit word k / 4.
//
// Invariants:
//   1. kv_e2m1_encode / kv_e4m3_encode round to nearest, ties to even, and saturate (6 and 448).
//   2. kv_mix32 is a bijection on 32 bits, so a checksum term changes whenever its word changes.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#endif

typedef unsigned char kv_u8;
typedef unsigned short kv_u16;
typedef unsigned int kv_u32;
typedef unsigned long long kv_u64;

#define KV_GROUP 16            // values that share one E4M3 scale
#define KV_E2M1_MAX 6.0f
#define KV_E4M3_MAX 448.0f
#define KV_E4M3_MAX_CODE 0x7Eu  // 448
#define KV_E4M3_NAN_CODE 0x7Fu

// ---- bit casts ---------------------------------------------------------------------------------

KV_HD kv_u32 kv_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    kv_u32 u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}

KV_HD float kv_float(kv_u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}

// ---- input element types -----------------------------------------------------------------------

KV_HD float kv_bf16_to_f32(kv_u16 h) { return kv_float((kv_u32)h << 16); }

KV_HD float kv_f16_to_f32(kv_u16 h) {
    kv_u32 sign = (kv_u32)(h & 0x8000u) << 16;
    kv_u32 exponent = (h >> 10) & 0x1Fu;
    kv_u32 mantissa = h & 0x3FFu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return kv_float(kv_bits(magnitude) | sign);
    }
    if (exponent == 31) return kv_float(sign | 0x7F800000u | (mantissa << 13));  // inf / nan
    return kv_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));  // rebias 15 -> 127
}

// ---- E4M3 (float8_e4m3fn): bias 7, no infinities, 0x7F / 0xFF are NaN, max 448 -------------------

KV_HD float kv_e4m3_decode(kv_u8 code) {
    kv_u32 sign = (kv_u32)(code & 0x80u) << 24;
    kv_u32 exponent = (code >> 3) & 0xFu;
    kv_u32 mantissa = code & 0x7u;
    if (exponent == 15 && mantissa == 7) return kv_float(sign | 0x7FC00000u);
    if (exponent == 0) return kv_float(kv_bits((float)mantissa * 0.001953125f) | sign);  // m * 2^-9
    return kv_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));  // rebias 7 -> 127
}

// Round-to-nearest-even of a 24-bit significand `full` shifted right by `shift` (1..31).
KV_HD kv_u32 kv_round_shift(kv_u32 full, kv_u32 shift) {
    kv_u32 kept = full >> shift;
    kv_u32 rest = full & ((1u << shift) - 1u);
    kv_u32 half = 1u << (shift - 1u);
    return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// float32 -> E4M3 code, ties to even, |x| beyond 448 saturates to 448 (0x7E), NaN -> 0x7F.
// The sign bit is copied even when the magnitude rounds to zero (as torch's conversion does).
KV_HD kv_u8 kv_e4m3_encode(float x) {
    kv_u32 bits = kv_bits(x);
    kv_u32 sign = (bits >> 24) & 0x80u;
    kv_u32 magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return (kv_u8)(sign | KV_E4M3_NAN_CODE);
    int exponent = (int)(magnitude >> 23) - 127;
    kv_u32 full = (magnitude & 0x7FFFFFu) | 0x800000u;
    kv_u32 code;
    if (exponent > 8) {
        code = KV_E4M3_MAX_CODE;
    } else if (exponent >= -6) {  // normal range of E4M3: 3 mantissa bits kept
        kv_u32 rounded = kv_round_shift(full, 20);  // 8..16 (16: carried into the exponent)
        code = ((kv_u32)(exponent + 7) << 3) + (rounded - 8u);
        if (code > KV_E4M3_MAX_CODE) code = KV_E4M3_MAX_CODE;
    } else if (exponent >= -10) {  // subnormal range: multiples of 2^-9, code = multiple (8 = 2^-6)
        code = kv_round_shift(full, (kv_u32)(14 - exponent));
    } else {  // below 2^-10, half of the smallest subnormal (a tie at exactly 2^-10 goes to 0)
        code = 0;
    }
    return (kv_u8)(sign | code);
}

// ---- E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code = sign << 3 | index ------------------------

KV_HD float kv_e2m1_decode(kv_u8 code) {
    kv_u32 exponent = (code >> 1) & 3u;
    kv_u32 mantissa = code & 1u;
    float magnitude = exponent == 0 ? 0.5f * (float)mantissa
                                    : (1.0f + 0.5f * (float)mantissa) * (float)(1u << (exponent - 1u));
    return kv_float(kv_bits(magnitude) | ((kv_u32)(code & 8u) << 28));  // code 8 is -0.0
}

// Nearest code, ties to the even code; magnitudes above 6 (and infinities) saturate to 6; a value
// that rounds to zero is code 0 (never negative zero). NaN gives 0 (callers reject NaN first).
KV_HD kv_u8 kv_e2m1_encode(float x) {
    float m = kv_float(kv_bits(x) & 0x7FFFFFFFu);
    kv_u32 index = (kv_u32)(m > 0.25f) + (kv_u32)(m >= 0.75f) + (kv_u32)(m > 1.25f) + (kv_u32)(m >= 1.75f) +
                   (kv_u32)(m > 2.5f) + (kv_u32)(m >= 3.5f) + (kv_u32)(m > 5.0f);
    kv_u32 negative = (x < 0.0f && index > 0) ? 8u : 0u;
    return (kv_u8)(index | negative);
}

// ---- NVFP4 groups ------------------------------------------------------------------------------

// Quantise 16 float32 values with the float32 global scale `global_scale` (finite, > 0):
//   scale code = E4M3(min(amax / (6 * gs), 448));  effective = decode(code) * gs;
//   value code = E2M1(v / effective), or 0 when effective is 0.
// Writes 8 packed bytes (element 2i in the low nibble of byte i) and returns the scale code.
KV_HD kv_u8 kv_quantize_group(const float v[KV_GROUP], float global_scale, kv_u8 packed[KV_GROUP / 2]) {
    float amax = 0.0f;
    for (int i = 0; i < KV_GROUP; ++i) {
        float m = kv_float(kv_bits(v[i]) & 0x7FFFFFFFu);
        amax = m > amax ? m : amax;
    }
    float wanted = amax / (KV_E2M1_MAX * global_scale);
    if (!(wanted <= KV_E4M3_MAX)) wanted = KV_E4M3_MAX;  // also catches inf
    kv_u8 scale_code = kv_e4m3_encode(wanted);
    float effective = kv_e4m3_decode(scale_code) * global_scale;
    for (int i = 0; i < KV_GROUP / 2; ++i) {
        kv_u8 lo = effective > 0.0f ? kv_e2m1_encode(v[2 * i] / effective) : (kv_u8)0;
        kv_u8 hi = effective > 0.0f ? kv_e2m1_encode(v[2 * i + 1] / effective) : (kv_u8)0;
        packed[i] = (kv_u8)(lo | (hi << 4));
    }
    return scale_code;
}

// value = E2M1(code) * (decode(scale) * gs), in that order of rounding.
KV_HD void kv_dequantize_group(const kv_u8 packed[KV_GROUP / 2], kv_u8 scale_code, float global_scale,
                               float out[KV_GROUP]) {
    float effective = kv_e4m3_decode(scale_code) * global_scale;
    for (int i = 0; i < KV_GROUP / 2; ++i) {
        out[2 * i] = kv_e2m1_decode((kv_u8)(packed[i] & 0xFu)) * effective;
        out[2 * i + 1] = kv_e2m1_decode((kv_u8)(packed[i] >> 4)) * effective;
    }
}

// ---- integer mixing, checksums, patterns, canaries ---------------------------------------------

// A 32-bit bijective mixer (xorshift-multiply). Multipliers are odd and < 2**31 so the torch
// reference can compute every product exactly in int64.
KV_HD kv_u32 kv_mix32(kv_u32 x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}

#define KV_WORD_STEP 0x61C88647u  // odd, < 2**31: spreads word indices over 32 bits

// Checksum terms of word `w` at word index `i` of its block, added into two 32-bit lanes (mod 2**32).
KV_HD void kv_checksum_add(kv_u32 w, kv_u32 i, kv_u32* lane_a, kv_u32* lane_b) {
    kv_u32 t = i * KV_WORD_STEP;
    *lane_a += kv_mix32(w ^ t);
    *lane_b += kv_mix32(w + ((t << 16) | (t >> 16)));
}

// The 64-bit checksum of a block from its two lane sums and its length in bytes. For a fixed
// length the low word is a bijection of lane_a, so any single-word change changes the checksum.
KV_HD kv_u64 kv_checksum_finish(kv_u32 lane_a, kv_u32 lane_b, kv_u64 nbytes) {
    kv_u32 length_lo = (kv_u32)nbytes;
    kv_u32 length_hi = (kv_u32)(nbytes >> 32);
    kv_u32 lo = kv_mix32(lane_a ^ kv_mix32(length_lo + 0x68E31DA4u));
    kv_u32 hi = kv_mix32(lane_b ^ kv_mix32(length_hi ^ lo));
    return ((kv_u64)hi << 32) | lo;
}

// Word `j` of the pattern with seeds (seed_a, seed_b). A bijection of j for fixed seeds, so a
// pattern does not repeat within 16 GiB.
KV_HD kv_u32 kv_pattern_word(kv_u32 seed_a, kv_u32 seed_b, kv_u32 j) {
    return kv_mix32(kv_mix32(j ^ seed_a) + seed_b);
}

// Seeds of the canary of (pool, block, retirement epoch).
KV_HD void kv_canary_seeds(kv_u32 pool_id, kv_u32 block, kv_u64 epoch, kv_u32* seed_a, kv_u32* seed_b) {
    kv_u32 h = kv_mix32(pool_id ^ 0x6B43A9B5u);
    h = kv_mix32(h ^ block);
    h = kv_mix32(h ^ (kv_u32)epoch);
    h = kv_mix32(h ^ (kv_u32)(epoch >> 32));
    *seed_a = h;
    *seed_b = kv_mix32(h ^ 0x1B873593u);
}
