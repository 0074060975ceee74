// kv_kernels.cu: kvown's CUDA kernels. Compiled at run time by NVRTC (through CuPy's RawModule) with
// kv_math.cuh pasted in front (kernels/cuda_loader.py); tests/kernels/test_ptx.py compiles it to PTX
// on machines with no GPU.
//
// Owns: loading, storing and indexing. Every arithmetic rule is a kv_math.cuh function, so the
// host build of that header (kernels/host/kv_host.cpp) checks the arithmetic without a GPU.
//
// Rules:
//   1. Entry points are extern "C" (stable names for RawModule.get_function and the PTX test).
//   2. Addressing is explicit: up to 4 leading dimensions with strides (elements for float inputs
//      and outputs, bytes for uint8 planes), last dimension contiguous. The wrappers coalesce dims
//      and pass size 1 / stride 0 for the unused ones.
//   3. Vector loads and stores are used only where the wrapper says the addresses allow them
//      (`vec` flags) or a per-thread alignment check passes; the scalar paths give the same bytes.
//   4. No kernel allocates or synchronises; results that need a reduction use atomics on outputs
//      the wrapper zeroed (checksum lanes) or set to -1 (first bad offsets).

#define KV_THREADS 256

struct kv_rows {  // row r -> offset, for up to 4 leading dims (size 1 / stride 0 when unused)
    long long s1, s2, s3;
};

__device__ __forceinline__ long long kv_row_offset(long long row, kv_rows sizes, long long t0, long long t1,
                                                   long long t2, long long t3) {
    long long i3 = row % sizes.s3;
    long long r = row / sizes.s3;
    long long i2 = r % sizes.s2;
    r /= sizes.s2;
    long long i1 = r % sizes.s1;
    long long i0 = r / sizes.s1;
    return i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3;
}

__device__ __forceinline__ bool kv_aligned(const void* p, unsigned int n) {
    return (((unsigned long long)p) & (n - 1u)) == 0;
}

// ---- NVFP4 ---------------------------------------------------------------------------------------

// x_dtype: 0 float32, 1 bfloat16, 2 float16. One thread per group of 16 values.
// Groups with index >= rope_first_group use gs_rope (the MLA latent's rope part), others gs.
extern "C" __global__ void kv_nvfp4_quantize(
    const void* x, int x_dtype, kv_u8* values, kv_u8* scales, long long rows, int groups_per_row,
    int rope_first_group, float gs, float gs_rope, long long s1, long long s2, long long s3,
    long long xt0, long long xt1, long long xt2, long long xt3,
    long long vt0, long long vt1, long long vt2, long long vt3,
    long long st0, long long st1, long long st2, long long st3, int* bad_input) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= rows * groups_per_row) return;
    long long row = g / groups_per_row;
    int group = (int)(g - row * groups_per_row);
    kv_rows sizes = {s1, s2, s3};
    float v[KV_GROUP];
    long long x_index = kv_row_offset(row, sizes, xt0, xt1, xt2, xt3) + (long long)group * KV_GROUP;
    if (x_dtype == 0) {
        const float* p = (const float*)x + x_index;
        if (kv_aligned(p, 16)) {
            for (int k = 0; k < 4; ++k) {
                float4 q = ((const float4*)p)[k];
                v[4 * k] = q.x; v[4 * k + 1] = q.y; v[4 * k + 2] = q.z; v[4 * k + 3] = q.w;
            }
        } else {
            for (int k = 0; k < KV_GROUP; ++k) v[k] = p[k];
        }
    } else {
        const kv_u16* p = (const kv_u16*)x + x_index;
        kv_u16 h[KV_GROUP];
        if (kv_aligned(p, 16)) {
            uint4 a = ((const uint4*)p)[0], b = ((const uint4*)p)[1];
            kv_u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            for (int k = 0; k < 8; ++k) { h[2 * k] = (kv_u16)w[k]; h[2 * k + 1] = (kv_u16)(w[k] >> 16); }
        } else {
            for (int k = 0; k < KV_GROUP; ++k) h[k] = p[k];
        }
        for (int k = 0; k < KV_GROUP; ++k) v[k] = x_dtype == 1 ? kv_bf16_to_f32(h[k]) : kv_f16_to_f32(h[k]);
    }
    bool finite = true;
    for (int k = 0; k < KV_GROUP; ++k) finite &= (kv_bits(v[k]) & 0x7F800000u) != 0x7F800000u;
    if (!finite) atomicOr(bad_input, 1);
    kv_u8 packed[KV_GROUP / 2];
    kv_u8 code = kv_quantize_group(v, group >= rope_first_group ? gs_rope : gs, packed);
    kv_u8* out = values + kv_row_offset(row, sizes, vt0, vt1, vt2, vt3) + (long long)group * (KV_GROUP / 2);
    if (kv_aligned(out, 8)) {
        uint2 word;
        word.x = packed[0] | (packed[1] << 8) | (packed[2] << 16) | ((kv_u32)packed[3] << 24);
        word.y = packed[4] | (packed[5] << 8) | (packed[6] << 16) | ((kv_u32)packed[7] << 24);
        *(uint2*)out = word;
    } else {
        for (int k = 0; k < KV_GROUP / 2; ++k) out[k] = packed[k];
    }
    scales[kv_row_offset(row, sizes, st0, st1, st2, st3) + group] = code;
}

