"""Build configuration shared by setup.py, tools/ptxas_report.py and benchmarks/cpp/build.py.

It turns the variant list (dash_fa3/variants.py) into instantiation files, a
generated C++ variant table and the list of translation units, turns the kernel
contract (dash_fa3/schedule/contract.py: schedule metadata layout, backward tile
sizes) into the generated C++ header kernel_contract.h, and holds the compiler
flags, so the extension build and the ptxas report compile the same code with
the same flags.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
INSTANTIATIONS = CSRC / "instantiations"
GENERATED = ROOT / "build" / "generated"


def _load(name: str, path: Path):
    # Loaded by path: importing the dash_fa3 package would pull in torch, and the
    # build must be able to report a missing torch itself.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def nvcc() -> str:
    """$CUDA_HOME/bin/nvcc (default /usr/local/cuda); exits with a message if it is missing."""
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(path):
        sys.exit(f"nvcc not found at {path}; set CUDA_HOME")
    return path


# ---------------------------------------------------------------------------
# Prerequisites of the extension build, checked by setup.py before anything is
# compiled. Pure functions of what they are given, so the tests can fake torch,
# the environment and the file system.

MIN_TORCH = (2, 9)
CPU_ONLY_ENV = "DASH_FA3_CPU_ONLY"


@dataclasses.dataclass(frozen=True)
class TorchBuild:
    """What the build needs to know about the installed torch."""

    version: str                  # torch.__version__
    cuda: str | None              # torch.version.cuda (None: a CPU-only build)
    cuda_home_guess: str | None   # torch.utils.cpp_extension.CUDA_HOME: the toolkit torch would build with


def installed_torch() -> TorchBuild | str:
    """The installed torch, or why it cannot be imported."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"{type(exc).__name__}: {exc}"
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:
        CUDA_HOME = None
    return TorchBuild(torch.__version__, torch.version.cuda, CUDA_HOME)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def toolkit_version(cuda_home: str) -> str | None:
    """The toolkit's CUDA version ("13.0") from include/cuda.h, or None if unreadable."""
    try:
        with open(os.path.join(cuda_home, "include", "cuda.h"), errors="replace") as f:
            for line in f:
                if line.startswith("#define CUDA_VERSION"):
                    code = int(line.split()[2])
                    return f"{code // 1000}.{code % 1000 // 10}"
    except (OSError, ValueError, IndexError):
        pass
    return None


def find_problems(torch_build: TorchBuild | str, env, cutlass_include=None) -> tuple[str | None, list[str]]:
    """(CUDA home to build with, problems): every missing prerequisite, each with how to get it.

    ``torch_build`` is ``installed_torch()``'s answer, ``env`` the environment
    (a mapping), ``cutlass_include`` a callable returning the CUTLASS include
    directory or raising ``CutlassNotFound`` (default: the locator, reading ``env``).
    """
    problems: list[str] = []
    cuda_home = None
    if isinstance(torch_build, str):
        problems.append(
            f"PyTorch is not importable ({torch_build}): install a CUDA build of torch >= "
            f"{'.'.join(map(str, MIN_TORCH))}, e.g. pip install 'torch>=2.9', then build with "
            f"pip install --no-build-isolation (pip's isolated build environment holds no torch)"
        )
    else:
        if _version_tuple(torch_build.version) < MIN_TORCH:
            problems.append(
                f"torch {torch_build.version} is older than {'.'.join(map(str, MIN_TORCH))}: "
                f"pip install --upgrade 'torch>=2.9'"
            )
        if torch_build.cuda is None:
            problems.append(
                f"torch {torch_build.version} is a CPU-only build: install a CUDA build of torch "
                f"(PyPI's Linux x86_64 wheels are CUDA builds). Without a GPU, {CPU_ONLY_ENV}=1 installs "
                f"the Python package without the extension"
            )
    set_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if set_home:
        cuda_home, origin = set_home, f"CUDA_HOME={set_home}"
    elif not isinstance(torch_build, str) and torch_build.cuda_home_guess:
        cuda_home, origin = torch_build.cuda_home_guess, f"CUDA_HOME is not set; torch guessed {torch_build.cuda_home_guess}"
    else:
        cuda_home, origin = None, "CUDA_HOME is not set and torch found no CUDA toolkit"
    if cuda_home is None:
        problems.append(
            f"no CUDA toolkit: {origin}. Install the CUDA toolkit (nvcc and headers) and "
            f"export CUDA_HOME=/usr/local/cuda (the directory holding bin/nvcc)"
        )
    else:
        missing = [p for p in ("bin/nvcc", "include/cuda_runtime_api.h")
                   if not os.path.isfile(os.path.join(cuda_home, *p.split("/")))]
        if missing:
            problems.append(
                f"the CUDA toolkit at {cuda_home} has no {' and no '.join(missing)} ({origin}): "
                f"export CUDA_HOME=<the toolkit's directory, e.g. /usr/local/cuda>"
            )
            cuda_home = None
        elif not isinstance(torch_build, str) and torch_build.cuda:
            have = toolkit_version(cuda_home)
            if have is not None and have.split(".")[0] != torch_build.cuda.split(".")[0]:
                problems.append(
                    f"the CUDA toolkit at {cuda_home} is CUDA {have}, but torch {torch_build.version} is built "
                    f"with CUDA {torch_build.cuda}: use a toolkit of the same major version (CUDA_HOME) "
                    f"or a torch build for CUDA {have.split('.')[0]}"
                )
    if cutlass_include is None:
        def cutlass_include():
            return cutlass_locator.include_dir(env)
    try:
        cutlass_include()
    except cutlass_locator.CutlassNotFound as exc:
        problems.append(str(exc))
    return cuda_home, problems


