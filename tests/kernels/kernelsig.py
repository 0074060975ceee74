"""The C signatures of kv_kernels.cu's entry points, read from the source (for the launch tests)."""

from __future__ import annotations

import re

from kvown.kernels import cuda_loader


def signatures() -> dict[str, list[tuple[str, str]]]:
    """kernel name -> [(kind, parameter name)], kind "pointer" or the C scalar type (``const`` dropped)."""
    source = cuda_loader.KERNELS.read_text()
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\((.*?)\)\s*\{', source, re.S):
        parameters = []
        for param in params.split(","):
            declaration = " ".join(param.split())
            kind, pname = declaration.rsplit(" ", 1)
            if "*" in declaration:
                kind, pname = "pointer", pname.lstrip("*")
            parameters.append((kind.replace("const ", ""), pname))
        found[name] = parameters
    return found
