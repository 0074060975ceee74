"""kvown kernels: CUDA sources (later) and their CPU references, which define the semantics.

``kernels.nvfp4`` holds the torch reference for NVFP4 pack/unpack, block checksums and the test
patterns that verifiers recompute. No protocol logic lives here.
"""
