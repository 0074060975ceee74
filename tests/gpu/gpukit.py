"""What the CUDA kernel tests share: the skip marks and the length of the model's busy default stream."""

from __future__ import annotations

import pytest
import torch

from kvown.kernels import ops

# Skipped, with the reason, where there is no CUDA device or no CuPy.
NEEDS_CUDA_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(not ops.cupy_available(), reason="CuPy is not installed (pip install 'kvown[gpu]')"),
]
MODEL_CYCLES = 2_000_000_000  # ~1 s of GPU time at ~2 GHz: the model's work on the default stream