// float32 output. One thread per group of 16 values.
extern "C" __global__ void kv_nvfp4_dequantize(
    const kv_u8* values, const kv_u8* scales, float* out, long long rows, int groups_per_row,
    int rope_first_group, float gs, float gs_rope, long long s1, long long s2, long long s3,
    long long vt0, long long vt1, long long vt2, long long vt3,
    long long st0, long long st1, long long st2, long long st3,
    long long ot0, long long ot1, long long ot2, long long ot3) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= rows * groups_per_row) return;
    long long row = g / groups_per_row;
    int group = (int)(g - row * groups_per_row);
    kv_rows sizes = {s1, s2, s3};
    const kv_u8* in = values + kv_row_offset(row, sizes, vt0, vt1, vt2, vt3) + (long long)group * (KV_GROUP / 2);
    kv_u8 packed[KV_GROUP / 2];
    if (kv_aligned(in, 8)) {
        uint2 word = *(const uint2*)in;
        for (int k = 0; k < 4; ++k) { packed[k] = (kv_u8)(word.x >> (8 * k)); packed[4 + k] = (kv_u8)(word.y >> (8 * k)); }
    } else {
        for (int k = 0; k < KV_GROUP / 2; ++k) packed[k] = in[k];
    }
    kv_u8 code = scales[kv_row_offset(row, sizes, st0, st1, st2, st3) + group];
    float v[KV_GROUP];
    kv_dequantize_group(packed, code, group >= rope_first_group ? gs_rope : gs, v);
    float* o = out + kv_row_offset(row, sizes, ot0, ot1, ot2, ot3) + (long long)group * KV_GROUP;
    if (kv_aligned(o, 16)) {
        for (int k = 0; k < 4; ++k) ((float4*)o)[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    } else {
        for (int k = 0; k < KV_GROUP; ++k) o[k] = v[k];
    }
}

// ---- block helpers ---------------------------------------------------------------------------------

// Block b's first byte: rows of a (num_blocks, row_stride) pool, picked by ids (or b itself).
__device__ __forceinline__ kv_u8* kv_block_base(kv_u8* base, long long row_stride, const long long* ids,
                                                long long b) {
    return base + (ids ? ids[b] : b) * row_stride;
}

// Word j of a block of nbytes bytes (zero-padded past the end), read byte by byte.
__device__ __forceinline__ kv_u32 kv_load_word_bytes(const kv_u8* p, unsigned long long nbytes,
                                                     unsigned long long j) {
    kv_u32 w = 0;
    for (int k = 0; k < 4; ++k) {
        unsigned long long at = 4 * j + k;
        if (at < nbytes) w |= (kv_u32)p[at] << (8 * k);
    }
    return w;
}

__device__ __forceinline__ kv_u32 kv_warp_sum(kv_u32 v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    return v;
}

// ---- checksum ----------------------------------------------------------------------------------

// Two 32-bit lane sums per block into lanes[2b], lanes[2b + 1] (zeroed by the caller).
// grid = (CTAs per block, blocks (strided past 65535)); vec: base, row_stride, nbytes all % 16 == 0.
extern "C" __global__ void kv_checksum_lanes(const kv_u8* base, long long row_stride, unsigned long long nbytes,
                                             const long long* ids, long long nblocks, int vec, kv_u32* lanes) {
    for (long long b = blockIdx.y; b < nblocks; b += gridDim.y) {
        const kv_u8* p = kv_block_base((kv_u8*)base, row_stride, ids, b);
        kv_u32 a = 0, c = 0;
        unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (vec) {
            unsigned long long quads = nbytes / 16;
            for (unsigned long long q = first; q < quads; q += stride) {
                uint4 w = ((const uint4*)p)[q];
                kv_u32 j = (kv_u32)(4 * q);
                kv_checksum_add(w.x, j, &a, &c);
                kv_checksum_add(w.y, j + 1, &a, &c);
                kv_checksum_add(w.z, j + 2, &a, &c);
                kv_checksum_add(w.w, j + 3, &a, &c);
            }
        } else {
            unsigned long long words = (nbytes + 3) / 4;
            for (unsigned long long j = first; j < words; j += stride)
                kv_checksum_add(kv_load_word_bytes(p, nbytes, j), (kv_u32)j, &a, &c);
        }
        a = kv_warp_sum(a);
        c = kv_warp_sum(c);
        if ((threadIdx.x & 31) == 0) {
            atomicAdd(&lanes[2 * b], a);
            atomicAdd(&lanes[2 * b + 1], c);
        }
    }
}

