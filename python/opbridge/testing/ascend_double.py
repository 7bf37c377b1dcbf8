"""Build (and locate) the Ascend ACL test double: libacl_rt_impl.so, libacl_rt.so, libascendcl.so
(the aclnn part: libnnopbase.so, libopapi_math.so, libopapi_nn.so, libopapi.so; and the runtime
compiler of its kernel dialect, libacl_rtc.so).

    python -m opbridge.testing.ascend_double --lib-dir   # builds if needed, prints only the folder
    python -m opbridge.testing.ascend_double --compile-kernel kernel.c -o kernel.so

A "kernel binary" of the double is a shared object built from plain C in the test-only kernel
dialect of ``acldouble_kernel.h`` (installed beside the libraries; :func:`compile_kernel`): what
``ob.ascend.Kernel.from_file`` loads on the double where a real NPU would load a binary built by
the Ascend C toolchain.

The C sources live in crates/opbridge-ascend/double (env OPBRIDGE_ASCEND_DOUBLE_SRC overrides). The
libraries are built with the system compiler (env CC, default ``cc``) into a cache folder keyed by a
hash of the sources and the compiler version: $OPBRIDGE_CACHE_DIR, else $XDG_CACHE_HOME/opbridge, else
~/.cache/opbridge, subfolder ascend-double/<hash>. The build happens in a temporary folder renamed into
place, so concurrent builders never see half-built libraries. This module imports nothing of opbridge
(it works without the native extension and can be run by path).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CFLAGS = ["-std=c11", "-O2", "-g", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror", "-Winit-self"]
IMPL_SOURCES = ["acl_rt_double.c", "acl_kernels_double.c"]
KERNEL_HEADER = "acldouble_kernel.h"  # the test-only kernel dialect (see compile_kernel)
HEADERS = ["acl_decls.h", "double_internal.h", KERNEL_HEADER]
THIN_SOURCE = "thin.c"
IMPL = "libacl_rt_impl.so"
THIN = ["libacl_rt.so", "libascendcl.so"]
RTC_SOURCE = "acl_rtc_double.c"  # libacl_rtc.so: the runtime compiler (aclrtc) for the kernel dialect
RTC = "libacl_rtc.so"

# --- aclnn operator part of the double (libnnopbase.so, libopapi_math.so, libopapi_nn.so and the
# combined libopapi.so), each linked against libacl_rt_impl.so (one device state per process) ---
ACLNN_SOURCES = ["aclnn_decls.h", "aclnn_double.c", "aclnn_ops_double.c", "aclnn_opapi_double.c"]
ACLNN_LIBS = ["libnnopbase.so", "libopapi_math.so", "libopapi_nn.so", "libopapi.so"]


def _build_aclnn(cc: list[str], src: Path, tmp: Path) -> None:
    flags = [*CFLAGS, "-ffp-contract=off", f"-I{src}", f"-L{tmp}", "-Wl,-rpath,$ORIGIN", "-Wl,--no-as-needed"]
    ops = str(src / "aclnn_ops_double.c")
    steps = [
        ("libnnopbase.so", [str(src / "aclnn_double.c")], ["-lacl_rt_impl", "-lm"]),
        ("libopapi_math.so", ["-DACLDOUBLE_OPAPI_MATH", ops], ["-lnnopbase", "-lacl_rt_impl", "-lm"]),
        ("libopapi_nn.so", ["-DACLDOUBLE_OPAPI_NN", ops], ["-lnnopbase", "-lacl_rt_impl", "-lm"]),
        (
            "libopapi.so",
            [str(src / "aclnn_opapi_double.c")],
            ["-lopapi_math", "-lopapi_nn", "-lnnopbase", "-lacl_rt_impl"],
        ),
    ]
    for name, srcs, libs in steps:
        _run([*cc, *flags, "-o", str(tmp / name), *srcs, *libs], tmp)


# --- end of the aclnn part ---


class DoubleBuildError(RuntimeError):
    """The double's sources are missing or do not compile."""


