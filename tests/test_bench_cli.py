"""`opbridge bench` in its quick mode: the JSON it writes and a PNG that decodes to the expected size."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import opbridge as ob
from opbridge.bench import DPI, FIGURE_HEIGHT_IN, PANEL_WIDTH_IN, PLOT_HINT


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opbridge", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def decode_png(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking every chunk's CRC and inflating its pixels."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
        if kind == b"IEND":
            break
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    assert depth == 8 and interlace == 0
    assert len(zlib.decompress(idat)) == height * (1 + width * channels)  # a filter byte per row
    return width, height


def test_quick_bench_writes_json_and_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = bench(
        "--quick", "--ops", "add,softmax,matmul", "--sizes", "256,1K", "--json", str(out_json), "--plot", str(out_png)
    )
    assert done.returncode == 0, done.stderr
    assert "ratio" in done.stdout
    report = json.loads(out_json.read_text())
    assert report["schema_version"] == 1
    assert report["opbridge"] == ob.__version__
    assert report["bandwidth_gbs"] > 0
    assert [(r["op"], r["size"]) for r in report["results"]] == [
        (op, size) for op in ("add", "softmax", "matmul") for size in ("256", "1K")
    ]
    for r in report["results"]:
        assert r["opbridge_s"] > 0 and r["numpy_s"] > 0
        assert r["ratio"] == pytest.approx(r["opbridge_s"] / r["numpy_s"])
        assert r["unit"] == ("GFLOP/s" if r["op"] == "matmul" else "GB/s")
        assert r["limit_fraction"] is None  # tiny sizes live in the caches: no bandwidth limit applies
    assert decode_png(out_png.read_bytes()) == (round(3 * PANEL_WIDTH_IN * DPI), round(FIGURE_HEIGHT_IN * DPI))


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (
        ["--ops", "add,nope"],
        ["--ops", ",,"],
        ["--sizes", ""],
        ["--sizes", "12Q"],
        ["--sizes", "0"],
        ["--ops", "matmul", "--sizes", "256M"],
        ["--device", "npu:3"],
        ["--json", str(tmp_path / "missing" / "out.json")],
        ["--json", str(tmp_path)],
        ["--plot", str(tmp_path / "plot.txt")],
        ["--bogus"],
    ):
        done = bench("--quick", *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.strip(), args


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for this test')\n")
    path = os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])
    done = bench("--quick", "--ops", "add", "--plot", str(tmp_path / "x.png"), env={"PYTHONPATH": path})
    assert done.returncode == 2
    assert PLOT_HINT in done.stderr
    assert not (tmp_path / "x.png").exists()
