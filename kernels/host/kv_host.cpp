// kvown.kernels._kv_host: the host build of kernels/cuda/kv_math.cuh, for tests on machines with no GPU.
//
// Owns: thin loops that call the SAME __host__ __device__ functions the CUDA kernels call, one group
// or one word at a time, over caller-owned buffers (numpy arrays). It exists so that CI checks the
// kernels' own arithmetic bit for bit against the torch reference (tests/kernels/test_host_math.py).
// It is not a fast path: nothing in kvown's data path calls it.
//
// Rules:
//   1. Buffers are C-contiguous, sized exactly as the call says; a wrong size raises ValueError.
//   2. Built by setup.py with -ffp-contract=off and without -ffast-math (see kv_math.cuh rule 1).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kv_math.cuh"

namespace {

struct Buffer {  // a Py_buffer released on scope exit
    Py_buffer view{};
    bool held = false;
    ~Buffer() {
        if (held) PyBuffer_Release(&view);
    }
    bool get(PyObject* obj, bool writable, Py_ssize_t nbytes, const char* name) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj, &view, flags) != 0) return false;
        held = true;
        if (view.len != nbytes) {
            PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", name, nbytes, view.len);
            return false;
        }
        return true;
    }
    template <typename T> T* as() { return static_cast<T*>(view.buf); }
};

// quantize(x, dtype, rows, n, gs, gs_rope, rope_first_group, values, scales) -> non-finite count
PyObject* quantize(PyObject*, PyObject* args) {
    PyObject *xo, *vo, *so;
    int dtype, n, rope_first_group;
    Py_ssize_t rows;
    float gs, gs_rope;
    if (!PyArg_ParseTuple(args, "OiniffiOO", &xo, &dtype, &rows, &n, &gs, &gs_rope, &rope_first_group, &vo, &so))
        return nullptr;
    if (n % KV_GROUP || dtype < 0 || dtype > 2) {
        PyErr_SetString(PyExc_ValueError, "n must be a multiple of 16 and dtype 0, 1 or 2");
        return nullptr;
    }
    Buffer x, v, s;
    Py_ssize_t itemsize = dtype == 0 ? 4 : 2;
    if (!x.get(xo, false, rows * n * itemsize, "x") || !v.get(vo, true, rows * n / 2, "values") ||
        !s.get(so, true, rows * n / KV_GROUP, "scales"))
        return nullptr;
    long long bad = 0;
    int groups = n / KV_GROUP;
    for (Py_ssize_t g = 0; g < rows * groups; ++g) {
        float group[KV_GROUP];
        for (int k = 0; k < KV_GROUP; ++k) {
            Py_ssize_t at = g * KV_GROUP + k;
            group[k] = dtype == 0 ? x.as<float>()[at]
                     : dtype == 1 ? kv_bf16_to_f32(x.as<kv_u16>()[at]) : kv_f16_to_f32(x.as<kv_u16>()[at]);
            bad += (kv_bits(group[k]) & 0x7F800000u) == 0x7F800000u;
        }
        int column = (int)(g % groups);
        s.as<kv_u8>()[g] = kv_quantize_group(group, column >= rope_first_group ? gs_rope : gs,
                                             v.as<kv_u8>() + g * (KV_GROUP / 2));
    }
    return PyLong_FromLongLong(bad);
}

// dequantize(values, scales, rows, n, gs, gs_rope, rope_first_group, out)
PyObject* dequantize(PyObject*, PyObject* args) {
    PyObject *vo, *so, *oo;
    int n, rope_first_group;
    Py_ssize_t rows;
    float gs, gs_rope;
    if (!PyArg_ParseTuple(args, "OOniffiO", &vo, &so, &rows, &n, &gs, &gs_rope, &rope_first_group, &oo))
        return nullptr;
    if (n % KV_GROUP) {
        PyErr_SetString(PyExc_ValueError, "n must be a multiple of 16");
        return nullptr;
    }
    Buffer v, s, o;
    if (!v.get(vo, false, rows * n / 2, "values") || !s.get(so, false, rows * n / KV_GROUP, "scales") ||
        !o.get(oo, true, rows * n * 4, "out"))
        return nullptr;
    int groups = n / KV_GROUP;
    for (Py_ssize_t g = 0; g < rows * groups; ++g) {
        int column = (int)(g % groups);
        kv_dequantize_group(v.as<kv_u8>() + g * (KV_GROUP / 2), s.as<kv_u8>()[g],
                            column >= rope_first_group ? gs_rope : gs, o.as<float>() + g * KV_GROUP);
    }
    Py_RETURN_NONE;
}

// checksums(data, nblocks, nbytes, out_u64): data holds nblocks rows of nbytes bytes.
PyObject* checksums(PyObject*, PyObject* args) {
    PyObject *d, *oo;
    Py_ssize_t nblocks, nbytes;
    if (!PyArg_ParseTuple(args, "OnnO", &d, &nblocks, &nbytes, &oo)) return nullptr;
    Buffer data, out;
    if (!data.get(d, false, nblocks * nbytes, "data") || !out.get(oo, true, nblocks * 8, "out")) return nullptr;
    for (Py_ssize_t b = 0; b < nblocks; ++b) {
        const kv_u8* p = data.as<kv_u8>() + b * nbytes;
        kv_u32 a = 0, c = 0;
        for (Py_ssize_t j = 0; 4 * j < nbytes; ++j) {
            kv_u32 w = 0;
            for (int k = 0; k < 4; ++k)
                if (4 * j + k < nbytes) w |= (kv_u32)p[4 * j + k] << (8 * k);
            kv_checksum_add(w, (kv_u32)j, &a, &c);
        }
        out.as<kv_u64>()[b] = kv_checksum_finish(a, c, (kv_u64)nbytes);
    }
    Py_RETURN_NONE;
}

