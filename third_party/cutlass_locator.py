"""Where the CUTLASS/CuTe headers come from: the ``nvidia-cutlass`` wheel.

The version is pinned here (the README's install command and .ci/run name it too); no sources
are vendored. Only the extension build needs the headers: a CPU-only install does not.
``include_dir()`` raises ``CutlassNotFound`` with the install command when the
headers are missing or the installed wheel is not the pinned version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

PINNED_VERSION = "4.2.0.0"
PIP_SPEC = f"nvidia-cutlass=={PINNED_VERSION}"
ENV_OVERRIDE = "DASH_FA3_CUTLASS_INCLUDE"


class CutlassNotFound(RuntimeError):
    pass


def include_dir(env=None) -> str:
    """The directory that holds ``cute/`` and ``cutlass/``.

    ``$DASH_FA3_CUTLASS_INCLUDE`` overrides the wheel (for a CUTLASS checkout);
    it must still contain both header trees. ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    override = env.get(ENV_OVERRIDE)
    if override:
        _check_tree(override, f"${ENV_OVERRIDE}")
        return override

    package_dir = wheel_package_dir()
    if package_dir is None:
        raise CutlassNotFound(
            "CUTLASS headers not found: the 'nvidia-cutlass' wheel is not installed. "
            f"Install it with: pip install '{PIP_SPEC}' (or point ${ENV_OVERRIDE} at a CUTLASS include directory)"
        )
    version = importlib.metadata.version("nvidia-cutlass")
    if version != PINNED_VERSION:
        raise CutlassNotFound(
            f"nvidia-cutlass {version} is installed, but dash_fa3 is pinned to {PINNED_VERSION}. "
            f"Install it with: pip install '{PIP_SPEC}'"
        )
    path = os.path.join(package_dir, "source", "include")
    _check_tree(path, f"nvidia-cutlass {version}")
    return path


def wheel_package_dir() -> str | None:
    """The installed ``cutlass_library`` package's directory, or None without the wheel."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _check_tree(path: str, origin: str) -> None:
    for sub in ("cute/tensor.hpp", "cutlass/cutlass.h"):
        if not os.path.isfile(os.path.join(path, sub)):
            raise CutlassNotFound(
                f"{origin}: {path} has no {sub}; expected the CUTLASS include tree. "
                f"Reinstall with: pip install --force-reinstall '{PIP_SPEC}'"
            )
