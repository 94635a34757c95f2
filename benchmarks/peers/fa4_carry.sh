#!/usr/bin/env bash
# FA4 (the `flash-attn-4` package and its CuTe DSL) for a GPU machine without a network, from the
# package registry (never vendored), over two calls of one warm machine:
#
#   bash benchmarks/peers/fa4_carry.sh prepare   # here: the pinned wheels for Python 3.12 into
#                                                #   carry/fa4/wheels/ (about 10 MB) and the DSL's CUDA 13
#                                                #   library wheel, unpacked and xz'd (61 MiB), in two
#                                                #   halves carry/fa4/cu13/part0 and part1 with parts.sha256
#   bash benchmarks/peers/fa4_carry.sh unpack    # there: keeps the halves that came (in SITE.parts)
#                                                #   and unpacks, once both are there, into build/fa4_site
#
# A carry and the working tree travel within 64 MiB, so the library's 61 MiB goes in halves beside
# the other carries of each call.
# (FA4_CARRY and FA4_SITE override carry/fa4 and build/fa4_site.)
#
# On the GPU machine: one call with carry ["carry/fa4/cu13/part0", "carry/fa4/cu13/parts.sha256", ...]
# running `unpack`, then, while the machine is warm (it keeps ignored paths such as build/ between
# calls), the next call with carry ["carry/fa4/cu13/part1", "carry/fa4/cu13/parts.sha256",
# "carry/fa4/wheels", ...] running `unpack` again and the benchmark with
# PYTHONPATH=build/fa4_site (peers/fa4.py puts the DSL's dsl_packages on sys.path, which a .pth
# file would otherwise do). FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 keeps FA4's compiled kernels
# for the calls after. The versions are those of docs/journal/peers.md (FA4 on the grid, 0984fe6).
set -euo pipefail
cd "$(dirname "$0")/../.."
PINS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
      nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2
      torch-c-dlpack-ext==0.1.5 einops==0.8.2)
CU13=nvidia-cutlass-dsl-libs-cu13==4.8.1
C=${FA4_CARRY:-carry/fa4}
SITE=${FA4_SITE:-build/fa4_site}

download() {  # dir, requirement...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dir" "$@"
}

case "${1:-}" in
  prepare)
    rm -rf "$C" && mkdir -p "$C/wheels" "$C/cu13"
    download "$C/wheels" "${PINS[@]}"
    tmp=$(mktemp -d)
    download "$tmp" "$CU13"
    mkdir "$tmp/site"
    python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/site"
    tar -cf - -C "$tmp/site" . | xz -T0 -8 > "$tmp/libs_cu13.tar.xz"
    size=$(stat -c %s "$tmp/libs_cu13.tar.xz")
    split -b $(( (size + 1) / 2 )) -d -a 1 "$tmp/libs_cu13.tar.xz" "$C/cu13/part"
    ( cd "$C/cu13" && sha256sum part0 part1 > parts.sha256 )
    rm -rf "$tmp"
    du -sh "$C/wheels" "$C/cu13"
    ;;
  unpack)
    mkdir -p "$SITE" "$SITE.parts"
    found=0
    for part in "$C"/cu13/part? "$C"/cu13/parts.sha256; do
      [ -f "$part" ] && { cp "$part" "$SITE.parts/"; found=1; }
    done
    if [ -f "$SITE.parts/parts.sha256" ]; then
      missing=$(cd "$SITE.parts" && awk '{print $2}' parts.sha256 | while read -r f; do [ -f "$f" ] || echo "$f"; done)
      if [ -z "$missing" ]; then
        ( cd "$SITE.parts" && sha256sum --quiet -c parts.sha256 ) || { echo "a part of the cu13 library is damaged" >&2; exit 1; }
        cat "$SITE.parts"/part? | tar -xJf - -C "$SITE"
        echo "cu13 library unpacked"
      else
        echo "cu13 library: waiting for" $missing
      fi
    fi
    if ls "$C"/wheels/*.whl >/dev/null 2>&1; then
      # Unzipped, not pip-installed: the DSL's wheels share the nvidia_cutlass_dsl folder, which
      # `pip install --target --upgrade` would replace wheel by wheel.
      for w in "$C"/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
      found=1
    fi
    [ "$found" = 1 ] || { echo "nothing to unpack in $C: carry its cu13/ or wheels/" >&2; exit 2; }
    ls "$SITE"
    ;;
  *)
    echo "usage: $0 prepare|unpack" >&2
    exit 2
    ;;
esac
