"""kvown kernels: NVFP4 quantise / dequantise, block checksums, test patterns and canaries.

``kvown.kernels.ops`` is the API (CUDA kernels through CuPy for CUDA tensors, the torch reference for CPU
tensors); ``kvown.kernels.nvfp4`` and ``kvown.kernels.blocks`` are the references that define the bits;
``kernels/cuda/`` holds the CUDA sources. See kernels/README.md. No protocol logic lives here.
"""
