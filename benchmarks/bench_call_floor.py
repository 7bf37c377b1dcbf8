"""Where a small call's time goes, in instructions (callgrind: exact and repeatable on a noisy
machine, unlike wall time): `vector_add(a, b)` at n=4 against `np.add(a, b)` and against the
floor, a C extension function that returns a new 4-element array and does nothing else
(benchmarks/peers/floor/floor.c, compiled here against this Python and numpy); and `ob.ops.add`
against `np.add` at 1K. Each is called in a loop of N and of 2N calls under callgrind; the
difference divided by N is one call, the loop's own iteration included (an empty loop is shown).
The top functions of each call say what is ours, CPython's and numpy's.

    python benchmarks/bench_call_floor.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RUNNER = """
import sys, numpy as np
sys.path.insert(0, {folder!r})
import floor, opbridge as ob
which, n = sys.argv[1], int(sys.argv[2])
size = 1024 if which.endswith("1k") else 4
a = np.ones(size, np.float32); b = a.copy()
f = {{"loop": None, "floor": floor.new4, "np.add": np.add, "ob.vector_add": ob.vector_add,
      "np.add 1k": np.add, "ob.ops.add 1k": ob.ops.add}}[which]
def run(f, a, b, n):  # locals: no global-name lookups in the loop
    if f is None:
        for _ in range(n): pass
    else:
        for _ in range(n): f(a, b)
run(f, a, b, n)
"""


def build_floor(folder: Path) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    includes = ["-I", sysconfig.get_paths()["include"], "-I", np.get_include()]
    out = folder / f"floor{suffix}"
    cmd = [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", *includes, str(HERE / "peers/floor/floor.c")]
    subprocess.run([*cmd, "-o", str(out)], check=True)


def instructions(script: Path, which: str, n: int, out: Path) -> tuple[int, Path]:
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, str(script), which, str(n)],
        capture_output=True,
        text=True,
        check=True,
        # OpenBLAS's idle threads spin after numpy's import (their instructions are not the call's); a
        # fixed hash seed makes the runs of N and 2N calls start alike.
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1)), out


def functions(path: Path) -> dict[str, int]:
    text = subprocess.run(["callgrind_annotate", str(path)], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*)", line)
        if m and "PROGRAM TOTALS" not in line:
            name = m.group(2).split(" [")[0].split(":")[-1]
            found[name] = found.get(name, 0) + int(m.group(1).replace(",", ""))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40_000)
    args = parser.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_annotate"):
        raise SystemExit("valgrind (callgrind) is needed: apt install valgrind")
    n = args.calls
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_floor(folder)
        script = folder / "run.py"
        script.write_text(RUNNER.format(folder=str(folder)))
        per: dict[str, float] = {}
        for which in ["loop", "floor", "np.add", "ob.vector_add", "np.add 1k", "ob.ops.add 1k"]:
            slug = which.replace(" ", "_")
            small, f1 = instructions(script, which, n, folder / f"{slug}.1")
            large, f2 = instructions(script, which, 2 * n, folder / f"{slug}.2")
            per[which] = (large - small) / n
            top = functions(f2)
            base = functions(f1)
            rows = sorted(((k, (v - base.get(k, 0)) / n) for k, v in top.items()), key=lambda r: -r[1])
            detail = ", ".join(f"{k} {v:.0f}" for k, v in rows[:5] if v >= 5)
            print(f"{which:15s} {per[which]:7.0f} instructions per call  ({detail})")
        loop = per["loop"]
        print(f"vector_add n=4: {per['ob.vector_add'] / per['np.add']:.2f} of np.add's instructions;")
        print(f"  beyond the floor (a new array and nothing else): {per['ob.vector_add'] - per['floor']:.0f}")
        ours, floor = per["ob.vector_add"] - loop, per["floor"] - loop
        print(f"  the call alone, without the loop's iteration: {ours:.0f} (floor {floor:.0f})")
        print(f"ob.ops.add 1K: {per['ob.ops.add 1k'] / per['np.add 1k']:.2f} of np.add's instructions")


if __name__ == "__main__":
    main()
