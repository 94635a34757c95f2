"""Where the forward's softmax sits in the machine code: exp2s between the S wait and the PV wait.

    python tools/sass_softmax.py OBJECT_OR_SO [--cuobjdump PATH] [--match fwd_kernel]

In each key-block step the MMA warpgroup waits for S = Q K^T
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`), runs the softmax, and waits for the PV
GEMM (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) before it writes the new P. The exp2s
(`MUFU.EX2`) that ptxas leaves between those two waits are the ones that
overlap the warpgroup's own PV GEMM; the source puts all of them there, ptxas
decides how many stay. This prints that count for every such pair of waits of
every forward kernel, e.g. `0` (none) or `66 66` (two loop bodies, 66 each).

Needs a cuobjdump that reads sm_90a cubins. The CUDA toolkit has one; without
it: `pip download --no-deps nvidia-cuda-cuobjdump`, unzip the wheel and pass
`--cuobjdump <dir>/nvidia/cu13/bin/cuobjdump` (no GPU needed). Objects come
from `benchmarks/cpp/build.py` (carry/<dir>/obj/*.o) or the extension's .so.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

from ptxas_report import demangle

FUNCTION = re.compile(r"Function : (\S+)")
S_WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x1"
PV_WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x0"


def exp2_between_waits(sass: str, name_filter: str = "fwd_kernel") -> dict[str, list[int]]:
    """Per kernel whose name contains name_filter: the MUFU.EX2 count of each S-wait .. PV-wait span."""
    counts: dict[str, list[int]] = {}
    kernel, inside, n = None, False, 0
    for line in sass.splitlines():
        if m := FUNCTION.search(line):
            kernel = m.group(1) if name_filter in m.group(1) else None
            inside = False
            continue
        if kernel is None:
            continue
        if S_WAIT in line:
            inside, n = True, 0
        elif inside and "MUFU.EX2" in line:
            n += 1
        elif inside and PV_WAIT in line:
            counts.setdefault(kernel, []).append(n)
            inside = False
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="an object file, cubin or shared library with sm_90a code")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="path to cuobjdump (default: on PATH)")
    ap.add_argument("--match", default="fwd_kernel", help="substring of the mangled kernel names to report")
    args = ap.parse_args(argv)
    if not args.cuobjdump:
        print("no cuobjdump on PATH; see --help for one that needs no GPU", file=sys.stderr)
        return 2
    proc = subprocess.run([args.cuobjdump, "-sass", args.binary], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr.strip(), file=sys.stderr)
        return 2
    counts = exp2_between_waits(proc.stdout, args.match)
    if not counts:
        print("no forward kernel with an S wait followed by a PV wait found", file=sys.stderr)
        return 1
    for name, pretty in zip(counts, demangle(list(counts))):
        print(f"{' '.join(map(str, counts[name])):>12}  {pretty}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
