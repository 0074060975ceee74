"""Repack a wheel without some of its folders, with a RECORD that lists exactly what is left.

Usage: python benchmarks/slim_wheel.py WHEEL --drop PREFIX [--drop PREFIX ...] -o OUT_DIR

For the GPU carry (benchmarks/gpu_check.sh --fetch-wheels): nixl-cu13 ships ``nixl_ep_cu13/``, NIXL's
expert-parallel extension built for three torch versions (27 of its 56 MiB), which kvown never
imports; without it the wheel, Open MPI and the tree fit the 60 MiB carry. Kept files are copied
byte for byte, so their RECORD lines (hashes, sizes) stay valid; RECORD itself is rewritten.

Rules: a prefix must match at least one file (a typo fails, it does not slim nothing); nothing under
``*.dist-info/`` may be dropped; the output has the input's file name.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: list[str], out_dir: Path) -> Path:
    """Write ``out_dir / wheel.name`` without the members under ``drop``; returns its path."""
    if any(".dist-info/" in p or p.endswith(".dist-info") for p in drop):
        raise ValueError("refusing to drop wheel metadata (.dist-info)")
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        unused = [p for p in drop if not any(n.startswith(p) for n in names)]
        if unused:
            raise ValueError(f"no member under {unused} in {wheel.name}")
        kept = [n for n in names if not any(n.startswith(p) for p in drop)]
        record = next(n for n in kept if n.endswith(".dist-info/RECORD"))
        out_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
            for name in kept:
                if name == record:
                    continue
                info = src.getinfo(name)
                dst.writestr(info, src.read(name), compress_type=zipfile.ZIP_DEFLATED)
            lines = src.read(record).decode().splitlines()
            left = [line for line in lines if line and not any(line.startswith(p) for p in drop)]
            dst.writestr(record, "\n".join(left) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--drop", action="append", required=True, help="a path prefix inside the wheel")
    parser.add_argument("-o", "--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    target = slim(args.wheel, args.drop, args.out_dir)
    print(f"{target}: {args.wheel.stat().st_size / 2**20:.2f} MiB -> {target.stat().st_size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
