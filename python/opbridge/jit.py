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
``~/.cache/opbridge/jit``, and are written atomically (a temporary file, then a rename), so
concurrent processes never see a partial library. Delete the folder to clear the cache.

Compiler errors raise ``JitCompileError`` with the compiler's message. Log records (logger
``opbridge.jit``) say whether each call compiled or hit the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import tuning
from ._native import ArgumentError, Library, OpBridgeError

__all__ = ["JitCompileError", "JitLibrary", "compile", "default_cache_dir"]

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


def _build(source: str, name: str, lang: str, compiler: str, flags: Sequence[str], target: Path) -> None:
    """Compiles into a temporary file beside ``target`` and renames it into place."""
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
            os.replace(tmp, target)
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
) -> JitLibrary:
    """Compiles ``source`` (unless cached), loads it and registers its operators.

    Args:
        source: the plugin's C or C++ source (it includes ``<opbridge/plugin.h>``).
        name: a short name for logs and compiler messages (``name.c:3:5: error: ...``).
        lang: ``"c"`` (default) or ``"c++"``.
        compiler: the compiler to run (default ``$CC``/``cc``, or ``$CXX``/``c++`` for C++).
        flags: extra compiler flags, e.g. ``("-march=x86-64-v3", "-DN=4")``; part of the cache key.
        cache_dir: where compiled libraries are kept (default: see the module's doc).

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
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(
            f"name {name!r}: use 1 to 100 letters, digits, '_', '-' and '.', starting with no '.' or '-'"
        )
    if not isinstance(lang, str) or not _LANG_ALIASES.get(lang.lower()):
        raise ArgumentError(f"lang must be 'c' or 'c++', got {lang!r}")
    lang = _LANG_ALIASES[lang.lower()]
    if compiler is not None and (not isinstance(compiler, str) or not compiler):
        raise ArgumentError(f"compiler must be a command name or path, got {compiler!r}")
    if isinstance(flags, (str, bytes)) or not all(isinstance(f, str) for f in flags):
        raise ArgumentError(f"flags must be a sequence of str, e.g. ('-DN=4',), got {flags!r}")
    flags = list(flags)
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ArgumentError(f"cache_dir must be a path, got {type(cache_dir).__name__}")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the folder should be, no permission...
        raise ArgumentError(f"cache_dir {str(folder)!r} cannot be used as a folder: {e}") from e
    if not folder.is_dir():
        raise ArgumentError(f"cache_dir {str(folder)!r} is not a folder")
    compiler_path = _compiler(lang, compiler)
    header = (_include_dir() / "opbridge" / "plugin.h").read_bytes()
    key = _cache_key(source, lang, compiler_path, _compiler_version(compiler_path), flags, header)
    target = folder / f"{key}{_SUFFIX}"

    cached = target.is_file()
    if cached:
        log.info("cache hit for %s: %s", name, target)
    else:
        _build(source, name, lang, compiler_path, flags, target)
    try:
        lib = JitLibrary(str(target))
    except OpBridgeError as e:
        if not cached or "not a loadable shared library" not in str(e):
            raise
        # A damaged cache entry (e.g. a disk that filled up): compile it again, once.
        log.warning("cached %s is damaged (%s); compiling again", target, e)
        target.unlink(missing_ok=True)
        _build(source, name, lang, compiler_path, flags, target)
        lib, cached = JitLibrary(str(target)), False
    lib.name = name
    lib.key = key
    lib.cached = cached
    return lib
