"""Cases an independent hostile review found after the reliability fixes: each its own probe
(hang and crash probes in a subprocess with a timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import opbridge as ob


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("how", ["await_tensor", "await_event"])
def test_asyncio_waits_inside_a_host_function_raise_instead_of_hanging(how: str) -> None:
    # The asyncio glue waits in an executor thread, where a wait on work queued behind the host
    # function is invisible: inside stream work it must wait on the worker, which is checked.
    out = _run(
        f"""
        import asyncio, threading, numpy as np, opbridge as ob
        s = ob.Stream(); x = ob.asarray(np.ones(1000, np.float32)); box = {{}}; ready = threading.Event()
        def f():
            ready.wait(10)  # until the work queued behind this function exists
            async def main():
                if "{how}" == "await_tensor":
                    await box["y"]
                else:
                    await box["ev"]
            try:
                asyncio.run(main())
            except ob.DeviceError as e:
                print("DeviceError", "from work running on" in str(e))
        with s:
            s.launch_host_func(f)
            box["y"] = ob.vector_add(x, x)
            box["ev"] = s.record_event()
        ready.set()
        s.synchronize()
        print("done")
        """,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DeviceError", "True", "done"]


def test_a_thresholds_file_that_is_a_fifo_or_a_device_never_blocks_the_import(tmp_path) -> None:
    os.mkfifo(tmp_path / "thresholds.json")
    out = _run("import opbridge as ob; print('imported')", env={"OPBRIDGE_CACHE_DIR": str(tmp_path)}, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr
    assert "not a regular file" in out.stderr
    device_dir = tmp_path / "dev"
    device_dir.mkdir()
    (device_dir / "thresholds.json").symlink_to("/dev/zero")
    out = _run("import opbridge as ob; print('imported')", env={"OPBRIDGE_CACHE_DIR": str(device_dir)}, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr


def test_a_big_thresholds_file_is_ignored_with_a_warning(tmp_path) -> None:
    (tmp_path / "thresholds.json").write_text(" " * (1 << 20) + "{}")
    out = _run("import opbridge as ob; print('imported')", env={"OPBRIDGE_CACHE_DIR": str(tmp_path)}, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr
    assert "larger than" in out.stderr


def _jit_source(tag: str) -> str:
    # The JIT tests' operator (a scale by `k` plus an offset), under a name of its own.
    from test_jit import source

    return source().replace('"scale"', f'"scale_{tag}"') + f"\n/* {tag} */\n"


SOURCE = "int unused;"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"flags": None}, "flags"),
        ({"flags": ["-O\0"]}, "flags"),
        ({"source": "int x; /* \udcff */"}, "source"),
        ({"source": "int x;\0"}, "NUL"),
        ({"cache_dir": "/tmp/a\0b"}, "cache_dir"),
        ({"compiler": "cc\0"}, "compiler"),
    ],
)
def test_jit_arguments_with_nul_surrogates_or_none_are_argument_errors(kwargs, needle, tmp_path) -> None:
    args = {"source": SOURCE, "name": "mends", "cache_dir": str(tmp_path), **kwargs}
    with pytest.raises(ob.ArgumentError, match=needle):
        ob.jit.compile(**args)


def test_a_symlink_at_the_jit_lock_path_does_not_break_compiles(tmp_path) -> None:
    # Any symlink there (dangling, or to someone else's file) is not our lock: removed, never
    # followed, never a permanent failure.
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    ob.jit.compile(_jit_source("lock"), "lockprobe", cache_dir=tmp_path).unload()
    libraries = list(tmp_path.glob("*.so"))
    assert libraries
    for so in libraries:
        so.unlink()  # forces a compile, which takes the lock
        (so.parent / (so.stem + ".lock")).symlink_to(victim)
    ob.jit.compile(_jit_source("lock"), "lockprobe", cache_dir=tmp_path).unload()
    assert victim.read_text() == "keep me"


def test_operands_without_a_common_dtype_are_dtype_errors() -> None:
    with pytest.raises(ob.DTypeError, match="no common dtype"):
        ob.ops.add(["a", "b"], 1)
    with pytest.raises(ob.DTypeError):
        ob.ops.mul(np.array(["x"]), 2.0)