variants = _load("dash_fa3_variants_build", ROOT / "dash_fa3" / "variants.py")
contract = _load("dash_fa3_contract_build", ROOT / "dash_fa3" / "schedule" / "contract.py")
cutlass_locator = _load("dash_fa3_cutlass_locator", ROOT / "third_party" / "cutlass_locator.py")

# Sources compiled into every build, whatever the variant selection.
COMMON_SOURCES = [
    "csrc/api/binding.cpp",
    "csrc/api/checks.cpp",
    "csrc/api/fwd_dispatch.cpp",
    "csrc/api/bwd_dispatch.cpp",
    "csrc/api/bwd_pre_post.cpp",
    "csrc/api/bwd_workspace.cpp",
    "csrc/kernels/fwd/fwd_packed_order.cu",
    "csrc/kernels/bwd/bwd_preprocess.cu",
    "csrc/kernels/bwd/bwd_postprocess.cu",
]

DTYPE_ENUM = {"bf16": "kBF16", "fp16": "kFP16"}


# Measurement builds (never the default): environment variable -> what it
# defines for every translation unit. DASH_FA3_BWD_FIXED_STEPS=1: the backward
# without per-step schedule reads and without the deterministic mode's
# semaphore code (kernels/bwd/bwd_traits.h, kFixedSteps); such a build refuses
# deterministic calls. DASH_FA3_BWD_TRACE=1: the backward records per-step
# timestamps of its dQ hand-offs into buffers of BwdParams
# (kernels/bwd/bwd_trace.h); only the C++ harness (benchmarks/cpp/bwd_bench.cu
# trace) passes them.
MEASUREMENT_KNOBS = {"DASH_FA3_BWD_FIXED_STEPS": ("0", "1"), "DASH_FA3_BWD_TRACE": ("0", "1")}


def measurement_defines(env=None) -> list[str]:
    """-D flags for the measurement knobs set in env (default os.environ); rejects bad values."""
    env = os.environ if env is None else env
    flags = []
    for name, allowed in MEASUREMENT_KNOBS.items():
        value = env.get(name, "0") or "0"
        if value not in allowed:
            raise SystemExit(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        if value != "0":
            flags.append(f"-D{name}={value}")
    return flags


_MEASUREMENT_DEFINES = measurement_defines()

CXX_FLAGS = ["-O3", "-std=c++17", "-DNDEBUG", *_MEASUREMENT_DEFINES]

NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-DNDEBUG",
    "-gencode=arch=compute_90a,code=sm_90a",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-lineinfo",
    # Spills and local memory are performance bugs here: make ptxas say so.
    "-Xptxas=--warn-on-spills,--warn-on-local-memory-usage",
    # torch's defaults disable the half/bf16 operators that CUTLASS relies on.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    *_MEASUREMENT_DEFINES,
]


DIRECTIONS = {
    # direction: (launch header, params type)
    "fwd": ("kernels/fwd/fwd_launch.cuh", "FwdParams"),
    "bwd": ("kernels/bwd/bwd_launch.cuh", "BwdParams"),
}


def instantiated(direction: str, v) -> bool:
    return direction == "fwd" or v.has_bwd


def instantiation_name(direction: str, v, layout: str = "dense", softcap: bool = False) -> str:
    suffix = ("" if layout == "dense" else f"_{layout}") + ("_softcap" if softcap else "")
    return f"{direction}_{v.hdims}_{v.dtype}_{v.mask}{suffix}.cu"