extern "C" __global__ void kv_checksum_finish(const kv_u32* lanes, long long nblocks, unsigned long long nbytes,
                                              unsigned long long* out) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b < nblocks) out[b] = kv_checksum_finish(lanes[2 * b], lanes[2 * b + 1], nbytes);
}

// ---- patterns and canaries ---------------------------------------------------------------------

// Seeds of block b: mode 0 fixed (fill_pattern's, from the host), mode 1 the canary of
// (pool_id, ids[b], epochs[b]).
__device__ __forceinline__ void kv_block_seeds(int mode, kv_u32 pool_id, const long long* ids,
                                               const long long* epochs, long long b, kv_u32 seed_a,
                                               kv_u32 seed_b, kv_u32* sa, kv_u32* sb) {
    if (mode == 0) {
        *sa = seed_a;
        *sb = seed_b;
    } else {
        kv_canary_seeds(pool_id, (kv_u32)(ids ? ids[b] : b), (kv_u64)epochs[b], sa, sb);
    }
}

// Fill blocks with their pattern. vec: base and row_stride % 16 == 0 (tails are written bytewise).
extern "C" __global__ void kv_pattern_fill(kv_u8* base, long long row_stride, unsigned long long nbytes,
                                          const long long* ids, const long long* epochs, long long nblocks,
                                          int mode, kv_u32 pool_id, kv_u32 seed_a, kv_u32 seed_b, int vec) {
    for (long long b = blockIdx.y; b < nblocks; b += gridDim.y) {
        kv_u8* p = kv_block_base(base, row_stride, ids, b);
        kv_u32 sa, sb;
        kv_block_seeds(mode, pool_id, ids, epochs, b, seed_a, seed_b, &sa, &sb);
        unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        unsigned long long quads = (nbytes + 15) / 16;
        for (unsigned long long q = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; q < quads; q += stride) {
            kv_u32 j = (kv_u32)(4 * q);
            kv_u32 w[4] = {kv_pattern_word(sa, sb, j), kv_pattern_word(sa, sb, j + 1),
                           kv_pattern_word(sa, sb, j + 2), kv_pattern_word(sa, sb, j + 3)};
            if (vec && 16 * q + 16 <= nbytes) {
                ((uint4*)p)[q] = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
                for (int k = 0; k < 16; ++k) {
                    unsigned long long at = 16 * q + k;
                    if (at < nbytes) p[at] = (kv_u8)(w[k / 4] >> (8 * (k % 4)));
                }
            }
        }
    }
}

// first_bad[b] = lowest byte offset in block b that differs from its pattern; the caller sets
// every entry to -1 (all ones), which stays when the block is intact.
extern "C" __global__ void kv_pattern_verify(const kv_u8* base, long long row_stride, unsigned long long nbytes,
                                            const long long* ids, const long long* epochs, long long nblocks,
                                            int mode, kv_u32 pool_id, kv_u32 seed_a, kv_u32 seed_b, int vec,
                                            unsigned long long* first_bad) {
    for (long long b = blockIdx.y; b < nblocks; b += gridDim.y) {
        const kv_u8* p = kv_block_base((kv_u8*)base, row_stride, ids, b);
        kv_u32 sa, sb;
        kv_block_seeds(mode, pool_id, ids, epochs, b, seed_a, seed_b, &sa, &sb);
        unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        unsigned long long quads = (nbytes + 15) / 16;
        unsigned long long bad = ~0ull;
        for (unsigned long long q = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; q < quads; q += stride) {
            kv_u32 j = (kv_u32)(4 * q);
            kv_u32 have[4];
            if (vec && 16 * q + 16 <= nbytes) {
                uint4 v = ((const uint4*)p)[q];
                have[0] = v.x; have[1] = v.y; have[2] = v.z; have[3] = v.w;
            } else {
                for (int k = 0; k < 4; ++k) have[k] = kv_load_word_bytes(p, nbytes, 4 * q + k);
            }
            for (int k = 0; k < 4; ++k) {
                kv_u32 want = kv_pattern_word(sa, sb, j + k);
                unsigned long long word_start = 16 * q + 4 * k;
                if (word_start >= nbytes) break;
                unsigned long long left = nbytes - word_start;
                if (left < 4) want &= (1u << (8 * left)) - 1u;  // compare only the bytes that exist
                kv_u32 diff = have[k] ^ want;
                if (diff) {
                    unsigned long long at = word_start + (__ffs(diff) - 1) / 8;
                    bad = at < bad ? at : bad;
                    break;
                }
            }
            if (bad != ~0ull) break;  // later quads of this thread are at higher offsets
        }
        if (bad != ~0ull) atomicMin(&first_bad[b], bad);
    }
}
