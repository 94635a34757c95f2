"""Per-kernel ptxas resource report (registers, spills, stack, shared memory).

Compiles the .cu translation units of the selected variants (DASH_FA3_VARIANTS)
with the extension's own nvcc flags plus -Xptxas -v, without a GPU, and prints
one row per kernel. Exit status 1 if a kernel fails to compile, spills or
uses a stack frame (except kernels matched by --allow-spills, whose spills are
known and reported), or if ptxas serialised its WGMMAs (C75xx "Potential
Performance Loss") or injected a WGMMA wait of its own (C7517).

    python tools/ptxas_report.py [--sources PATTERN ...] [--jobs N] [--allow-spills GLOB ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_config  # noqa: E402

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")
# --warn-on-spills / --warn-on-local-memory-usage name the function; the -v
# property lines of a kernel are not always next to its entry line, so these
# warnings are folded into the kernel's row as well.
WARN_STACK = re.compile(r"Local memory used for function '(\S+)', size of stack frame: (\d+) bytes")
# ptxas falls back to serialised WGMMAs (one in flight) when it cannot keep the
# asynchronous pipeline, e.g. under register pressure: a silent large slowdown.
# Two wordings seen: "... due to <reason> in the function '<k>'" (C7511) and
# "... due to <reason> for the function '<k>'" (C7512).
WGMMA_SERIAL = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                          r"due to (.*) (?:in|for) the function '(\S+)'")
# ptxas waits for a WGMMA earlier than the code does when a register the WGMMA
# writes is used before the code's wait (seen next to C7512, with a 30% loss).
WGMMA_WAIT = re.compile(r"\((C75\d\d)\) warpgroup.wait is injected in around line (\d+) by compiler .* in function '(\S+)'")
WARN_SPILL = re.compile(r"Registers are spilled to local memory in function '(\S+)', (\d+) bytes spill stores, "
                        r"(\d+) bytes spill loads")


def compile_one(src: str, outdir: str) -> tuple[str, float, int, str]:
    cmd = [build_config.nvcc(), *build_config.NVCC_FLAGS, "-Xptxas=-v"]
    cmd += [f"-I{d}" for d in build_config.include_dirs()]
    cmd += ["-c", str(build_config.ROOT / src), "-o", os.path.join(outdir, os.path.basename(src) + ".o")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, time.perf_counter() - start, proc.returncode, proc.stdout + proc.stderr


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def parse(log: str) -> list[dict]:
    rows, cur = [], None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            cur = {"kernel": m.group(1), "arch": m.group(2)}
            rows.append(cur)
        elif cur is not None and (m := PROPS.search(line)):
            cur.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        elif cur is not None and (m := USED.search(line)):
            cur.update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
    by_name = {r["kernel"]: r for r in rows}
    for line in log.splitlines():
        if (m := WARN_STACK.search(line)) and m.group(1) in by_name:
            row = by_name[m.group(1)]
            row["stack"] = max(row.get("stack", 0), int(m.group(2)))
        elif (m := WARN_SPILL.search(line)) and m.group(1) in by_name:
            row = by_name[m.group(1)]
            row["spill_st"] = max(row.get("spill_st", 0), int(m.group(2)))
            row["spill_ld"] = max(row.get("spill_ld", 0), int(m.group(3)))
        elif (m := WGMMA_SERIAL.search(line)) and m.group(3) in by_name:
            by_name[m.group(3)]["wgmma_serialized"] = f"{m.group(1)}: {m.group(2).strip()}"
        elif (m := WGMMA_WAIT.search(line)) and m.group(3) in by_name:
            by_name[m.group(3)]["wgmma_serialized"] = f"{m.group(1)}: wait injected near PTX line {m.group(2)}"
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", nargs="*", help="glob patterns over the .cu sources (default: all selected)")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
    ap.add_argument("--allow-spills", nargs="*", default=[], metavar="PATTERN",
                    help="demangled-name globs whose spills are known (reported, not failing)")
    args = ap.parse_args(argv)

    selected = build_config.variants.select()
    sources = [s for s in build_config.prepare(selected) if s.endswith(".cu")]
    if args.sources:
        sources = [s for s in sources if any(fnmatch.fnmatch(s, p) for p in args.sources)]
    if not sources:
        print("no .cu source matches", file=sys.stderr)
        return 1
    print(f"variants: {', '.join(v.name for v in selected)}\ncompiling {len(sources)} translation units, {args.jobs} jobs")
    failed = False
    spilled = False
    serialized = False
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for src, secs, rc, log in pool.map(lambda s: compile_one(s, tmp), sources):
            print(f"\n== {src}  ({secs:.0f} s)")
            if rc != 0:
                failed = True
                print(log[-4000:])
                continue
            rows = parse(log)
            for row, name in zip(rows, demangle([r["kernel"] for r in rows])):
                # A stack frame in these kernels means a register array went to local memory.
                spill = row.get("spill_st", 0) + row.get("spill_ld", 0) + row.get("stack", 0)
                allowed = any(fnmatch.fnmatch(name, p) for p in args.allow_spills)
                spilled |= spill > 0 and not allowed
                serialized |= "wgmma_serialized" in row
                print(
                    f"  regs {row.get('regs', '?'):>3}  smem {row.get('smem', 0):>6} B  stack {row.get('stack', 0):>4} B  "
                    f"spill st/ld {row.get('spill_st', 0)}/{row.get('spill_ld', 0)}{('  <-- SPILLS (known)' if allowed else '  <-- SPILLS') if spill else ''}  {name[:150]}"
                )
                if "wgmma_serialized" in row:
                    print(f"    <-- WGMMA SERIALIZED ({row['wgmma_serialized']})")
            for line in log.splitlines():
                if "warning" in line.lower():
                    print("  " + line.strip())
    if failed:
        print("\nFAILED: a translation unit did not compile")
    if serialized:
        print("\nWGMMA SERIALIZED: ptxas serialised the WGMMAs of at least one kernel")
    if spilled:
        print("\nSPILLS: at least one kernel spills registers or uses a stack frame")
    return 1 if failed or spilled or serialized else 0


if __name__ == "__main__":
    sys.exit(main())
