"""Build upstream FlashAttention-3 (the hopper/ folder of Dao-AILab/flash-attention)
as a benchmark peer, from a source checkout you point at, into an ignored folder.

    python benchmarks/peers/build_fa3.py --src PATH [--hdims 64,128] [--features varlen,local,softcap]
                                         [--build-dir build/peers/fa3] [--if-needed] [--dry-run]

PATH is the checkout's root (the folder holding hopper/). Nothing of FA3 enters
the repository and the checkout is left untouched: hopper/ is copied into the
build folder and built there with FA3's own setup.py
(`python setup.py build_ext --inplace`), restricted by FA3's own
FLASH_ATTENTION_DISABLE_* switches to sm90, bf16, forward + backward and the
head dims asked for; every other feature is off unless named in --features.
The CUTLASS headers come from the nvidia-cutlass wheel (third_party/cutlass_locator.py):
FA3's setup.py looks for them at ../csrc/cutlass/include from hopper/, so that
path is a symlink inside the build folder.

Layout of the build folder (default build/peers/fa3, ignored by git):
    README.md                 copy of the checkout's (FA3's setup.py reads ../README.md)
    csrc/cutlass/include      symlink to the wheel's CUTLASS include tree
    hopper/                   copy of the checkout's hopper/, built in place:
      flash_attn_interface.py   FA3's Python interface (import it with hopper/ on sys.path)
      flash_attn_3/_C.abi3.so   the extension (older FA3: hopper/flash_attn_3_cuda*.so)
      flash_attn_config.py      written by FA3's setup.py: which switches were off
      build/                    objects and ninja files
    fa3_build.json            what was built: commit, head dims, features, switches, time
    build.log                 FA3's build output

MAX_JOBS (default: CPU count) bounds parallel compiles; NVCC_THREADS (default 2)
is passed on to FA3's setup.py. Exit status 2 with a one-line error when the
checkout, nvcc or the CUTLASS headers are missing.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "third_party"))
import cutlass_locator  # noqa: E402

# The upstream commit our figures are taken against (the checkout given for
# testing is an export of it); a different checkout builds, with a warning.
PINNED_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
DEFAULT_BUILD_DIR = REPO / "build" / "peers" / "fa3"
BUILD_INFO = "fa3_build.json"

HDIMS = (64, 96, 128, 192, 256)
DEFAULT_HDIMS = (64, 128)
# --features name -> the FA3 switches (FLASH_ATTENTION_DISABLE_<X>) it leaves on.
# Every switch not named by a requested feature is set to TRUE (disabled).
FEATURES = {
    "varlen": ("VARLEN",),
    "local": ("LOCAL",),
    "softcap": ("SOFTCAP",),
    "fp16": ("FP16",),
    "fp8": ("FP8",),
    "split": ("SPLIT",),
    "paged": ("PAGEDKV",),
    "appendkv": ("APPENDKV",),
    "packgqa": ("PACKGQA",),
    "cluster": ("CLUSTER",),
    "sm80": ("SM80",),
    "hdimdiff": ("HDIMDIFF64", "HDIMDIFF192"),
    # Only (192, v 128), MLA's forward; needs hdim 192 (its backward runs the d = 192 kernel).
    "hdimdiff192": ("HDIMDIFF192",),
}


class BuildError(RuntimeError):
    """A one-line reason the build cannot start or failed."""


def switch_env(hdims, features, backward=True) -> dict[str, str]:
    """FA3's FLASH_ATTENTION_DISABLE_* variables for this selection, every one set
    explicitly so a stray variable in the caller's environment cannot widen or
    narrow the build."""
    env = {"FLASH_ATTENTION_DISABLE_BACKWARD": "FALSE" if backward else "TRUE"}
    kept = {s for f in features for s in FEATURES[f]}
    for switches in FEATURES.values():
        for s in switches:
            env[f"FLASH_ATTENTION_DISABLE_{s}"] = "FALSE" if s in kept else "TRUE"
    for d in HDIMS:
        env[f"FLASH_ATTENTION_DISABLE_HDIM{d}"] = "FALSE" if d in hdims else "TRUE"
    return env


def checkout_commit(src: Path) -> str:
    """HEAD of src when src is itself a git work tree's root, else the first word
    of src/COMMIT, else "unknown"."""
    try:
        top = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True)
        # A checkout exported into some other repository's tree must not report that repository's HEAD.
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == src.resolve():
            head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
            if head.returncode == 0 and head.stdout.strip():
                return head.stdout.strip()
    except FileNotFoundError:  # no git binary
        pass
    commit_file = src / "COMMIT"
    if commit_file.is_file():
        words = commit_file.read_text().split()
        if words:
            return words[0]
    return "unknown"


def is_pinned(commit: str) -> bool:
    """Whether `commit` names PINNED_COMMIT: the full hash, or an abbreviation of
    at least 7 hex digits (what a COMMIT file beside an exported tree may hold)."""
    c = commit.strip().lower()
    return len(c) >= 7 and all(ch in "0123456789abcdef" for ch in c) and PINNED_COMMIT.startswith(c)


def check_checkout(src: Path) -> None:
    if not src.is_dir():
        raise BuildError(f"FA3 checkout not found: {src} (pass --src PATH, the flash-attention repo root holding hopper/)")
    if not (src / "hopper" / "setup.py").is_file():
        raise BuildError(f"{src} is not a flash-attention checkout: it has no hopper/setup.py")


def find_nvcc() -> tuple[str, str]:
    """(CUDA home, nvcc version) as torch's extension builder will find the toolkit."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        if not (Path(home) / "bin" / "nvcc").is_file():
            raise BuildError(f"nvcc not found: CUDA_HOME={home} has no bin/nvcc")
    elif Path("/usr/local/cuda/bin/nvcc").is_file():
        # Before PATH: an nvcc on PATH may be a wrapper script outside any toolkit tree.
        home = "/usr/local/cuda"
    else:
        which = shutil.which("nvcc")
        if not which:
            raise BuildError("nvcc not found: set CUDA_HOME to a CUDA toolkit (e.g. /usr/local/cuda) or put nvcc on PATH")
        home = str(Path(which).resolve().parent.parent)
    out = subprocess.run([str(Path(home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return home, m.group(1) if m else "unknown"


def extension_module(hopper: Path) -> str:
    """The extension module the checkout's interface imports: flash_attn_3._C
    (current FA3) or flash_attn_3_cuda (older snapshots)."""
    text = (hopper / "flash_attn_interface.py").read_text() if (hopper / "flash_attn_interface.py").is_file() else ""
    return "flash_attn_3_cuda" if "import flash_attn_3_cuda" in text else "flash_attn_3._C"


def built_library(build_dir: Path) -> str | None:
    """Path of the built extension in build_dir, or None."""
    hopper = build_dir / "hopper"
    pattern = "flash_attn_3_cuda*.so" if extension_module(hopper) == "flash_attn_3_cuda" else "flash_attn_3/_C*.so"
    found = sorted(glob.glob(str(hopper / pattern)))
    return found[0] if found else None


def parse_list(text: str, allowed, kind: str, convert=str) -> tuple:
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = tuple(convert(x) for x in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--{kind}: {text!r} is not a comma list") from None
    bad = [v for v in values if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--{kind}: unknown {', '.join(map(str, bad))}; choose from {', '.join(map(str, allowed))}")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=os.environ.get("FA3_SRC"),
                    help="flash-attention checkout root (holds hopper/); default $FA3_SRC")
    ap.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR, help=f"default {DEFAULT_BUILD_DIR}")
    ap.add_argument("--hdims", type=lambda t: parse_list(t, HDIMS, "hdims", int), default=DEFAULT_HDIMS,
                    help="comma list of head dims to build (default 64,128)")
    ap.add_argument("--features", type=lambda t: parse_list(t, tuple(FEATURES), "features"), default=(),
                    help="comma list of FA3 features to keep on: " + ",".join(FEATURES) + " (default none)")
    ap.add_argument("--no-backward", action="store_true", help="forward only (FA3's DISABLE_BACKWARD)")
    ap.add_argument("--if-needed", action="store_true",
                    help="do nothing when the build folder already holds this commit and selection")
    ap.add_argument("--dry-run", action="store_true", help="print the environment and command, build nothing")
    args = ap.parse_args(argv)
    if not args.hdims:
        ap.error("--hdims: name at least one head dim")
    return args


def setup_command() -> list[str]:
    """`python setup.py build_ext --inplace`, through _run_setup.py where FA3's
    setup.py could not import the `wheel` package it needs only for packaging."""
    try:
        import wheel.bdist_wheel  # noqa: F401
        runner = "setup.py"
    except ImportError:
        runner = str(Path(__file__).resolve().parent / "_run_setup.py")
    return [sys.executable, runner, "build_ext", "--inplace"]


def plan(args) -> dict:
    """Everything the build needs, checked; raises BuildError with the reason."""
    if not args.src:
        raise BuildError("no FA3 checkout given: pass --src PATH (the flash-attention repo root holding hopper/) or set FA3_SRC")
    src = Path(args.src).resolve()
    check_checkout(src)
    cuda_home, nvcc_version = find_nvcc()
    try:
        cutlass_include = cutlass_locator.include_dir()
    except cutlass_locator.CutlassNotFound as exc:
        raise BuildError(str(exc)) from None
    build_dir = Path(args.build_dir).resolve()
    env = switch_env(args.hdims, args.features, not args.no_backward)
    env.update({
        "CUDA_HOME": cuda_home,
        "MAX_JOBS": os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1),
        "NVCC_THREADS": os.environ.get("NVCC_THREADS") or "2",
        # FA3's setup.py runs `git submodule update` from hopper/; stop git at the
        # build folder so it can never act on the repository that holds it.
        "GIT_CEILING_DIRECTORIES": str(build_dir),
    })
    return {
        "src": str(src), "commit": checkout_commit(src), "pinned_commit": PINNED_COMMIT,
        "build_dir": str(build_dir), "hdims": list(args.hdims), "features": list(args.features),
        "backward": not args.no_backward, "nvcc_version": nvcc_version, "cutlass_include": cutlass_include,
        "env": env, "command": setup_command(),
        "module": extension_module(src / "hopper"),
    }


def describe(p: dict) -> str:
    lines = [
        f"FA3 checkout: {p['src']}",
        f"FA3 commit:   {p['commit']} (pinned {p['pinned_commit']})",
        f"build dir:    {p['build_dir']} (builds in {p['build_dir']}/hopper, a copy of the checkout's hopper/)",
        f"CUTLASS:      {p['build_dir']}/csrc/cutlass/include -> {p['cutlass_include']}",
        f"nvcc:         {p['env']['CUDA_HOME']}/bin/nvcc (release {p['nvcc_version']})",
        f"selection:    hdims {','.join(map(str, p['hdims']))}, features {','.join(p['features']) or 'none'}, "
        f"{'fwd+bwd' if p['backward'] else 'fwd only'}, module {p['module']}",
        "environment:",
    ]
    lines += [f"  {k}={v}" for k, v in sorted(p["env"].items())]
    lines.append(f"command: cd {p['build_dir']}/hopper && {' '.join(p['command'])}")
    return "\n".join(lines)


def warnings_for(p: dict) -> list[str]:
    out = []
    if not is_pinned(p["commit"]):
        out.append(f"warning: FA3 checkout is at {p['commit']}, not the pinned {p['pinned_commit']}; "
                   "figures may not compare with earlier runs")
    major_minor = tuple(int(x) for x in p["nvcc_version"].split(".")) if p["nvcc_version"] != "unknown" else None
    if major_minor and major_minor < (13, 0) and major_minor != (12, 8):
        out.append(f"warning: nvcc {p['nvcc_version']}: FA3's setup.py downloads another nvcc for CUDA 12.x "
                   "other than 12.8, which fails without network")
    return out


def up_to_date(p: dict) -> bool:
    info_path = Path(p["build_dir"]) / BUILD_INFO
    if not info_path.is_file() or built_library(Path(p["build_dir"])) is None:
        return False
    info = json.loads(info_path.read_text())
    return all(info.get(k) == p[k] for k in ("commit", "hdims", "features", "backward"))


def prepare(p: dict) -> Path:
    """Copy hopper/ and README.md into the build folder and link the CUTLASS headers."""
    build_dir, src = Path(p["build_dir"]), Path(p["src"])
    build_dir.mkdir(parents=True, exist_ok=True)
    # copy2 keeps mtimes, so ninja recompiles only what changed since the last copy.
    shutil.copytree(src / "hopper", build_dir / "hopper", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("build", "*.so", "__pycache__", "*.egg-info"))
    readme = src / "README.md"
    if readme.is_file():
        shutil.copy2(readme, build_dir / "README.md")
    else:
        (build_dir / "README.md").write_text("FlashAttention-3 (benchmark peer build)\n")
    link = build_dir / "csrc" / "cutlass" / "include"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.is_symlink() and os.readlink(link) == p["cutlass_include"]:
            return build_dir / "hopper"
        if not link.is_symlink():
            raise BuildError(f"{link} exists and is not a symlink; remove it")
        link.unlink()
    link.symlink_to(p["cutlass_include"], target_is_directory=True)
    return build_dir / "hopper"


def build(p: dict) -> float:
    hopper = prepare(p)
    log_path = Path(p["build_dir"]) / "build.log"
    env = dict(os.environ, **p["env"])
    print("(FA3's setup.py runs `git submodule update`; the 'not a git repository' it prints is expected: "
          "GIT_CEILING_DIRECTORIES keeps git out of this repository)", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(p["command"], cwd=hopper, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(line)
        rc = proc.wait()
    seconds = time.perf_counter() - start
    if rc != 0:
        raise BuildError(f"FA3's setup.py failed (exit {rc}) after {seconds:.0f} s; see {log_path}")
    lib = built_library(Path(p["build_dir"]))
    if lib is None:
        raise BuildError(f"FA3's setup.py finished but no extension is in {hopper}; see {log_path}")
    info = {k: p[k] for k in ("commit", "pinned_commit", "src", "hdims", "features", "backward",
                              "nvcc_version", "cutlass_include", "module")}
    info.update(switches={k: v for k, v in p["env"].items() if k.startswith("FLASH_ATTENTION_")},
                library=os.path.relpath(lib, p["build_dir"]), seconds=round(seconds, 1),
                max_jobs=p["env"]["MAX_JOBS"], date=datetime.datetime.now().isoformat(timespec="seconds"))
    (Path(p["build_dir"]) / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
    return seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        p = plan(args)
        print(describe(p))
        for w in warnings_for(p):
            print(w, file=sys.stderr)
        if args.dry_run:
            return 0
        if args.if_needed and up_to_date(p):
            print(f"FA3 already built in {p['build_dir']}: {built_library(Path(p['build_dir']))}")
            return 0
        seconds = build(p)
    except BuildError as exc:
        print(f"error: build_fa3: {exc}", file=sys.stderr)
        return 2
    print(f"FA3 built in {seconds:.0f} s (MAX_JOBS={p['env']['MAX_JOBS']}): {built_library(Path(p['build_dir']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
