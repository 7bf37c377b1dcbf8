"""ob.jit.compile: C/C++ plugin sources compiled with the system compiler, cached on disk by a hash of
source + compiler + flags + ABI, loaded; compiler errors raise JitCompileError with the message."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob
from opbridge.jit import JitCompileError

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")

SOURCE = r"""
#include <opbridge/plugin.h>

static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err, size_t len) {
  (void)n_in; (void)n_out; (void)attrs; (void)err; (void)len;
  out[0] = in[0];
  return OPB_OK;
}

static int kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                  void *stream, void *ws, size_t ws_size, char *err, size_t len) {
  (void)n_in; (void)n_out; (void)stream; (void)ws; (void)ws_size; (void)err; (void)len;
  double k = opb_attr(attrs, "k")->f;
  int64_t n = 1;
  for (int d = 0; d < out[0].ndim; d++) n *= out[0].shape[d];
  const double *x = (const double *)in[0].data;  /* 1-D strided input */
  double *y = (double *)out[0].data;
  for (int64_t i = 0; i < n; i++) y[i] = x[i * in[0].strides[0]] * k + OFFSET;
  return OPB_OK;
}

static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT64};
static const OpbAttrDesc attrs[] = {{.name = "k", .kind = OPB_ATTR_FLOAT, .default_float = 2.0, .doc = "factor"}};
static const OpbOpDesc ops[] = {{
  .name = "jit_scale", .version = 1, .doc = "x * k + OFFSET", .n_inputs = 1, .input_names = inputs,
  .n_outputs = 1, .n_attrs = 1, .attrs = attrs, .n_dtypes = 1, .dtypes = dtypes,
  .infer = infer, .cpu_kernel = kernel,
}};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->n_ops = 1;
  info->ops = ops;
  return OPB_OK;
}
"""


def source(offset: int = 0) -> str:
    return f"#define OFFSET {offset}\n" + SOURCE


def libraries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.so")) + sorted(folder.glob("*.dylib"))


def test_compile_then_cache_hit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="opbridge.jit")
    x = np.arange(5.0)
    lib = ob.jit.compile(source(), "scale", cache_dir=tmp_path)
    try:
        assert isinstance(lib, ob.Library) and lib.cached is False
        assert lib.ops == [("jit_scale", 1)] and lib.name == "scale"
        np.testing.assert_array_equal(ob.ops.jit_scale(x), x * 2)
        np.testing.assert_array_equal(ob.ops.jit_scale(x[::2], k=3.0), x[::2] * 3)
    finally:
        lib.unload()
    [built] = libraries(tmp_path)
    assert built.name == f"{lib.key}{built.suffix}" and len(lib.key) == 64
    stamp = built.stat().st_mtime_ns
    assert "compiled scale" in caplog.text

    caplog.clear()
    with ob.jit.compile(source(), "scale", cache_dir=tmp_path) as again:
        assert again.cached is True and again.key == lib.key
        np.testing.assert_array_equal(ob.ops.jit_scale(x), x * 2)
    assert "cache hit" in caplog.text and "compiled" not in caplog.text
    assert built.stat().st_mtime_ns == stamp, "the cached library was rebuilt"
    assert libraries(tmp_path) == [built]
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], "temporary files left behind"


def test_cache_key_covers_source_and_flags(tmp_path: Path) -> None:
    keys = []
    for src, flags in [(source(0), ()), (source(1), ()), (source(0), ("-O1",))]:
        with ob.jit.compile(src, "scale", cache_dir=tmp_path, flags=flags) as lib:
            assert lib.cached is False
            keys.append(lib.key)
            offset = 1 if src == source(1) else 0
            np.testing.assert_array_equal(ob.ops.jit_scale(np.ones(2)), np.full(2, 2.0 + offset))
    assert len(set(keys)) == 3
    assert len(libraries(tmp_path)) == 3


def test_default_cache_folder_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "explicit"))
    assert ob.jit.default_cache_dir() == tmp_path / "explicit" / "jit"
    with ob.jit.compile(source(), "scale") as lib:
        assert lib.path.startswith(str(tmp_path / "explicit" / "jit"))
    monkeypatch.delenv("OPBRIDGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ob.jit.default_cache_dir() == tmp_path / "xdg" / "opbridge" / "jit"


def test_compiler_errors_raise_with_the_message(tmp_path: Path) -> None:
    bad = source().replace("out[0] = in[0];", "out[0] = in[0]  /* missing semicolon */")
    with pytest.raises(JitCompileError) as info:
        ob.jit.compile(bad, "broken", cache_dir=tmp_path)
    error = info.value
    assert isinstance(error, ob.OpBridgeError)
    assert "compiling 'broken' failed" in str(error)
    assert "broken.c:" in str(error) and "error" in str(error)
    assert "broken.c:" in error.stderr and error.returncode != 0
    assert libraries(tmp_path) == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(JitCompileError, match="not found"):
        ob.jit.compile(source(), "scale", compiler="no-such-compiler-xyz", cache_dir=tmp_path)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
def test_cxx_sources(tmp_path: Path) -> None:
    cxx = source(7).replace("static const OpbOpDesc ops[] = {{", "static const OpbOpDesc ops[] = {{ // C++\n")
    cxx = cxx.replace("#include <opbridge/plugin.h>", "#include <opbridge/plugin.h>\n#include <vector>")
    # No extern "C" needed: the header declares the entry point with C linkage.
    with ob.jit.compile(cxx, "scale_cpp", lang="c++", flags=("-std=c++20",), cache_dir=tmp_path) as lib:
        assert lib.cached is False
        np.testing.assert_array_equal(ob.ops.jit_scale(np.ones(3), k=1.0), np.full(3, 8.0))


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lang"):
        ob.jit.compile(source(), "scale", lang="fortran", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="name"):
        ob.jit.compile(source(), "../escape", cache_dir=tmp_path)


# A damaged cache entry is compiled again, never loaded: loading a truncated or overwritten library
# can kill the interpreter (SIGBUS/SIGSEGV), so every probe runs in its own process.
PROBE = """
import json, logging, sys
import numpy as np
import opbridge as ob
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
with ob.jit.compile(sys.argv[1], "scale", cache_dir=sys.argv[2]) as lib:
    y = ob.ops.jit_scale(np.arange(4.0))
    print(json.dumps({"cached": lib.cached, "y": y.tolist()}))
