"""Run FlashAttention-3's own output tests against dash_fa3's API.

    python benchmarks/peers/fa3_suite.py --src PATH [--tests output,varlen_output] [--junit FILE] [-- PYTEST_ARGS]

PATH is a flash-attention checkout (the folder holding hopper/). Its
hopper/test_flash_attn.py, test_util.py and padding.py are copied into a
temporary folder beside our ``flash_attn_interface`` shim
(fa3_interface_shim.py), and pytest runs the chosen test functions there:
``test_flash_attn_output`` and ``test_flash_attn_varlen_output`` by default.
The checkout is not modified and nothing of it enters the repository.

What is excluded, and how (printed with the run):
  * FA3's own switches (FLASH_ATTENTION_DISABLE_*) for what dash_fa3 does not
    offer: fp8, split-KV (num_splits > 1), packed GQA (pack_gqa=True),
    softcap on the GPU, paged and appended KV; and for the head dims and
    dtypes this build lacks (``dash_fa3._ext`` lists the built variants);
  * two loop lists inside the test functions, rewritten in the copy: the
    value head dims (``dv_vals``, dv != d is MLA, not offered) become [d],
    and ``attention_chunk_vals`` (chunked attention, not offered) becomes
    [0], so that the loop's supported iterations still run;
  * any other call dash_fa3 refuses (qv, seqused_q/k) skips its test with
    dash_fa3's message, through the shim.
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TESTS = {"output": "test_flash_attn_output", "varlen_output": "test_flash_attn_varlen_output"}
COPIED = ("test_flash_attn.py", "test_util.py", "padding.py")
# Features dash_fa3 does not offer, by FA3's switch names.
NOT_OFFERED = ("FP8", "SPLIT", "PACKGQA", "PAGEDKV", "APPENDKV")
HDIMS = (64, 96, 128, 192, 256)

# The test functions' loop lists that name unsupported values (see the docstring).
REWRITES = (
    (re.compile(r"^(\s*)dv_vals = \[.*$", re.M), r"\1dv_vals = [d]  # dash_fa3 suite: dv == d only"),
    (re.compile(r"^(\s*)attention_chunk_vals = \[.*$", re.M),
     r"\1attention_chunk_vals = [0]  # dash_fa3 suite: no chunked attention"),
)


def rewrite_test_source(text: str) -> str:
    """The test file with REWRITES applied; raises if a list is not where this adapter expects it."""
    for pattern, repl in REWRITES:
        text, count = pattern.subn(repl, text)
        if count == 0:
            raise SystemExit(f"fa3_suite: no line matching {pattern.pattern!r} in test_flash_attn.py; "
                             f"this adapter does not know the checkout's test layout")
    return text


def disable_switches(built_variants, softcap_variants=()) -> dict[str, str]:
    """FLASH_ATTENTION_DISABLE_* for what dash_fa3 does not offer or this build lacks;
    softcap stays in the tests when ``softcap_variants`` (built with DASH_FA3_SOFTCAP=1) has
    every one of ``built_variants``."""
    env = {f"FLASH_ATTENTION_DISABLE_{name}": "TRUE" for name in NOT_OFFERED}
    if not set(built_variants) <= set(softcap_variants):
        env["FLASH_ATTENTION_DISABLE_SOFTCAP"] = "TRUE"
    names = set(built_variants)
    for hdim in HDIMS:
        if not any(v.startswith(f"hdim{hdim}-") for v in names):
            env[f"FLASH_ATTENTION_DISABLE_HDIM{hdim}"] = "TRUE"
    if not any("-fp16-" in v for v in names):
        env["FLASH_ATTENTION_DISABLE_FP16"] = "TRUE"
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="flash-attention checkout (holding hopper/)")
    ap.add_argument("--tests", default="output,varlen_output", help=f"comma list of {', '.join(TESTS)}")
    ap.add_argument("--junit", help="write pytest's JUnit XML here")
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hopper = os.path.join(args.src, "hopper")
    missing = [f for f in COPIED if not os.path.isfile(os.path.join(hopper, f))]
    if missing:
        print(f"fa3_suite: {hopper} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    unknown = [t for t in args.tests.split(",") if t not in TESTS]
    if unknown:
        print(f"fa3_suite: unknown --tests {unknown}; choose from {list(TESTS)}", file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    from dash_fa3 import _ext  # noqa: E402  (needs the built extension)

    built = sorted(set(_ext.built_variants("fwd")) & set(_ext.built_variants("fwd", packed=True)))
    softcap = set(_ext.built_variants("fwd", softcap=True)) & set(_ext.built_variants("fwd", True, True))
    env = dict(os.environ, **disable_switches(built, softcap))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="dash_fa3_fa3_suite_") as tmp:
        for name in COPIED:
            with open(os.path.join(hopper, name)) as f:
                text = f.read()
            with open(os.path.join(tmp, name), "w") as f:
                f.write(rewrite_test_source(text) if name == "test_flash_attn.py" else text)
        shutil.copy(os.path.join(HERE, "fa3_interface_shim.py"), os.path.join(tmp, "flash_attn_interface.py"))
        selected = " or ".join(TESTS[t] for t in args.tests.split(","))
        cmd = [sys.executable, "-m", "pytest", "test_flash_attn.py", "-k", selected, "-q", "-rfEs",
               "-p", "no:cacheprovider", "--rootdir", tmp]
        if args.junit:
            cmd += ["--junitxml", os.path.abspath(args.junit)]
        cmd += args.pytest_args
        switches = sorted(k for k, v in env.items() if k.startswith("FLASH_ATTENTION_DISABLE_") and v == "TRUE")
        print(f"# FA3 suite over dash_fa3: built {', '.join(built)}; switches {', '.join(switches)}; "
              f"rewritten in the copy: dv_vals = [d], attention_chunk_vals = [0]", flush=True)
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
