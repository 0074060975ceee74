# setup.py exists only to build the host test extension kernels._kv_host (setuptools' ext_modules need
# a setup.py). All metadata lives in pyproject.toml; do not duplicate it here.
#
# kernels._kv_host compiles kernels/cuda/kv_math.cuh -- the __host__ __device__ arithmetic of the CUDA
# kernels -- for the CPU, so CI checks the kernels' own arithmetic bit for bit without a GPU. The CUDA
# kernels themselves are NOT built here: CuPy compiles them with NVRTC at first use on a GPU machine.
# Flags: no -ffast-math and no floating-point contraction (kv_math.cuh rule 1). One small file; a
# build takes a few seconds, so `make setup` (pip install --no-deps -e .) stays quick.
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kernels._kv_host",
            sources=["kernels/host/kv_host.cpp"],
            include_dirs=["kernels/cuda"],
            depends=["kernels/cuda/kv_math.cuh"],
            extra_compile_args=["-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math"],
            language="c++",
        )
    ]
)
