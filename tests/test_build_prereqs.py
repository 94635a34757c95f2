"""setup.py's prerequisite check, on faked torch builds, environments and toolkits (CPU, nothing is built)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_config  # noqa: E402

CUDA_TORCH = build_config.TorchBuild("2.11.0+cu130", "13.0", None)


def toolkit(root, *, nvcc=True, header=True, version=13000):
    """A fake CUDA toolkit directory with the files the check looks for."""
    os.makedirs(os.path.join(root, "bin"), exist_ok=True)
    os.makedirs(os.path.join(root, "include"), exist_ok=True)
    if nvcc:
        open(os.path.join(root, "bin", "nvcc"), "w").close()
    if header:
        open(os.path.join(root, "include", "cuda_runtime_api.h"), "w").close()
    with open(os.path.join(root, "include", "cuda.h"), "w") as f:
        f.write(f"#pragma once\n#define CUDA_VERSION {version}\n")
    return str(root)


def cutlass_tree(root):
    for sub in ("cute/tensor.hpp", "cutlass/cutlass.h"):
        os.makedirs(os.path.join(root, os.path.dirname(sub)), exist_ok=True)
        open(os.path.join(root, sub), "w").close()
    return str(root)


@pytest.fixture
def good_env(tmp_path):
    return {"CUDA_HOME": toolkit(tmp_path / "cuda"), build_config.cutlass_locator.ENV_OVERRIDE: cutlass_tree(tmp_path / "cutlass")}


def test_complete_setup_passes(good_env):
    home, problems = build_config.find_problems(CUDA_TORCH, good_env)
    assert problems == [] and home == good_env["CUDA_HOME"]


def test_cuda_home_unset_and_torch_guess_without_headers(tmp_path, good_env):
    # The reported failure: CUDA_HOME unset, torch guesses /usr/local from an nvcc on PATH.
    env = {k: v for k, v in good_env.items() if k != "CUDA_HOME"}
    guess = toolkit(tmp_path / "usr_local", header=False)
    home, problems = build_config.find_problems(build_config.TorchBuild("2.11.0", "13.0", guess), env)
    assert home is None and len(problems) == 1
    assert "CUDA_HOME is not set" in problems[0] and "cuda_runtime_api.h" in problems[0] and guess in problems[0]


def test_cuda_home_unset_with_a_valid_guess_builds_with_the_guess(tmp_path, good_env):
    env = {k: v for k, v in good_env.items() if k != "CUDA_HOME"}
    guess = toolkit(tmp_path / "cuda-13.0")
    assert build_config.find_problems(build_config.TorchBuild("2.12.0", "13.0", guess), env) == (guess, [])


def test_no_toolkit_at_all(good_env):
    env = {k: v for k, v in good_env.items() if k != "CUDA_HOME"}
    home, problems = build_config.find_problems(CUDA_TORCH, env)
    assert home is None and len(problems) == 1 and "no CUDA toolkit" in problems[0] and "CUDA_HOME" in problems[0]


@pytest.mark.parametrize("missing", ["nvcc", "header"])
def test_cuda_home_pointing_at_an_incomplete_directory(tmp_path, good_env, missing):
    good_env["CUDA_HOME"] = toolkit(tmp_path / "partial", **{missing: False})
    home, problems = build_config.find_problems(CUDA_TORCH, good_env)
    want = "bin/nvcc" if missing == "nvcc" else "include/cuda_runtime_api.h"
    assert home is None and len(problems) == 1 and want in problems[0] and "CUDA_HOME=" in problems[0]


def test_toolkit_major_version_must_match_torch(tmp_path, good_env):
    good_env["CUDA_HOME"] = toolkit(tmp_path / "cuda12", version=12080)
    _, problems = build_config.find_problems(CUDA_TORCH, good_env)
    assert len(problems) == 1 and "CUDA 12.8" in problems[0] and "CUDA 13.0" in problems[0]


def test_cpu_only_torch(good_env):
    _, problems = build_config.find_problems(build_config.TorchBuild("2.11.0+cpu", None, None), good_env)
    assert len(problems) == 1 and "CPU-only build" in problems[0] and build_config.CPU_ONLY_ENV in problems[0]


def test_torch_missing_or_too_old(good_env):
    _, problems = build_config.find_problems("ModuleNotFoundError: No module named 'torch'", good_env)
    assert len(problems) == 1 and "not importable" in problems[0] and "torch>=2.9" in problems[0]
    _, problems = build_config.find_problems(build_config.TorchBuild("2.8.1", "12.8", None), good_env)
    assert any("older than 2.9" in p for p in problems)


@pytest.mark.parametrize("version", ["2.9.0", "2.11.0+cu130", "2.15.0", "3.0.0a0", "2.10.0.dev20260101"])
def test_supported_torch_versions_pass(good_env, version):
    assert build_config.find_problems(build_config.TorchBuild(version, "13.0", None), good_env)[1] == []


def test_no_cutlass_wheel(good_env, monkeypatch):
    del good_env[build_config.cutlass_locator.ENV_OVERRIDE]
    monkeypatch.setattr(build_config.cutlass_locator, "wheel_package_dir", lambda: None)
    _, problems = build_config.find_problems(CUDA_TORCH, good_env)
    assert len(problems) == 1 and "nvidia-cutlass" in problems[0] and "pip install" in problems[0]


def test_cutlass_override_without_headers(tmp_path, good_env):
    good_env[build_config.cutlass_locator.ENV_OVERRIDE] = str(tmp_path)
    _, problems = build_config.find_problems(CUDA_TORCH, good_env)
    assert len(problems) == 1 and "cute/tensor.hpp" in problems[0]


def test_every_problem_is_listed_at_once(monkeypatch):
    monkeypatch.setattr(build_config.cutlass_locator, "wheel_package_dir", lambda: None)
    _, problems = build_config.find_problems(build_config.TorchBuild("2.11.0+cpu", None, None), {})
    assert len(problems) == 3  # CPU-only torch, no toolkit, no CUTLASS


def test_setup_py_stops_before_compiling(tmp_path):
    # The real setup.py in a fresh process, with CUDA_HOME pointing at an empty directory.
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "CUDA_PATH": ""}
    env.pop(build_config.CPU_ONLY_ENV, None)
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    assert "cannot build dash_fa3" in res.stderr and "bin/nvcc" in res.stderr and "Traceback" not in res.stderr


def test_setup_py_cpu_only_builds_no_extension(tmp_path):
    env = {**os.environ, "CUDA_HOME": str(tmp_path), build_config.CPU_ONLY_ENV: "1"}
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "dash_fa3"


def test_no_exact_torch_pin():
    text = open(os.path.join(ROOT, "pyproject.toml")).read() + open(os.path.join(ROOT, "setup.py")).read()
    assert "torch==" not in text and "torch>=2.9" in text


def test_measurement_knobs_default_off_and_checked():
    assert build_config.measurement_defines({}) == []
    assert build_config.measurement_defines({"DASH_FA3_BWD_FIXED_STEPS": "0"}) == []
    assert build_config.measurement_defines({"DASH_FA3_BWD_FIXED_STEPS": "1"}) == ["-DDASH_FA3_BWD_FIXED_STEPS=1"]
    with pytest.raises(SystemExit, match="DASH_FA3_BWD_FIXED_STEPS='yes'"):
        build_config.measurement_defines({"DASH_FA3_BWD_FIXED_STEPS": "yes"})
    if "DASH_FA3_BWD_FIXED_STEPS" not in os.environ:  # the default build's flags define nothing
        assert not any("FIXED_STEPS" in f for f in build_config.NVCC_FLAGS + build_config.CXX_FLAGS)


def _setup_kwargs(extra_code: str = "") -> dict:
    """setup()'s keyword arguments from the real setup.py (CPU-only) in a fresh process, after
    ``extra_code``; the values that are not JSON come back as their repr."""
    code = (f"{extra_code}\nimport json, setuptools\n"
            "setuptools.setup = lambda **kw: print('KW=' + json.dumps(kw, default=repr))\n"
            "__file__ = 'setup.py'\nexec(compile(open('setup.py').read(), 'setup.py', 'exec'))\n")
    env = {**os.environ, build_config.CPU_ONLY_ENV: "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.split("KW=", 1)[1])


def test_cpu_only_setup_needs_neither_torch_nor_cutlass():
    # Both made unimportable: a CPU-only install must get through setup.py without them.
    kw = _setup_kwargs("import sys; sys.modules['torch'] = None; sys.modules['cutlass_library'] = None")
    assert kw["name"] == "dash_fa3" and kw["ext_modules"] == []


def test_test_extra_is_light_and_frameworks_are_their_own_extras():
    extras = _setup_kwargs()["extras_require"]
    names = {e: {req.split(";")[0].split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip() for req in reqs}
             for e, reqs in extras.items()}
    assert names["test"] == {"pytest", "hypothesis"} and names["plots"] == {"matplotlib"}
    for extra, package in (("transformers", "transformers"), ("torchtitan", "torchtitan"),
                           ("megatron", "megatron-core")):
        assert names[extra] == {package}
        assert set(extras[extra]) <= set(extras["frameworks"])
    assert names["frameworks"] == {"transformers", "torchtitan", "megatron-core"}
    assert not any("cutlass" in req for reqs in extras.values() for req in reqs)
    assert all("cutlass" not in req and "torch==" not in req for req in _setup_kwargs()["install_requires"])