// pattern_fill(buffer, seed_a, seed_b)
PyObject* pattern_fill(PyObject*, PyObject* args) {
    PyObject* bo;
    unsigned int sa, sb;
    if (!PyArg_ParseTuple(args, "OII", &bo, &sa, &sb)) return nullptr;
    Buffer buf;
    if (PyObject_GetBuffer(bo, &buf.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return nullptr;
    buf.held = true;
    kv_u8* p = buf.as<kv_u8>();
    for (Py_ssize_t at = 0; at < buf.view.len; ++at)
        p[at] = (kv_u8)(kv_pattern_word(sa, sb, (kv_u32)(at / 4)) >> (8 * (at % 4)));
    Py_RETURN_NONE;
}

// pattern_first_bad(buffer, seed_a, seed_b) -> first differing byte offset, or -1
PyObject* pattern_first_bad(PyObject*, PyObject* args) {
    PyObject* bo;
    unsigned int sa, sb;
    if (!PyArg_ParseTuple(args, "OII", &bo, &sa, &sb)) return nullptr;
    Buffer buf;
    if (PyObject_GetBuffer(bo, &buf.view, PyBUF_C_CONTIGUOUS) != 0) return nullptr;
    buf.held = true;
    const kv_u8* p = buf.as<kv_u8>();
    for (Py_ssize_t at = 0; at < buf.view.len; ++at)
        if (p[at] != (kv_u8)(kv_pattern_word(sa, sb, (kv_u32)(at / 4)) >> (8 * (at % 4))))
            return PyLong_FromSsize_t(at);
    return PyLong_FromLong(-1);
}

// canary_seeds(pool_id, block, epoch) -> (seed_a, seed_b)
PyObject* canary_seeds(PyObject*, PyObject* args) {
    unsigned int pool_id, block;
    unsigned long long epoch;
    if (!PyArg_ParseTuple(args, "IIK", &pool_id, &block, &epoch)) return nullptr;
    kv_u32 a, b;
    kv_canary_seeds(pool_id, block, epoch, &a, &b);
    return Py_BuildValue("(II)", a, b);
}

// Element-wise conversions: name(src, dst) over equal element counts.
template <typename In, typename Out, Out (*F)(In)>
PyObject* elementwise(PyObject*, PyObject* args) {
    PyObject *io, *oo;
    if (!PyArg_ParseTuple(args, "OO", &io, &oo)) return nullptr;
    Buffer in, out;
    if (PyObject_GetBuffer(io, &in.view, PyBUF_C_CONTIGUOUS) != 0) return nullptr;
    in.held = true;
    Py_ssize_t count = in.view.len / (Py_ssize_t)sizeof(In);
    if (!out.get(oo, true, count * (Py_ssize_t)sizeof(Out), "out")) return nullptr;
    for (Py_ssize_t k = 0; k < count; ++k) out.as<Out>()[k] = F(in.as<In>()[k]);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, "NVFP4-quantise rows (kv_quantize_group per 16 values)."},
    {"dequantize", dequantize, METH_VARARGS, "NVFP4-dequantise rows to float32."},
    {"checksums", checksums, METH_VARARGS, "64-bit checksum of each of nblocks rows."},
    {"pattern_fill", pattern_fill, METH_VARARGS, "Fill a buffer with the pattern of (seed_a, seed_b)."},
    {"pattern_first_bad", pattern_first_bad, METH_VARARGS, "First byte that differs from the pattern, or -1."},
    {"canary_seeds", canary_seeds, METH_VARARGS, "Pattern seeds of the canary of (pool, block, epoch)."},
    {"e4m3_encode", elementwise<float, kv_u8, kv_e4m3_encode>, METH_VARARGS, "float32 -> E4M3 codes."},
    {"e4m3_decode", elementwise<kv_u8, float, kv_e4m3_decode>, METH_VARARGS, "E4M3 codes -> float32."},
    {"e2m1_encode", elementwise<float, kv_u8, kv_e2m1_encode>, METH_VARARGS, "float32 -> E2M1 codes."},
    {"e2m1_decode", elementwise<kv_u8, float, kv_e2m1_decode>, METH_VARARGS, "E2M1 codes -> float32."},
    {"bf16_to_f32", elementwise<kv_u16, float, kv_bf16_to_f32>, METH_VARARGS, "bfloat16 bits -> float32."},
    {"f16_to_f32", elementwise<kv_u16, float, kv_f16_to_f32>, METH_VARARGS, "float16 bits -> float32."},
    {"mix32", elementwise<kv_u32, kv_u32, kv_mix32>, METH_VARARGS, "The 32-bit mixer, word by word."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvown.kernels._kv_host",
                      "Host build of kernels/cuda/kv_math.cuh (tests only).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__kv_host(void) { return PyModule_Create(&module); }
