"""Builds the C++ kernel harnesses (no Python at run time):

    python benchmarks/cpp/build.py fwd|bwd [--out DIR] [--jobs N] [--harness-only]

The variants come from dash_fa3/variants.py (DASH_FA3_VARIANTS narrows them),
the instantiation files from csrc/instantiations/ and the nvcc flags and
include paths from tools/build_config.py: the harness runs exactly the kernels
the extension compiles. Output: DIR/{fwd,bwd}_bench (default carry/<dir>/, an
ignored folder that can travel to the GPU machine with the device tool's carry).
Objects are rebuilt only when their inputs change (make-style timestamps).
--harness-only compiles the harness source alone (no kernels, no link): CI's
check that the harness still matches the kernels' interfaces and the
generated variant table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import build_config  # noqa: E402

ROOT = build_config.ROOT
# Kernels a harness needs besides the main kernel's instantiations.
EXTRA_SOURCES = {"fwd": [], "bwd": ["csrc/kernels/bwd/bwd_preprocess.cu", "csrc/kernels/bwd/bwd_postprocess.cu"]}


def newest_header() -> float:
    return max(p.stat().st_mtime for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cuh"))


def compile_one(src: Path, obj: Path, includes: list[str], headers_mtime: float) -> str:
    if obj.exists() and obj.stat().st_mtime > max(src.stat().st_mtime, headers_mtime):
        return f"up to date: {obj.name}"
    cmd = [build_config.nvcc(), *build_config.NVCC_FLAGS, *(f"-I{d}" for d in includes), "-c", str(src), "-o", str(obj)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src}:\n{proc.stdout}{proc.stderr}")
    # ptxas spill and local-memory warnings would otherwise be lost on success.
    warnings = "".join(f"\n  {ln}" for ln in (proc.stdout + proc.stderr).splitlines() if "warning" in ln.lower())
    return f"built {obj.name} ({time.perf_counter() - start:.0f} s){warnings}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=sorted(build_config.DIRECTIONS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
    ap.add_argument("--harness-only", action="store_true", help="compile the harness source only (no kernels, no link)")
    args = ap.parse_args(argv)

    out = args.out or ROOT / "carry" / args.direction
    (out / "obj").mkdir(parents=True, exist_ok=True)
    selected = build_config.variants.select()
    build_config.write_instantiations()
    # The harnesses run the dense, plain kernels.
    build_config.write_generated(out, selected, ("dense",), (False,))
    includes = [str(out), str(build_config.CSRC), build_config.cutlass_locator.include_dir()]
    pairs = [v for d, v, _, _ in build_config.instantiations(selected, ("dense",), (False,)) if d == args.direction]
    if not pairs:
        sys.exit(f"no {args.direction} variant selected by {build_config.variants.ENV_VAR}")
    sources = [build_config.INSTANTIATIONS / build_config.instantiation_name(args.direction, v) for v in pairs]
    sources += [ROOT / src for src in EXTRA_SOURCES[args.direction]]
    harness = ROOT / "benchmarks" / "cpp" / f"{args.direction}_bench.cu"
    sources = [harness] if args.harness_only else [*sources, harness]
    objs = [out / "obj" / (s.stem + ".o") for s in sources]
    headers = max(newest_header(), *((out / h).stat().st_mtime for h in ("variant_table.h", "kernel_contract.h")))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda so: compile_one(so[0], so[1], includes, headers), zip(sources, objs)):
            print(line, flush=True)
    if args.harness_only:
        return 0
    exe = out / f"{args.direction}_bench"
    subprocess.run([build_config.nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-o", str(exe), *map(str, objs)],
                   check=True)
    print(f"{exe}: {len(pairs)} variants ({', '.join(v.name for v in pairs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
