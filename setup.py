# setup.py holds the two things pyproject.toml cannot say; all other metadata lives there.
#
# 1. Packages: everything under kvown/, plus the source folder kernels/ installed as kvown.kernels
#    (package_dir). The tree keeps kernels/ at the top for the CUDA sources' sake, but no top-level
#    `kernels` is ever installed: Hugging Face's `kernels` package owns that name, and the two must
#    install side by side (tests/test_packaging.py). kernels/ imports kvown.core, so it is one
#    package with kvown, never a second top-level one leaning on it.
# 2. The host test extension kvown.kernels._kv_host: kernels/cuda/kv_math.cuh -- the __host__ __device__
#    arithmetic of the CUDA kernels -- compiled for the CPU, so CI checks the kernels' own arithmetic
#    bit for bit without a GPU. The CUDA kernels themselves are NOT built here: CuPy compiles them with
#    NVRTC at first use on a GPU machine. Flags: no -ffast-math and no floating-point contraction
#    (kv_math.cuh rule 1). One small file; a build takes a few seconds, so `make setup`
#    (pip install --no-deps -e .) stays quick.
from setuptools import Extension, find_packages, setup

setup(
    packages=[*find_packages(include=["kvown", "kvown.*"]), "kvown.kernels"],
    package_dir={"kvown.kernels": "kernels"},
    ext_modules=[
        Extension(
            "kvown.kernels._kv_host",
            sources=["kernels/host/kv_host.cpp"],
            include_dirs=["kernels/cuda"],
            depends=["kernels/cuda/kv_math.cuh"],
            extra_compile_args=["-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math"],
            language="c++",
        )
    ],
)
