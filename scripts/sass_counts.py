#!/usr/bin/env python3
"""Static SASS instruction counts of the trainer's GEMM programs, by class, over the bare GEMM of the same
layout and tile: the code each program adds to the epilogue (fp32 arithmetic, special functions, shuffles,
shared and global memory, conversions, integer and address work). Static counts, not executed ones: an
unrolled chunk body counts once, and programs that batch column groups compile an interior body beside
the edge body, which doubles their figure. Reads the objects of a build (CODA_GEMM_PROGRAMS' generated
files); needs cuobjdump (CUDA toolkit, or the CUOBJDUMP environment variable).

    python3 scripts/sass_counts.py [BUILD_DIR] [TILE]     (defaults: build, Cooperative128x256)
"""
import collections
import os
import re
import shutil
import subprocess
import sys

CLASSES = [
    ("fp32", r"(FADD|FMUL|FFMA|FMNMX|FSETP|FSEL|FCHK|FSWZADD)"),
    ("mufu", r"MUFU"),
    ("shfl", r"SHFL"),
    ("smem", r"(LDS|STS|LDSM|STSM)"),
    ("gmem", r"(LDG|STG|RED|ATOM|UTMA|UBLKCP|LDGSTS)"),
    ("cvt", r"(F2F|F2FP|I2F|F2I|PRMT|HADD2|HMUL2|HFMA2)"),
    ("int", r"(U?IMAD|U?IADD3|U?LOP3|U?ISETP|U?SHF|U?LEA|IABS|IMNMX|U?SEL|U?MOV|S2R|CS2R|ULDC)"),
]
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def count(cuobjdump, path):
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in sass.splitlines():
        match = INSTRUCTION.match(line)
        if not match:
            continue
        counts["total"] += 1
        for name, pattern in CLASSES:
            if re.match(pattern, match.group(1)):
                counts[name] += 1
                break
    return counts


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    tile = sys.argv[2] if len(sys.argv) > 2 else "Cooperative128x256"
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not cuobjdump:
        sys.exit("sass_counts.py: no cuobjdump on PATH (set CUOBJDUMP)")
    folder = os.path.join(build, "CMakeFiles", "coda_kernels.dir", "gemm_instances")
    objects = sorted(f for f in os.listdir(folder) if f.endswith(f"_{tile}.cu.o"))
    cmake = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "CMakeLists.txt")).read()
    layouts = dict(re.findall(r'"(\w+)\|[^|]+\|[^|]+\|(Forward|Dgrad|Wgrad)\|', cmake))
    bare = {layout: count(cuobjdump, os.path.join(folder, f"bare_{layout.lower()}_{tile}.cu.o"))
            for layout in ("Forward", "Dgrad")}
    keys = ["total"] + [name for name, _ in CLASSES]
    print(f"{'program (' + tile + ')':<30}" + "".join(f"{k:>8}" for k in keys))
    for layout, counts in bare.items():
        print(f"{'bare ' + layout.lower():<30}" + "".join(f"{counts[k]:>8}" for k in keys))
    for name in objects:
        program = name[: -len(f"_{tile}.cu.o")]
        layout = layouts.get(program)
        if program.startswith("bare_") or layout not in bare:
            continue
        counts = count(cuobjdump, os.path.join(folder, name))
        print(f"{program:<30}" + "".join(f"{counts[k] - bare[layout][k]:>+8}" for k in keys))


if __name__ == "__main__":
    main()
