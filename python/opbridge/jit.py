"""Compile operator libraries from C or C++ source at run time, with an on-disk cache.

    >>> import opbridge as ob
    >>> lib = ob.jit.compile(source, "my_ops")      # compiles, caches, loads
    >>> lib.cached
    False
    >>> lib.unload()
    >>> ob.jit.compile(source, "my_ops").cached     # same source: loaded from the cache
    True

``source`` is a plugin in the C ABI of ``opbridge/plugin.h`` (see ``opbridge.get_include()``): it
exports ``opbridge_plugin_init`` and declares its operators. The system compiler builds it into a
shared library (``$CC`` or ``cc`` for C, ``$CXX`` or ``c++`` for C++) with
``-O3 -shared -fPIC -I <include>`` plus your ``flags``.

The cache key is the SHA-256 of the source, the language, the compiler's resolved path and its
``--version`` output, the flags, the plugin ABI version and the header itself (like CuPy's kernel
cache): change any of them and the library is compiled again. Files live in
``$OPBRIDGE_CACHE_DIR/jit``, else ``$XDG_CACHE_HOME/opbridge/jit``, else
``~/.cache/opbridge/jit``. Each library ``<key>.so`` has a record ``<key>.so.sha256`` beside it
with the SHA-256 and size of its bytes. Both are written atomically (a temporary file in the same
folder, fsync, rename), and a cached library is loaded only after its bytes match its record: an
entry that is truncated, overwritten, empty, missing its record, or not a plain file (a directory,
a symlink) is deleted and compiled again (logged as a warning), never handed to the dynamic
loader, where a damaged library can crash the process. Processes compiling the same source at once
take turns on a lock file (``<key>.lock``, removed after), so one compiles and the others load its result. Delete
the folder to clear the cache.

Compiler errors raise ``JitCompileError`` with the compiler's message. Log records (logger
``opbridge.jit``) say whether each call compiled or hit the cache.

**Ascend kernels.** With ``device="ascend"`` (or ``"ascend:N"``), ``source`` is an Ascend C kernel
compiled by CANN's runtime compiler (aclrtc, ``libacl_rtc.so`` beside the ACL runtime), for the
device's architecture (``--npu-arch=dav-2201`` for Ascend910B/910_93; other SoCs name theirs in
``flags``), and the result is a ``JitKernel``: the ``ob.ascend.Kernel`` named ``kernel`` (default
``name``) with the parameters ``params``, ready to launch. The binary is cached like a library,
keyed by the source, the options (architecture included), the runtime compiler's path, size and
mtime, and the SoC; a compile error raises ``JitCompileError`` with aclrtc's log::

    k = ob.jit.compile(src, "vadd", device="ascend", kernel="vector_add_kernel",
                       params=["tensor", "tensor", "tensor", "uint32"])
    k(8, x, y, z, n); k.cached
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import _native, tuning
from ._native import ArgumentError, Library, OpBridgeError

__all__ = ["JitCompileError", "JitKernel", "JitLibrary", "compile", "default_cache_dir"]

log = logging.getLogger("opbridge.jit")

_LANGS = {"c": ("c", "CC", "cc"), "c++": ("cpp", "CXX", "c++")}
_LANG_ALIASES = {"c": "c", "c++": "c++", "cpp": "c++", "cxx": "c++"}
_BASE_FLAGS = ("-O3", "-shared", "-fPIC")
_SUFFIX = ".dylib" if sys.platform == "darwin" else ".so"
# Names become file names and appear in compiler messages: a letter, digit or '_' first, then up
# to 99 of those or '.' and '-' (matched whole: no trailing newline slips through `$`).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")

# (compiler path, mtime, size) -> its --version output, so repeated calls do not run it again.
_versions: dict[tuple[str, int, int], str] = {}


class JitCompileError(OpBridgeError):
    """The compiler rejected a JIT source; the message carries its output.

    Attributes: ``command`` (the argument list), ``returncode``, ``stderr``.
    """

    def __init__(self, message: str, *, command: Sequence[str] = (), returncode: int = -1, stderr: str = "") -> None:
        super().__init__(message)
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr


class JitLibrary(Library):
    """A ``Library`` made by ``compile``, which also says where it came from.

    Attributes: ``name`` (as passed to ``compile``), ``key`` (the cache key), ``cached`` (True when
    it was loaded from the cache without compiling).
    """

    name: str
    key: str
    cached: bool


class JitKernel:
    """An ``ob.ascend.Kernel`` made by ``compile(..., device="ascend")``; calling it launches it.

    Attributes: ``kernel`` (the ``ob.ascend.Kernel``), ``name`` (as passed to ``compile``), ``key``
    (the cache key), ``cached`` (True when its binary came from the cache without compiling).
    """

    def __init__(self, kernel: Any, name: str, key: str, cached: bool) -> None:
        self.kernel = kernel
        self.name = name
        self.key = key
        self.cached = cached

    @property
    def params(self) -> list[str] | None:
        params = self.kernel.params
        return None if params is None else list(params)

    @property
    def device(self) -> str:
        return str(self.kernel.device)

    def __call__(self, block_dim: int, *args: Any, stream: Any = None) -> None:
        self.kernel(block_dim, *args, stream=stream)

    def __repr__(self) -> str:
        return f"JitKernel({self.name!r}, {self.kernel!r}, cached={self.cached})"


def default_cache_dir() -> Path:
    """The folder of compiled JIT libraries when ``compile`` is not given one."""
    return tuning.cache_dir() / "jit"


def _include_dir() -> Path:
    import opbridge  # the package's own folder, resolved at call time

    return Path(opbridge.get_include())


def _compiler(lang: str, compiler: str | None) -> str:
    _, env, default = _LANGS[lang]
    wanted = compiler or os.environ.get(env) or default
    found = shutil.which(wanted)
    if found is None:
        raise JitCompileError(f"compiler {wanted!r} not found (set {env} or pass compiler=)", command=[wanted])
    return os.path.realpath(found)


def _compiler_version(path: str) -> str:
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _versions:
        try:
            done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise JitCompileError(f"cannot run {path} --version: {e}", command=[path, "--version"]) from e
        _versions[key] = done.stdout + done.stderr
    return _versions[key]


def _cache_key(source: str, lang: str, compiler: str, version: str, flags: Sequence[str], header: bytes) -> str:
    h = hashlib.sha256()
    abi = re.search(rb"#define OPBRIDGE_PLUGIN_ABI_VERSION (\d+)", header)
    parts: list[bytes] = [
        b"opbridge-jit/1",
        b"abi=" + (abi.group(1) if abi else b"?"),
        b"lang=" + lang.encode(),
        b"compiler=" + compiler.encode(),
        b"version=" + version.encode(),
        b"flags=" + "\0".join([*_BASE_FLAGS, *flags]).encode(),
        b"header=" + hashlib.sha256(header).hexdigest().encode(),
        b"source=" + source.encode(),
    ]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _digest(path: str | Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened or synced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    """Removes whatever is at ``path`` (file, symlink or folder); nothing there is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _verify(target: Path) -> str | None:
    """Why the cache entry at ``target`` cannot be loaded ("missing" when there is none), or None
    when its bytes match its record."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat it: {e}"
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file"
    if st.st_size == 0:
        return "empty"
    record = _record_path(target)
    try:
        if not stat.S_ISREG(os.lstat(record).st_mode):
            return "its record is not a plain file"
        expected = record.read_text(encoding="ascii").split()
    except FileNotFoundError:
        return "its record (.sha256) is missing"
    except (OSError, ValueError) as e:
        return f"its record is unreadable: {e}"
    try:
        digest, size = _digest(target)
    except OSError as e:
        return f"unreadable: {e}"
    if expected != [digest, str(size)]:
        return "its bytes do not match its record (truncated or overwritten)"
    return None


def _write_record(target: Path, digest: str, size: int) -> None:
    record = _record_path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{record.name}.", suffix=".tmp", dir=record.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{digest} {size}\n")
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(record) and not os.path.islink(record):
            _remove(record)
        os.replace(tmp, record)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Holds ``<key>.lock`` (an exclusive ``flock``) so one process compiles a key at a time; the
    lock file is removed on the way out, so a lock whose file is no longer the one at the path
    (removed by the holder before us) is retried on the new file."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic renames still keep every entry whole
        yield
        return
    lock = target.with_name(target.stem + ".lock")
    while True:
        if os.path.islink(lock) or (os.path.isdir(lock) and not os.path.islink(lock)):
            _remove(lock)  # a symlink or folder there is not our lock: O_NOFOLLOW would refuse it
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if not same:
                continue  # the holder removed this file: lock the one there now
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)  # still holding it: later comers see the file change
            return
        finally:
            os.close(fd)  # closing releases the lock


def _build(source: str, name: str, lang: str, compiler: str, flags: Sequence[str], target: Path) -> None:
    """Compiles into a temporary file beside ``target``, syncs it, writes its record, and renames
    it into place (the record first: a library in place always has its record)."""
    ext = _LANGS[lang][0]
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp" + _SUFFIX, dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="opbridge-jit-") as work:
            src = Path(work) / f"{name}.{ext}"  # the compiler's messages name this file
            src.write_text(source)
            command = [compiler, *_BASE_FLAGS, "-I", str(_include_dir()), *flags, str(src), "-o", tmp]
            t0 = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True, cwd=work, check=False)
            except OSError as e:
                raise JitCompileError(f"cannot run {compiler}: {e}", command=command) from e
            if done.returncode != 0:
                output = (done.stderr + done.stdout).strip()
                raise JitCompileError(
                    f"compiling {name!r} failed (exit status {done.returncode}):\n{output}",
                    command=command,
                    returncode=done.returncode,
                    stderr=done.stderr,
                )
            if done.stderr.strip():
                log.debug("compiler output for %s:\n%s", name, done.stderr.strip())
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest, size = _digest(tmp)
            if size == 0:
                raise JitCompileError(f"compiling {name!r} produced an empty library", command=command)
            _write_record(target, digest, size)
            _remove(target)  # a directory (or anything else) in the library's place
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            log.info("compiled %s -> %s in %.2f s", name, target, time.perf_counter() - t0)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile(
    source: str,
    name: str,
    *,
    lang: str = "c",
    compiler: str | None = None,
    flags: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | None = None,
    kernel: str | None = None,
    params: Sequence[str] | None = None,
) -> Any:
    """Compiles ``source`` (unless cached), loads it and registers its operators (or, with
    ``device="ascend"``, makes it an Ascend kernel: see the module's doc).

    Args:
        source: the plugin's C or C++ source (it includes ``<opbridge/plugin.h>``).
        name: a short name for logs and compiler messages (``name.c:3:5: error: ...``).
        lang: ``"c"`` (default) or ``"c++"``.
        compiler: the compiler to run (default ``$CC``/``cc``, or ``$CXX``/``c++`` for C++).
        flags: extra compiler flags, e.g. ``("-march=x86-64-v3", "-DN=4")``; part of the cache key.
        cache_dir: where compiled libraries are kept (default: see the module's doc).
        device: ``None`` or ``"cpu"`` (a plugin library), or ``"ascend"`` / ``"ascend:N"`` (an
            Ascend C kernel, compiled by aclrtc; ``lang`` and ``compiler`` do not apply).
        kernel: the Ascend kernel's name in ``source`` (default ``name``).
        params: the Ascend kernel's parameters (see ``ob.ascend.Kernel.from_file``); without
            them, each call's arguments give the types (Tensors, and numpy scalars).

    Returns:
        A ``JitLibrary``: a loaded ``Library`` with ``.cached`` telling whether it came from the
        cache. Unload it before compiling the same operators again in this process (a name +
        version registers once).

    Raises:
        JitCompileError: the compiler is missing or rejected the source (its message included).
        OpBridgeError: the compiled library is not a valid plugin (see ``load_library``).
    """
    # Every argument is checked here, before anything runs: a wrong type or value of any of them
    # is an ArgumentError (a ValueError) naming it.
    if not isinstance(source, str):
        raise ArgumentError(f"source must be a str of C or C++ source, got {type(source).__name__}")
    if "\0" in source:
        raise ArgumentError("source contains a NUL character")
    try:
        source.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates
        raise ArgumentError(f"source is not valid text: {e}") from e
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(
            f"name {name!r}: use 1 to 100 letters, digits, '_', '-' and '.', starting with no '.' or '-'"
        )
    if not isinstance(lang, str) or not _LANG_ALIASES.get(lang.lower()):
        raise ArgumentError(f"lang must be 'c' or 'c++', got {lang!r}")
    lang = _LANG_ALIASES[lang.lower()]
    if compiler is not None and (not isinstance(compiler, str) or not compiler):
        raise ArgumentError(f"compiler must be a command name or path, got {compiler!r}")
    if (
        isinstance(flags, (str, bytes))
        or not isinstance(flags, (list, tuple))
        or not all(isinstance(f, str) and "\0" not in f for f in flags)
    ):
        raise ArgumentError(
            f"flags must be a sequence of str (a list or tuple, no NUL), e.g. ('-DN=4',), got {flags!r}"
        )
    flags = list(flags)
    if compiler is not None and "\0" in compiler:
        raise ArgumentError("compiler contains a NUL character")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ArgumentError(f"cache_dir must be a path, got {type(cache_dir).__name__}")
    if cache_dir is not None and "\0" in os.fspath(cache_dir):
        raise ArgumentError("cache_dir contains a NUL character")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the folder should be, no permission...
        raise ArgumentError(f"cache_dir {str(folder)!r} cannot be used as a folder: {e}") from e
    if not folder.is_dir():
        raise ArgumentError(f"cache_dir {str(folder)!r} is not a folder")
    if device is not None and not isinstance(device, str):
        raise ArgumentError(f"device must be a str such as 'ascend:0', got {type(device).__name__}")
    if device is not None and device.split(":")[0] == "ascend":
        if compiler is not None:
            raise ArgumentError("compiler= does not apply to Ascend kernels (aclrtc compiles them)")
        return _compile_ascend(source, name, flags, folder, device, kernel, params)
    if device not in (None, "cpu", "cpu:0"):
        raise ArgumentError(f"device must be 'cpu' or 'ascend[:N]', got {device!r}")
    if kernel is not None or params is not None:
        raise ArgumentError("kernel= and params= are for device='ascend'")
    # A span in an active profile (opbridge.profiler): the compile, or the cache hit, and the load.
    _native.profiler_begin("jit", f"jit compile {name}")
    try:
        compiler_path = _compiler(lang, compiler)
        header = (_include_dir() / "opbridge" / "plugin.h").read_bytes()
        key = _cache_key(source, lang, compiler_path, _compiler_version(compiler_path), flags, header)
        target = folder / f"{key}{_SUFFIX}"

        # Only a library whose bytes match its record reaches the dynamic loader: loading a truncated
        # or overwritten one can crash the process (SIGBUS/SIGSEGV) before any error is possible.
        cached = _ensure(target, lambda: _build(source, name, lang, compiler_path, flags, target))
        if cached:
            log.info("cache hit for %s: %s", name, target)
        try:
            lib = JitLibrary(str(target))
        except OpBridgeError as e:
            if not cached or "not a loadable shared library" not in str(e):
                raise
            # Verified yet not loadable (e.g. a library from another machine's compiler with the
            # same path and version): compile it again, once.
            log.warning("cached %s is not loadable (%s); compiling again", target, e)
            with _locked(target):
                _remove(target)
                _build(source, name, lang, compiler_path, flags, target)
            lib, cached = JitLibrary(str(target)), False
        lib.name = name
        lib.key = key
        lib.cached = cached
        return lib
    finally:
        _native.profiler_end("jit", f"jit compile {name}")


# SoCs whose architecture option is known (others name theirs in flags).
_NPU_ARCH = (("Ascend910B", "dav-2201"), ("Ascend910_93", "dav-2201"))


def _ascend_device(device: str) -> tuple[str, str]:
    """The device's name and SoC, from ``ob.devices()`` (a ``DeviceError`` when it has none)."""
    wanted = "ascend:0" if device == "ascend" else device
    for entry in _native.devices():
        if entry.get("name") == wanted and entry.get("available"):
            return wanted, str(entry.get("soc") or "")
    reasons = [str(e.get("reason")) for e in _native.devices() if str(e.get("name", "")).startswith("ascend")]
    raise _native.DeviceError(f"{device} is not available" + (f": {'; '.join(reasons)}" if reasons else ""))


def _compile_ascend(
    source: str,
    name: str,
    flags: Sequence[str],
    folder: Path,
    device: str,
    kernel: str | None,
    params: Sequence[str] | None,
) -> JitKernel:
    if kernel is not None and (not isinstance(kernel, str) or not kernel):
        raise ArgumentError(f"kernel must be the kernel's name in the source, got {kernel!r}")
    if params is not None and (isinstance(params, (str, bytes)) or not all(isinstance(p, str) for p in params)):
        raise ArgumentError("params= must list the kernel's parameters, e.g. ['tensor', 'tensor', 'uint32']")
    device, soc = _ascend_device(device)
    options = list(flags)
    if not any(o.startswith("--npu-arch=") for o in options):
        arch = next((a for prefix, a in _NPU_ARCH if soc.startswith(prefix)), None)
        if arch is None:
            raise ArgumentError(f"no known --npu-arch for SoC {soc!r}: pass flags=['--npu-arch=dav-...']")
        options.append(f"--npu-arch={arch}")
    library = _native.ascend_rtc_library()
    st = os.stat(library)
    h = hashlib.sha256()
    for part in (
        b"opbridge-jit-ascend/1",
        f"rtc={library}:{st.st_size}:{st.st_mtime_ns}".encode(),
        f"soc={soc}".encode(),
        "\0".join(options).encode(),
        source.encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    key = h.hexdigest()
    target = folder / f"{key}.ascend.bin"

    def build() -> None:
        t0 = time.perf_counter()
        binary, compile_log, message, code = _native.ascend_rtc_compile(source, name, options)
        if binary is None:
            detail = f"\n{compile_log.strip()}" if compile_log.strip() else ""
            raise JitCompileError(
                f"compiling {name!r} for {device} failed: {message}{detail}",
                command=["aclrtc", *options],
                returncode=code,
                stderr=compile_log,
            )
        _store(target, binary)
        log.info("compiled %s for %s -> %s in %.2f s", name, device, target, time.perf_counter() - t0)

    _native.profiler_begin("jit", f"jit compile {name}")
    try:
        cached = _ensure(target, build)
        if cached:
            log.info("cache hit for %s: %s", name, target)
        data = target.read_bytes()
        loaded = _native.Kernel.from_binary(data, kernel or name, None if params is None else list(params), device)
        return JitKernel(loaded, name, key, cached)
    finally:
        _native.profiler_end("jit", f"jit compile {name}")


def _ensure(target: Path, build: Callable[[], None]) -> bool:
    """Makes sure ``target`` holds an entry whose bytes match its record, calling ``build`` (under
    the key's lock, after removing a damaged entry) when it does not; True when it already did."""
    if _verify(target) is None:
        return True
    with _locked(target):
        problem = _verify(target)  # another process may have compiled it meanwhile
        if problem is None:
            return True
        if problem != "missing":
            log.warning("cached %s is damaged (%s); compiling again", target, problem)
        _remove(target)
        _remove(_record_path(target))
        build()
    return False


def _store(target: Path, data: bytes) -> None:
    """Writes ``data`` to ``target`` atomically, its record first (as ``_build`` does)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _write_record(target, hashlib.sha256(data).hexdigest(), len(data))
        _remove(target)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