"""


def probe(folder: Path, src: str | None = None) -> dict:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", PROBE, src or source(), str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"probe died (status {done.returncode}): {done.stderr[-2000:]}"
    return {**json.loads(done.stdout), "log": done.stderr}


def _truncate_half(lib: Path) -> None:
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 2])


def _truncate_in_place(lib: Path) -> None:
    os.truncate(lib, 200)


def _overwrite_same_size(lib: Path) -> None:
    lib.write_bytes(b"\x7fELF" + b"\x00" * (lib.stat().st_size - 4))


def _flip_bytes_in_the_middle(lib: Path) -> None:
    data = bytearray(lib.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    lib.write_bytes(bytes(data))


def _empty(lib: Path) -> None:
    lib.write_bytes(b"")


def _record_missing(lib: Path) -> None:
    Path(str(lib) + ".sha256").unlink()


def _record_wrong(lib: Path) -> None:
    Path(str(lib) + ".sha256").write_text("0" * 64 + " 1\n")


def _record_garbage(lib: Path) -> None:
    Path(str(lib) + ".sha256").write_bytes(b"\xff\xfe garbage")


def _record_is_a_directory(lib: Path) -> None:
    record = Path(str(lib) + ".sha256")
    record.unlink()
    (record / "inner").mkdir(parents=True)


def _library_is_a_directory(lib: Path) -> None:
    lib.unlink()
    (lib / "inner").mkdir(parents=True)


def _library_is_a_symlink(lib: Path) -> None:
    real = lib.with_name("elsewhere.bin")
    lib.rename(real)
    lib.symlink_to(real)


def _truncated_with_matching_record(lib: Path) -> None:
    # Someone truncated the library and "fixed" the record to match: not an ELF library any more, the
    # loader refuses it cleanly and the entry is compiled again.
    import hashlib

    _truncate_half(lib)
    data = lib.read_bytes()
    Path(str(lib) + ".sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")


DAMAGE = [
    _truncate_half,
    _truncate_in_place,
    _overwrite_same_size,
    _flip_bytes_in_the_middle,
    _empty,
    _record_missing,
    _record_wrong,
    _record_garbage,
    _record_is_a_directory,
    _library_is_a_directory,
    _library_is_a_symlink,
    _truncated_with_matching_record,
]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.strip("_") for d in DAMAGE])
def test_a_damaged_cache_entry_is_compiled_again(tmp_path: Path, damage) -> None:
    first = probe(tmp_path)
    assert first["cached"] is False and first["y"] == [0.0, 2.0, 4.0, 6.0]
    [lib] = libraries(tmp_path)
    damage(lib)
    again = probe(tmp_path)
    assert again["y"] == [0.0, 2.0, 4.0, 6.0]
    assert again["cached"] is False and "compiling again" in again["log"], again["log"]
    # Repaired: the next call is a verified cache hit.
    assert probe(tmp_path)["cached"] is True
    assert lib.is_file() and not lib.is_symlink()
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name or p.suffix == ".lock"]


def test_concurrent_compiles_of_one_source_compile_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    src = source(7)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, src, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1000:] for _, e in outs]
    assert sum("compiled scale" in err for _, err in outs) == 1, [err for _, err in outs]
    assert len(libraries(tmp_path)) == 1
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".sha256", ".so"]


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1])
def test_load_library_refuses_a_truncated_library_instead_of_crashing(tmp_path: Path, keep: float) -> None:
    import subprocess
    import sys

    probe(tmp_path)
    [lib] = libraries(tmp_path)
    data = lib.read_bytes()
    cut = tmp_path / "cut.so"
    cut.write_bytes(data[: int(len(data) * keep)])
    code = (
        "import sys, opbridge as ob\n"
        "try:\n    ob.load_library(sys.argv[1])\nexcept ob.OpBridgeError as e:\n    print('refused:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(cut)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"died with status {done.returncode}: {done.stderr[-1000:]}"
    assert "refused:" in done.stdout and "not a loadable shared library" in done.stdout, done.stdout