def _cpp_bool(flag: bool) -> str:
    return "true" if flag else "false"


def instantiation_source(direction: str, v, layout: str = "dense", softcap: bool = False) -> str:
    header, params = DIRECTIONS[direction]
    return (
        "// Generated by tools/build_config.py from dash_fa3/variants.py. Do not edit.\n"
        f'#include "{header}"\n\n'
        f"template void dash_fa3::run_{direction}<{v.hdim}, {v.hdim_v}, dash_fa3::DType::{DTYPE_ENUM[v.dtype]}, "
        f"dash_fa3::MaskKind::{variants.MASK_CPP[v.mask]}, /*kPacked=*/{_cpp_bool(layout == 'packed')}, "
        f"/*kSoftcap=*/{_cpp_bool(softcap)}>(\n"
        f"    const dash_fa3::{params}&, cudaStream_t);\n"
    )


def instantiations(selected, layouts=variants.LAYOUTS,
                   softcaps=variants.SOFTCAP_AXIS) -> list[tuple[str, object, str, bool]]:
    """(direction, variant, layout, softcap) compiled for ``selected`` in ``layouts`` x ``softcaps``
    (the kernel families: variants.LAYOUTS x variants.SOFTCAP_AXIS)."""
    return [(d, v, layout, softcap) for softcap in softcaps for layout in layouts for d in DIRECTIONS
            for v in selected if instantiated(d, v)]


def table_macro(direction: str) -> str:
    """The X-macro of one direction's compiled kernels (csrc/api/*_dispatch.cpp expand it)."""
    return f"DASH_FA3_FOR_EACH_{direction.upper()}_KERNEL"


def variant_table_source(selected, layouts=variants.LAYOUTS, softcaps=(False,)) -> str:
    lines = [
        "// Generated by tools/build_config.py from dash_fa3/variants.py for this build. Do not edit.",
        "#pragma once",
        "",
    ]
    for direction in DIRECTIONS:
        lines += [
            "",
            f"// X(head dim, value head dim, DType enumerator, MaskKind enumerator, packed, softcap, \"variant name\") for every "
            f"compiled {direction} kernel.",
            f"#define {table_macro(direction)}(X) \\",
        ]
        for d, v, layout, softcap in instantiations(selected, layouts, softcaps):
            if d == direction:
                lines.append(f'  X({v.hdim}, {v.hdim_v}, {DTYPE_ENUM[v.dtype]}, {variants.MASK_CPP[v.mask]}, '
                             f'{_cpp_bool(layout == "packed")}, {_cpp_bool(softcap)}, "{v.name}") \\')
        lines.append("")
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, text: str) -> None:
    # Unchanged files keep their timestamps, so ninja does not rebuild them.
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_instantiations() -> None:
    """(Re)write the instantiation file of every known variant and family (they are checked in)."""
    for inst in instantiations(variants.ALL_VARIANTS):
        write_if_changed(INSTANTIATIONS / instantiation_name(*inst), instantiation_source(*inst))


def write_contract_header(directory: Path) -> Path:
    """Write kernel_contract.h (the C++ form of dash_fa3/schedule/contract.py) into ``directory``."""
    path = Path(directory) / "kernel_contract.h"
    write_if_changed(path, contract.cpp_header())
    return path


def write_generated(directory: Path, selected, layouts=variants.LAYOUTS, softcaps=(False,)) -> None:
    """The generated headers a build of ``selected`` in ``layouts`` x ``softcaps`` includes: variant_table.h
    and kernel_contract.h."""
    write_if_changed(Path(directory) / "variant_table.h", variant_table_source(selected, layouts, softcaps))
    write_contract_header(directory)


def prepare(selected, layouts=None, softcaps=None) -> list[str]:
    """Write generated files for ``selected`` in ``layouts`` (default: ``variants.select_layouts()``)
    x ``softcaps`` (default: ``variants.select_softcap()``) and return the sources to compile (repo-relative)."""
    if layouts is None:
        layouts = variants.select_layouts()
    if softcaps is None:
        softcaps = variants.select_softcap()
    write_instantiations()
    write_generated(GENERATED, selected, layouts, softcaps)
    return COMMON_SOURCES + [f"csrc/instantiations/{instantiation_name(*inst)}"
                             for inst in instantiations(selected, layouts, softcaps)]


def include_dirs() -> list[str]:
    return [str(CSRC), str(GENERATED), cutlass_locator.include_dir()]