def source_dir() -> Path:
    env = os.environ.get("OPBRIDGE_ASCEND_DOUBLE_SRC")
    src = Path(env) if env else Path(__file__).resolve().parents[3] / "crates" / "opbridge-ascend" / "double"
    missing = [n for n in [*IMPL_SOURCES, *HEADERS, THIN_SOURCE, *ACLNN_SOURCES] if not (src / n).is_file()]
    if missing:
        raise DoubleBuildError(
            f"Ascend double sources not found in {src} (missing {', '.join(missing)}); "
            "set OPBRIDGE_ASCEND_DOUBLE_SRC to the crates/opbridge-ascend/double folder"
        )
    return src


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _cache_root() -> Path:
    if os.environ.get("OPBRIDGE_CACHE_DIR"):
        return Path(os.environ["OPBRIDGE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "opbridge"
    return Path.home() / ".cache" / "opbridge"


def _key(src: Path, cc: list[str]) -> str:
    h = hashlib.sha256()
    for name in sorted([*IMPL_SOURCES, *HEADERS, THIN_SOURCE, *ACLNN_SOURCES, RTC_SOURCE]):
        h.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    try:
        ver = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise DoubleBuildError(f"C compiler {shlex.join(cc)!r} is not usable: {e}") from e
    h.update(shlex.join(cc).encode() + b"\0" + ver.encode() + b"\0" + " ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str], cwd: Path) -> None:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise DoubleBuildError(f"compiling the Ascend double failed:\n$ {shlex.join(cmd)}\n{p.stdout}{p.stderr}")


def _complete(d: Path) -> bool:
    return all((d / n).is_file() for n in [IMPL, *THIN, *ACLNN_LIBS, KERNEL_HEADER, RTC])


def build(force: bool = False) -> Path:
    """Build the libraries unless a complete build for these sources exists; return their folder."""
    src = source_dir()
    cc = _compiler()
    final = _cache_root() / "ascend-double" / _key(src, cc)
    if _complete(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        impl = [*cc, *CFLAGS, "-fvisibility=hidden", "-o", str(tmp / IMPL), *[str(src / s) for s in IMPL_SOURCES]]
        _run([*impl, "-ldl"], tmp)
        shutil.copyfile(src / KERNEL_HEADER, tmp / KERNEL_HEADER)  # for kernel binaries (compile_kernel)
        _run([*cc, *CFLAGS, "-fvisibility=hidden", "-o", str(tmp / RTC), str(src / RTC_SOURCE), "-ldl"], tmp)
        for name in THIN:
            cmd = [*cc, *CFLAGS, "-o", str(tmp / name), str(src / THIN_SOURCE), "-Wl,--no-as-needed"]
            _run([*cmd, f"-L{tmp}", "-lacl_rt_impl", "-Wl,-rpath,$ORIGIN"], tmp)
        _build_aclnn(cc, src, tmp)
        if force and final.exists():
            old = final.with_name(final.name + f".old-{os.getpid()}")
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, final)  # atomic; fails if another builder won the race
        except OSError:
            if not _complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def lib_dir() -> Path:
    """The folder holding the built double (building it first if needed)."""
    return build()


def compile_kernel(source: str | Path, output: str | Path) -> Path:
    """Builds a kernel binary of the double from C source in its dialect (a path to a ``.c``
    file, or the source text itself) with the system compiler; returns ``output``."""
    folder = lib_dir()
    output = Path(output)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(source) if isinstance(source, Path) or str(source).endswith(".c") else None
        if path is None:
            path = Path(tmp) / "kernel.c"
            path.write_text(str(source))
        cmd = [*_compiler(), "-std=c11", "-O2", "-fPIC", "-shared", f"-I{folder}", "-o", str(output), str(path)]
        _run(cmd, Path(tmp))
    return output


USAGE = (
    "usage: python -m opbridge.testing.ascend_double --lib-dir [--force]\n"
    "       python -m opbridge.testing.ascend_double --compile-kernel SOURCE.c -o KERNEL.so"
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 4 and args[0] == "--compile-kernel" and args[2] == "-o":
            print(compile_kernel(Path(args[1]), args[3]))
            return 0
        if args not in (["--lib-dir"], ["--lib-dir", "--force"], ["--force", "--lib-dir"]):
            print(USAGE, file=sys.stderr)
            return 2
        print(build(force="--force" in args))
    except DoubleBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
