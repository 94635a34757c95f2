"""Build dash_fa3 from source: ``pip install --no-build-isolation .``

Needs a CUDA build of torch (2.11 with CUDA 13.0 is what we test), the CUDA
toolkit's nvcc, and the nvidia-cutlass wheel for the CUTLASS/CuTe headers.
``DASH_FA3_VARIANTS`` narrows the compiled variants (see dash_fa3/variants.py).
``MAX_JOBS`` bounds the parallel compile jobs.
"""

import os
import sys
import time
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import build_config  # noqa: E402

INSTALL_HINT = (
    "dash_fa3 compiles CUDA kernels for Hopper (sm_90a) and needs, before `pip install`:\n"
    "  1. a CUDA build of PyTorch:      pip install torch==2.11.0   (the CUDA 13.0 build)\n"
    "  2. the CUDA 13 toolkit's nvcc:   set CUDA_HOME (e.g. /usr/local/cuda)\n"
    "  3. CUTLASS headers:              pip install nvidia-cutlass==4.2.0.0 ninja\n"
    "then: pip install --no-build-isolation .\n"
    "Without a GPU, the pure-Python parts run from a source checkout: see README.md."
)


def fail(reason: str) -> None:
    sys.exit(f"error: cannot build dash_fa3: {reason}\n\n{INSTALL_HINT}")


def extension_modules():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension
    except ImportError as exc:
        fail(f"PyTorch is not importable ({exc})")
    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a CPU-only build")
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        fail(f"nvcc not found (CUDA_HOME={CUDA_HOME!r})")
    try:
        include_dirs = build_config.include_dirs()
    except build_config.cutlass_locator.CutlassNotFound as exc:
        fail(str(exc))
    try:
        selected = build_config.variants.select()
    except ValueError as exc:
        fail(str(exc))
    print(f"dash_fa3: building {len(selected)} variants: {', '.join(v.name for v in selected)}")
    sources = build_config.prepare(selected)
    return [
        CUDAExtension(
            name="dash_fa3._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={
                "cxx": build_config.CXX_FLAGS,
                "nvcc": build_config.NVCC_FLAGS,
            },
            # The ops are registered with TORCH_LIBRARY and loaded through
            # torch.ops.load_library, so one .so serves every CPython >= 3.10 (torch sets Py_LIMITED_API to 3.10).
            py_limited_api=True,
        )
    ]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class TimedBuildExtension(BuildExtension):
        def run(self):
            start = time.perf_counter()
            super().run()
            elapsed = time.perf_counter() - start
            jobs = os.environ.get("MAX_JOBS", "default")
            msg = f"dash_fa3: extension build took {elapsed:.0f} s (MAX_JOBS={jobs}, {os.cpu_count()} cores)"
            print(msg)
            (ROOT / "build").mkdir(exist_ok=True)
            (ROOT / "build" / "build_time.txt").write_text(msg + "\n")

    return TimedBuildExtension.with_options(use_ninja=True)


setup(
    name="dash_fa3",
    version="0.1.0",
    description="FlashAttention-3-class Hopper attention with a fast bitwise-deterministic backward",
    packages=find_packages(include=["dash_fa3", "dash_fa3.*"]),
    python_requires=">=3.10",
    ext_modules=extension_modules(),
    cmdclass={"build_ext": build_ext_class()},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
