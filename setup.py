"""Build dash_fa3 from source: ``pip install --no-build-isolation -e ".[test]"``

Needs a CUDA build of torch >= 2.9 (2.11 with CUDA 13.0 is what the GPU machine
runs), the CUDA toolkit's nvcc and headers (``CUDA_HOME``) of the same major
version as torch's CUDA, and the nvidia-cutlass wheel for the CUTLASS/CuTe
headers. Every missing prerequisite is reported before anything compiles.
``DASH_FA3_VARIANTS`` narrows the compiled variants (see dash_fa3/variants.py).
``DASH_FA3_LAYOUTS`` and ``DASH_FA3_SOFTCAP=1`` choose the kernel families (layouts;
softcap kernels, off by default). ``MAX_JOBS`` bounds the parallel compile jobs. ``DASH_FA3_CPU_ONLY=1`` installs
the Python package without the extension (CPU reference path and schedule model).
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
    "  1. a CUDA build of PyTorch >= 2.9:  pip install 'torch>=2.9'   (PyPI's Linux x86_64 wheels are CUDA builds)\n"
    "  2. the CUDA toolkit (nvcc + headers) of torch's CUDA major version:  export CUDA_HOME=/usr/local/cuda\n"
    "  3. CUTLASS headers and the build tools:  pip install nvidia-cutlass==4.2.0.0 ninja wheel\n"
    "then: pip install --no-build-isolation -e \".[test]\"\n"
    f"Without a GPU: {build_config.CPU_ONLY_ENV}=1 pip install --no-build-isolation -e \".[test]\" installs the\n"
    "Python package alone (the CPU reference path and the schedule model). See README.md."
)


def cpu_only() -> bool:
    return os.environ.get(build_config.CPU_ONLY_ENV, "0") not in ("", "0")


def check_prerequisites() -> None:
    """Stops the install at once, listing every missing prerequisite and how to get it."""
    _, problems = build_config.find_problems(build_config.installed_torch(), os.environ)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        sys.exit(f"error: cannot build dash_fa3:\n{listed}\n\n{INSTALL_HINT}")


def fail(reason: str) -> None:
    sys.exit(f"error: cannot build dash_fa3: {reason}\n\n{INSTALL_HINT}")


def extension_modules():
    if cpu_only():
        print(f"dash_fa3: {build_config.CPU_ONLY_ENV}=1: installing the Python package without the CUDA extension")
        return []
    check_prerequisites()
    from torch.utils.cpp_extension import CUDAExtension

    include_dirs = build_config.include_dirs()
    try:
        selected = build_config.variants.select()
        layouts = build_config.variants.select_layouts()
        softcaps = build_config.variants.select_softcap()
    except ValueError as exc:
        fail(str(exc))
    print(f"dash_fa3: building {len(selected)} variants: {', '.join(v.name for v in selected)}; layouts "
          f"{', '.join(layouts)}; {'plain and softcap' if True in softcaps else 'plain'} scores")
    sources = build_config.prepare(selected, layouts, softcaps)
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


# The test extra is what the README's test command needs; each framework adapter's tests need
# that framework and skip without it, so the frameworks are extras of their own (CI installs
# them all). The CPU-only install needs none of them, nor nvidia-cutlass: only the extension
# build reads CUTLASS headers (build_config.include_dirs).
FRAMEWORKS = {
    "transformers": ["transformers>=5,<6"],
    "torchtitan": ["torchtitan==0.3.0"],
    # megatron-core 0.19 needs Python >= 3.12; on older Pythons its tests skip.
    "megatron": ['megatron-core~=0.19.2; python_version >= "3.12"'],
}
EXTRAS = {
    "test": ["pytest", "hypothesis"],
    # Charts (the schedule CLI's Gantt charts, bench --plot); their tests skip without it.
    "plots": ["matplotlib"],
    **FRAMEWORKS,
    "frameworks": [req for reqs in FRAMEWORKS.values() for req in reqs],
}

ext_modules = extension_modules()
cmdclass = {"build_ext": build_ext_class()} if ext_modules else {}

setup(
    name="dash_fa3",
    version="0.1.0",
    description="FlashAttention-3-class Hopper attention with a fast bitwise-deterministic backward",
    packages=find_packages(include=["dash_fa3", "dash_fa3.*"]),
    package_data={"dash_fa3.schedule": ["bench_grid.json"], "dash_fa3.schedule.model": ["data/*.json"]},
    python_requires=">=3.10",
    # A lower bound only: the extension builds against whatever torch is installed.
    install_requires=["torch>=2.9", "numpy"],
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
