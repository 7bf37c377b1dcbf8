"""The Ascend ACL test double (crates/opbridge-ascend/double), exercised through ctypes.

ACL state is per process, so every test that initialises ACL runs a small Python snippet in a fresh
subprocess (`run`), with the ctypes bindings of PRELUDE and the double's env knobs. The builder is
loaded by path (it must not need opbridge's native extension) and called once per session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILDER = ROOT / "python" / "opbridge" / "testing" / "ascend_double.py"


def _load_builder():
    spec = importlib.util.spec_from_file_location("ascend_double_builder", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def lib_dir(tmp_path_factory) -> Path:
    os.environ.setdefault("OPBRIDGE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return _load_builder().lib_dir()


PRELUDE = r"""
import ctypes, os, sys, threading, time
from ctypes import c_void_p, c_size_t, c_int, c_int32, c_uint32, c_uint64, c_float, byref, POINTER
LIB = os.environ["DOUBLE_LIB_DIR"]
A = ctypes.CDLL(os.path.join(LIB, os.environ.get("DOUBLE_LIB", "libascendcl.so")))
CB = ctypes.CFUNCTYPE(None, c_void_p)
SIG = {
    "aclInit": [ctypes.c_char_p], "aclFinalize": [], "aclrtSetDevice": [c_int32], "aclrtResetDevice": [c_int32],
    "aclrtGetDevice": [POINTER(c_int32)], "aclrtGetDeviceCount": [POINTER(c_uint32)],
    "aclrtMalloc": [POINTER(c_void_p), c_size_t, c_int], "aclrtMallocAlign32": [POINTER(c_void_p), c_size_t, c_int],
    "aclrtFree": [c_void_p], "aclrtMallocHost": [POINTER(c_void_p), c_size_t], "aclrtFreeHost": [c_void_p],
    "aclrtMemcpy": [c_void_p, c_size_t, c_void_p, c_size_t, c_int],
    "aclrtMemcpyAsync": [c_void_p, c_size_t, c_void_p, c_size_t, c_int, c_void_p],
    "aclrtMemsetAsync": [c_void_p, c_size_t, c_int32, c_size_t, c_void_p],
    "aclrtGetMemInfo": [c_int, POINTER(c_size_t), POINTER(c_size_t)],
    "aclrtCreateStream": [POINTER(c_void_p)], "aclrtDestroyStream": [c_void_p],
    "aclrtSynchronizeStream": [c_void_p], "aclrtSynchronizeStreamWithTimeout": [c_void_p, c_int32],
    "aclrtStreamQuery": [c_void_p, POINTER(c_int)], "aclrtStreamWaitEvent": [c_void_p, c_void_p],
    "aclrtSetStreamFailureMode": [c_void_p, c_uint64],
    "aclrtCreateEvent": [POINTER(c_void_p)], "aclrtCreateEventWithFlag": [POINTER(c_void_p), c_uint32],
    "aclrtDestroyEvent": [c_void_p], "aclrtRecordEvent": [c_void_p, c_void_p],
    "aclrtQueryEventStatus": [c_void_p, POINTER(c_int)], "aclrtQueryEvent": [c_void_p, POINTER(c_int)],
    "aclrtSynchronizeEvent": [c_void_p], "aclrtEventElapsedTime": [POINTER(c_float), c_void_p, c_void_p],
    "aclrtSubscribeReport": [c_uint64, c_void_p], "aclrtUnSubscribeReport": [c_uint64, c_void_p],
    "aclrtLaunchCallback": [CB, c_void_p, c_int, c_void_p], "aclrtProcessReport": [c_int32],
    "aclrtLaunchHostFunc": [c_void_p, CB, c_void_p],
    "acldoubleOutstanding": [POINTER(c_uint64)] * 4,
}
for _n, _a in SIG.items():
    getattr(A, _n).argtypes = _a
    getattr(A, _n).restype = c_int
A.aclGetRecentErrMsg.restype = ctypes.c_char_p
A.aclrtGetSocName.restype = ctypes.c_char_p

def ck(rc):
    if rc != 0:
        raise SystemExit(f"unexpected {rc}: {A.aclGetRecentErrMsg()}")

def msg():
    m = A.aclGetRecentErrMsg()
    return m.decode() if m else None

def setup(dev=0):
    ck(A.aclInit(None)); ck(A.aclrtSetDevice(dev))

def dmalloc(n, align32=False):
    p = c_void_p(); ck((A.aclrtMallocAlign32 if align32 else A.aclrtMalloc)(byref(p), n, 0)); return p.value

def hmalloc(n):
    p = c_void_p(); ck(A.aclrtMallocHost(byref(p), n)); return p.value

def stream():
    s = c_void_p(); ck(A.aclrtCreateStream(byref(s))); return s.value

def event(flag=None):
    e = c_void_p()
    ck(A.aclrtCreateEvent(byref(e)) if flag is None else A.aclrtCreateEventWithFlag(byref(e), flag))
    return e.value

def outstanding():
    v = [c_uint64() for _ in range(4)]; ck(A.acldoubleOutstanding(*[byref(x) for x in v]))
    return [x.value for x in v]
"""


def run(lib_dir: Path, code: str, timeout: float = 20, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ACLDOUBLE_")}
    e.update(env)
    e["DOUBLE_LIB_DIR"] = str(lib_dir)
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=e, capture_output=True, text=True, timeout=timeout
    )


def ok(lib_dir: Path, code: str, **env: str) -> str:
    p = run(lib_dir, code, **env)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


# ---------------------------------------------------------------- build and loading


def test_builder_cli_prints_only_the_folder(lib_dir):
    p = subprocess.run([sys.executable, str(BUILDER), "--lib-dir"], capture_output=True, text=True, env=os.environ)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(lib_dir)
    assert p.stdout.count("\n") == 1
    for name in ("libacl_rt_impl.so", "libacl_rt.so", "libascendcl.so"):
        assert (lib_dir / name).is_file()


def test_builder_missing_sources_is_a_clear_error(tmp_path):
    env = dict(os.environ, OPBRIDGE_ASCEND_DOUBLE_SRC=str(tmp_path), OPBRIDGE_CACHE_DIR=str(tmp_path / "c"))
    p = subprocess.run([sys.executable, str(BUILDER), "--lib-dir"], capture_output=True, text=True, env=env)
    assert p.returncode == 1 and p.stdout == ""
    assert "sources not found" in p.stderr and "OPBRIDGE_ASCEND_DOUBLE_SRC" in p.stderr


def test_symbols_resolve_through_both_thin_names_to_one_state(lib_dir):
    out = ok(
        lib_dir,
        """
        import ctypes
        RTLD = ctypes.RTLD_GLOBAL
        rt = ctypes.CDLL(os.path.join(LIB, "libacl_rt.so"))
        libc = ctypes.CDLL(None)
        libc.dlsym.restype = c_void_p; libc.dlsym.argtypes = [c_void_p, ctypes.c_char_p]
        assert libc.dlsym(A._handle, b"aclrtMalloc") == libc.dlsym(rt._handle, b"aclrtMalloc") != None
        setup()                                        # through libascendcl.so
        rt.aclInit.argtypes = [ctypes.c_char_p]
        assert rt.aclInit(None) == 100002              # same state through libacl_rt.so
        rt.aclrtMalloc.argtypes = [POINTER(c_void_p), c_size_t, c_int]
        p = c_void_p(); ck(rt.aclrtMalloc(byref(p), 100, 0))
        assert outstanding()[0] == 1
        ck(A.aclrtFree(p.value)); ck(A.aclFinalize())
        print("ok")
        """,
    )
    assert out.strip() == "ok"


# ---------------------------------------------------------------- init, devices, threads


def test_init_and_finalize_codes(lib_dir):
    ok(
        lib_dir,
        """
        p = c_void_p()
        assert A.aclrtMalloc(byref(p), 64, 0) == 100001
        assert "double-only" in msg() and msg() is None        # fetch-and-clear
        assert A.aclFinalize() == 100037
        ck(A.aclInit(None))
        assert A.aclInit(None) == 100002
        m = msg()
        assert m.startswith("EE9999: [PID: %d] " % os.getpid()) and "aclInit: Reason: " in m, m
        assert A.aclrtGetSocName() == b"Ascend910B1"
        maj, mi, pa = c_int32(), c_int32(), c_int32()
        A.aclrtGetVersion.argtypes = [POINTER(c_int32)] * 3
        ck(A.aclrtGetVersion(byref(maj), byref(mi), byref(pa))); assert (maj.value, mi.value, pa.value) == (1, 17, 0)
        buf = ctypes.create_string_buffer(128); ck(A.aclsysGetVersionStr(b"runtime", buf))
        assert buf.value == b"8.5.0.double"
        ck(A.aclFinalize())
        assert A.aclFinalize() == 100037
        ck(A.aclInit(None)); ck(A.aclrtSetDevice(0)); ck(A.aclFinalize())   # re-init works
        """,
    )


def test_context_null_and_device_ids(lib_dir):
    ok(
        lib_dir,
        """
        ck(A.aclInit(None))
        p = c_void_p(); d = c_int32()
        assert A.aclrtMalloc(byref(p), 64, 0) == 107002
        assert A.aclrtGetDevice(byref(d)) == 107002
        n = c_uint32(); ck(A.aclrtGetDeviceCount(byref(n))); assert n.value == 2
        assert A.aclrtSetDevice(2) == 107001
        ck(A.aclrtSetDevice(1)); ck(A.aclrtGetDevice(byref(d))); assert d.value == 1
        res = []
        t = threading.Thread(target=lambda: res.append(A.aclrtMalloc(byref(c_void_p()), 64, 0)))
        t.start(); t.join()
        assert res == [107002]                 # current device is per thread
        ck(A.aclrtResetDevice(1)); assert A.aclrtGetDevice(byref(d)) == 107002
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_DEVICE_COUNT="2",
    )


def test_stream_from_thread_on_other_device(lib_dir):
    ok(
        lib_dir,
        """
        setup(0); s = stream(); e = event()
        res = []
        def other():
            ck(A.aclrtSetDevice(1))
            res.append(A.aclrtSynchronizeStream(s)); res.append(A.aclrtDestroyStream(s))
            res.append(A.aclrtRecordEvent(e, None))
        t = threading.Thread(target=other); t.start(); t.join()
        assert res == [107003, 107003, 107003], res
        res.clear()
        def same():
            ck(A.aclrtSetDevice(0)); res.append(A.aclrtSynchronizeStream(s))
        t = threading.Thread(target=same); t.start(); t.join()
        assert res == [0]
        ck(A.aclrtDestroyEvent(e)); ck(A.aclrtDestroyStream(s)); ck(A.aclFinalize())
        """,
        ACLDOUBLE_DEVICE_COUNT="2",
    )


# ---------------------------------------------------------------- memory


def test_host_dereference_of_device_pointer_segfaults(lib_dir):
    p = run(lib_dir, "setup(); p = dmalloc(64); print('alloc', flush=True); ctypes.string_at(p, 1)")
    assert p.stdout.strip() == "alloc"
    assert p.returncode == -11, (p.returncode, p.stderr)


def test_malloc_layout_capacity_and_meminfo(lib_dir):
    ok(
        lib_dir,
        """
        setup()
        fr, tot = c_size_t(), c_size_t()
        ck(A.aclrtGetMemInfo(1, byref(fr), byref(tot))); assert fr.value == tot.value == 1 << 20
        a = dmalloc(100); b = dmalloc(100)
        assert a % 64 == 0 and b % 64 == 0
        ck(A.aclrtGetMemInfo(1, byref(fr), byref(tot)))
        assert tot.value - fr.value == 2 * 192                  # ALIGN_UP(100,32)+32 = 160 -> 192 reserved
        h = hmalloc(160)
        ck(A.aclrtMemcpy(a, 160, h, 160, 1))                    # the padding is usable
        assert A.aclrtMemcpy(a, 161, h, 161, 1) == 107000      # one past it is not
        c = dmalloc(100, align32=True)
        assert A.aclrtMemcpy(c, 129, h, 129, 1) == 107000      # Align32: ALIGN_UP(100, 32), no padding
        ck(A.aclrtMemcpy(c, 128, h, 128, 1))
        q = c_void_p()
        assert A.aclrtMalloc(byref(q), 1 << 20, 0) == 207001 and "out of memory" in msg()
        assert A.aclrtMalloc(byref(q), 0, 0) == 100000
        assert A.aclrtFree(None) == 100000
        ck(A.aclrtFree(a))
        assert A.aclrtFree(a) == 107000                         # double free
        assert A.aclrtFree(b + 64) == 107000                    # not an allocation start
        assert A.aclrtFreeHost(b) == 107000                     # not from MallocHost
        buf = ctypes.create_string_buffer(64)
        assert A.aclrtFreeHost(ctypes.addressof(buf)) == 107000 and "double-only" in msg()
        ck(A.aclrtFree(b)); ck(A.aclrtFree(c)); ck(A.aclrtFreeHost(h))
        ck(A.aclrtGetMemInfo(1, byref(fr), byref(tot))); assert fr.value == tot.value
        big = dmalloc((1 << 20) - 64)                           # whole capacity fits after frees
        ck(A.aclrtFree(big)); ck(A.aclFinalize())
        """,
        ACLDOUBLE_MEMORY_BYTES=str(1 << 20),
    )


def test_round_trip_through_pinned_memory_is_bit_exact(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        n = 1 << 20
        src = hmalloc(n); dst = hmalloc(n); d = dmalloc(n); d2 = dmalloc(n)
        data = os.urandom(n); ctypes.memmove(src, data, n)
        ck(A.aclrtMemcpyAsync(d, n, src, n, 1, s))
        ck(A.aclrtMemcpyAsync(d2, n, d, n, 3, s))
        ck(A.aclrtMemcpyAsync(dst, n, d2, n, 2, s))
        ck(A.aclrtSynchronizeStream(s))
        assert ctypes.string_at(dst, n) == data
        ck(A.aclrtMemsetAsync(d, n, 0xAB, 4096, s)); ck(A.aclrtSynchronizeStream(s))
        ck(A.aclrtMemcpy(dst, n, d, 4096, 2)); assert ctypes.string_at(dst, 4096) == b"\\xab" * 4096
        for p in (d, d2): ck(A.aclrtFree(p))
        for p in (src, dst): ck(A.aclrtFreeHost(p))
        ck(A.aclrtDestroyStream(s)); ck(A.aclFinalize())
        """,
    )


def test_async_copy_checks_strict(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        d = dmalloc(4096); h = hmalloc(4096); h2 = hmalloc(4096)
        page = ctypes.create_string_buffer(8192); pg = (ctypes.addressof(page) + 63) // 64 * 64
        assert A.aclrtMemcpyAsync(d, 4096, pg, 4096, 1, s) == 107000
        m = msg(); assert "double-only: pageable host memory in an async copy" in m, m
        assert A.aclrtMemcpyAsync(d + 32, 4064, h, 64, 1, s) == 107008 and "double-only" in msg()
        assert A.aclrtMemcpyAsync(d, 4096, h + 32, 64, 1, s) == 107008
        assert A.aclrtMemcpyAsync(d, 64, h, 128, 1, s) == 107000 and "destMax" in msg()
        assert A.aclrtMemcpyAsync(h2, 4096, h, 64, 0, s) == 207000
        assert A.aclrtMemcpyAsync(h2, 4096, h, 64, 4, s) == 207000
        assert A.aclrtMemcpyAsync(d, 8192, h, 8192, 1, s) == 107000      # past the allocation + padding
        assert A.aclrtMemcpyAsync(d, 4096, h, 64, 2, s) == 107000 and "contradicts" in msg()
        assert A.aclrtMemcpyAsync(d, 4096, h, 64, 9, s) == 100000
        ck(A.aclrtMemcpyAsync(d, 4096, h, 0, 1, s))                        # count 0: no-op
        ck(A.aclrtMemcpyAsync(d, 4096, h, 64, 4, s))                       # DEFAULT: decided from pointers
        assert A.aclrtMemsetAsync(pg, 64, 0, 64, s) == 107000              # memset on non-ACL host memory
        ck(A.aclrtSynchronizeStream(s)); ck(A.aclFinalize())
        """,
    )


def test_async_copy_compat_mode(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        d = dmalloc(4096); h = hmalloc(4096)
        page = ctypes.create_string_buffer(8192); pg = (ctypes.addressof(page) + 63) // 64 * 64
        ctypes.memmove(pg, b"x" * 64, 64)
        ck(A.aclrtMemcpyAsync(d, 4096, pg, 64, 1, s))        # pageable: sync + blocking copy
        ck(A.aclrtMemcpyAsync(h, 4096, d, 64, 1, s))         # wrong kind: auto-corrected
        ck(A.aclrtSynchronizeStream(s)); assert ctypes.string_at(h, 64) == b"x" * 64
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_MODE="compat",
    )


def test_use_after_free_poisons_the_pending_task(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        d = dmalloc(1 << 20); h = hmalloc(1 << 20)
        ck(A.aclrtMemcpyAsync(d, 1 << 20, h, 1 << 20, 1, s))
        ck(A.aclrtMemcpyAsync(h, 1 << 20, d, 1 << 20, 2, s))
        ck(A.aclrtFree(d))                                  # returns 0 as real ACL
        assert A.aclrtSynchronizeStream(s) == 507015
        m = msg(); assert "use-after-free" in m, m
        ck(A.aclrtSynchronizeStream(s))
        assert outstanding()[0] == 0
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_LAUNCH_US="20000",
    )


def test_copy_bandwidth_model(lib_dir):
    out = ok(
        lib_dir,
        """
        setup(); s = stream(); n = 64 << 20
        d = dmalloc(n); h = hmalloc(n)
        t0 = time.monotonic(); ck(A.aclrtMemcpyAsync(d, n, h, n, 1, s)); t1 = time.monotonic()
        ck(A.aclrtSynchronizeStream(s)); t2 = time.monotonic()
        print(t1 - t0, t2 - t0)
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_COPY_GBPS="1",
        ACLDOUBLE_MEMORY_BYTES=str(128 << 20),
    )
    enqueue, total = map(float, out.split())
    assert total >= 0.060 and enqueue < total / 2, (enqueue, total)  # the copy runs on the worker


# ---------------------------------------------------------------- callbacks


def test_callbacks(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        got = []
        @CB
        def cb(data):
            got.append(data)
            got.append(A.aclrtSynchronizeStream(s))           # forbidden inside a callback
        assert A.aclrtLaunchCallback(cb, 1, 0, s) == 107015
        assert A.aclrtProcessReport(100) == 107012            # this thread is not subscribed
        stop = threading.Event(); rcs = []
        def reporter():
            ck(A.aclrtSetDevice(0))
            while not stop.is_set():
                rcs.append(A.aclrtProcessReport(50))
        t = threading.Thread(target=reporter); t.start()
        ck(A.aclrtSubscribeReport(t.ident, s))
        assert A.aclrtSubscribeReport(t.ident, s) == 107011
        assert A.aclrtLaunchCallback(cb, 1, 2, s) == 100000
        for i in range(1, 6):
            ck(A.aclrtLaunchCallback(cb, i, i % 2, s))
        ck(A.aclrtSynchronizeStream(s))
        time.sleep(0.1)
        assert got[0::2] == [1, 2, 3, 4, 5] and set(got[1::2]) == {107000}, got
        assert A.aclrtLaunchHostFunc(s, cb, 1) == 107011        # mixing the families
        stop.set(); t.join()
        assert 507012 in rcs                                     # idle ProcessReport times out
        ck(A.aclrtUnSubscribeReport(t.ident, s))
        assert A.aclrtProcessReport(0) == 100000
        s2 = stream(); hf = []
        hfn = CB(lambda a: hf.append(a))
        ck(A.aclrtLaunchHostFunc(s2, hfn, 7)); ck(A.aclrtSynchronizeStream(s2))
        assert hf == [7]
        ck(A.aclrtDestroyStream(s)); ck(A.aclrtDestroyStream(s2)); ck(A.aclFinalize())
        """,
    )


def test_process_report_timeout(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        me = threading.get_ident()
        ck(A.aclrtSubscribeReport(me, s))
        t0 = time.monotonic(); assert A.aclrtProcessReport(100) == 507012; dt = time.monotonic() - t0
        assert 0.09 <= dt < 1, dt
        ck(A.aclrtUnSubscribeReport(me, s)); ck(A.aclrtDestroyStream(s)); ck(A.aclFinalize())
        """,
    )


# ---------------------------------------------------------------- events and streams


def test_events_query_sync_elapsed(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream(); a = event(); b = event(); st = c_int(); ms = c_float()
        ck(A.aclrtQueryEventStatus(a, byref(st))); assert st.value == 1       # never recorded = complete
        assert A.aclrtEventElapsedTime(byref(ms), a, b) == 507000
        d = dmalloc(64)
        ck(A.aclrtRecordEvent(a, s)); ck(A.aclrtMemsetAsync(d, 64, 0, 64, s)); ck(A.aclrtRecordEvent(b, s))
        ck(A.aclrtQueryEventStatus(b, byref(st))); assert st.value == 0       # NOT_READY = 0
        ck(A.aclrtQueryEvent(b, byref(st))); assert st.value == 1             # deprecated: NOT_READY = 1
        ss = c_int(); ck(A.aclrtStreamQuery(s, byref(ss))); assert ss.value == 1
        assert A.aclrtSynchronizeStreamWithTimeout(s, 0) == 107000
        assert A.aclrtSynchronizeStreamWithTimeout(s, 5) == 507046
        ck(A.aclrtSynchronizeEvent(b))
        ck(A.aclrtQueryEventStatus(b, byref(st))); assert st.value == 1
        ck(A.aclrtQueryEvent(b, byref(st))); assert st.value == 0
        ck(A.aclrtEventElapsedTime(byref(ms), a, b))
        assert ms.value >= 2 * 50.0 * 0.95, ms.value                          # memset + record, 50 ms each
        c = event(1)                                                          # SYNC only: no TIME_LINE
        ck(A.aclrtRecordEvent(c, s)); ck(A.aclrtSynchronizeStream(s))
        assert A.aclrtEventElapsedTime(byref(ms), a, c) == 107006
        n = event(8)                                                          # no SYNC: cannot be waited on
        assert A.aclrtStreamWaitEvent(s, n) == 107000
        assert A.aclrtCreateEventWithFlag(byref(c_void_p()), 0x4) == 107000
        for e in (a, b, c, n): ck(A.aclrtDestroyEvent(e))
        ck(A.aclrtFree(d)); ck(A.aclrtDestroyStream(s)); ck(A.aclFinalize())
        """,
        ACLDOUBLE_LAUNCH_US="50000",
    )


def test_stream_wait_event_orders_two_streams(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s1 = stream(); s2 = stream(); e = event()
        n = 1 << 16; d = dmalloc(n); h = hmalloc(n); out = hmalloc(n)
        ctypes.memmove(h, b"\\x07" * n, n)
        ck(A.aclrtMemsetAsync(d, n, 1, n, s1))              # s1's copy lands only after ~300 ms:
        ck(A.aclrtMemsetAsync(d, n, 2, n, s1))              # three tasks, 100 ms launch latency each
        ck(A.aclrtMemcpyAsync(d, n, h, n, 1, s1))
        ck(A.aclrtRecordEvent(e, s1))
        ck(A.aclrtStreamWaitEvent(s2, e))
        ck(A.aclrtMemcpyAsync(out, n, d, n, 2, s2))         # must see s1's copy
        ck(A.aclrtSynchronizeStream(s2))
        assert ctypes.string_at(out, n) == b"\\x07" * n
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_LAUNCH_US="100000",
    )


def test_fault_injection(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream()
        d = dmalloc(64)
        assert A.aclrtMalloc(byref(c_void_p()), 64, 0) == 207001 and "ACLDOUBLE_FAIL" in msg()
        d3 = dmalloc(64)
        h = hmalloc(64)
        ck(A.aclrtMemcpyAsync(d, 64, h, 64, 1, s))         # task 1: fails
        ck(A.aclrtMemcpyAsync(d3, 64, h, 64, 1, s))        # CONTINUE mode: runs
        assert A.aclrtSynchronizeStream(s) == 507015 and "task:1" in msg()
        ck(A.aclrtSynchronizeStream(s))                    # error consumed; stream usable
        ck(A.aclrtMemcpyAsync(d, 64, h, 64, 1, s)); ck(A.aclrtSynchronizeStream(s))
        assert A.aclrtMemcpyAsync(d, 64, h, 64, 1, s) == 107000   # aclrtMemcpyAsync:3 (natural code)
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_FAIL="aclrtMalloc:2,task:1,aclrtMemcpyAsync:4",
    )


def test_stop_on_failure_refuses_new_tasks(lib_dir):
    ok(
        lib_dir,
        """
        setup(); s = stream(); ck(A.aclrtSetStreamFailureMode(s, 1))
        d = dmalloc(64); h = hmalloc(64); ctypes.memmove(h, b"a" * 64, 64)
        ck(A.aclrtMemsetAsync(d, 64, 0x11, 64, s))          # task 1 fails
        ck(A.aclrtMemcpyAsync(h, 64, d, 64, 2, s))          # discarded
        time.sleep(0.05)
        assert A.aclrtMemsetAsync(d, 64, 0, 64, s) == 507015
        assert A.aclrtSynchronizeStream(s) == 507015
        assert ctypes.string_at(h, 64) == b"a" * 64
        ck(A.aclrtMemsetAsync(d, 64, 0, 64, s)); ck(A.aclrtSynchronizeStream(s))
        ck(A.aclFinalize())
        """,
        ACLDOUBLE_FAIL="task:1",
    )


# ---------------------------------------------------------------- finalize report


def test_finalize_report(lib_dir, tmp_path):
    report = tmp_path / "report.jsonl"
    code_leak = "setup(); dmalloc(64); hmalloc(64); stream(); event(); ck(A.aclFinalize())"
    p = run(lib_dir, code_leak, ACLDOUBLE_REPORT_FILE=str(report))
    assert p.returncode == 0, p.stderr
    assert "acldouble: outstanding" in p.stderr
    clean = """
        setup(); d = dmalloc(64); h = hmalloc(64); s = stream(); e = event()
        assert outstanding() == [1, 1, 1, 1]
        ck(A.aclrtDestroyEvent(e)); ck(A.aclrtDestroyStream(s)); ck(A.aclrtFree(d)); ck(A.aclrtFreeHost(h))
        assert outstanding() == [0, 0, 0, 0]
        ck(A.aclFinalize())
    """
    p = run(lib_dir, clean, ACLDOUBLE_REPORT_FILE=str(report))
    assert p.returncode == 0, p.stderr
    assert "outstanding" not in p.stderr
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(lines) == 2
    leak, ok_ = lines
    assert (leak["device_allocs"], leak["host_allocs"], leak["streams"], leak["events"]) == (1, 1, 1, 1)
    assert (ok_["device_allocs"], ok_["host_allocs"], ok_["streams"], ok_["events"]) == (0, 0, 0, 0)


# ---------------------------------------------------------------- internal API for sibling doubles


def test_internal_kernel_api(lib_dir):
    ok(
        lib_dir,
        """
        impl = ctypes.CDLL(os.path.join(LIB, "libacl_rt_impl.so"))
        RUN = ctypes.CFUNCTYPE(c_int, c_void_p); REL = ctypes.CFUNCTYPE(None, c_void_p)
        impl.acldouble_enqueue_kernel.argtypes = [c_void_p, ctypes.c_char_p, RUN, c_void_p, REL]
        impl.acldouble_device_view.argtypes = [c_void_p, c_size_t]; impl.acldouble_device_view.restype = c_void_p
        impl.acldouble_is_device_range.argtypes = [c_void_p, c_size_t]
        setup(); s = stream(); d = dmalloc(64); h = hmalloc(64)
        assert impl.acldouble_is_device_range(d, 96) == 1 and impl.acldouble_is_device_range(d, 97) == 0
        assert impl.acldouble_device_view(d, 64) is None                  # not a worker thread
        released = []
        @RUN
        def fill(ctx):
            v = impl.acldouble_device_view(d, 64)
            if v is None or impl.acldouble_device_view(d + 64, 64) is not None:
                return 1
            ctypes.memset(v, 0x5A, 64); return 0
        @RUN
        def broken(ctx):
            return 3
        @REL
        def rel(ctx):
            released.append(ctx)
        ck(impl.acldouble_enqueue_kernel(s, b"fill", fill, 1, rel))
        ck(A.aclrtMemcpyAsync(h, 64, d, 64, 2, s)); ck(A.aclrtSynchronizeStream(s))
        assert ctypes.string_at(h, 64) == b"Z" * 64
        ck(impl.acldouble_enqueue_kernel(s, b"broken_kernel", broken, 2, rel))
        assert A.aclrtSynchronizeStream(s) == 507015 and "broken_kernel" in msg()
        assert released == [1, 2]
        ck(A.aclFinalize())
        """,
    )


def test_kernel_binaries_load_launch_and_refuse(lib_dir, tmp_path):
    source = tmp_path / "k.c"
    source.write_text(
        '#include "acldouble_kernel.h"\n'
        'ACLDOUBLE_KERNEL_ARGS(fill, "pil")\n'
        "__global__ __aicore__ void fill(GM_ADDR p, uint32_t n, int64_t v) {\n"
        "    for (uint32_t i = GetBlockIdx(); i < n; i += GetBlockNum()) ((int64_t *)p)[i] = v + (int64_t)i;\n"
        "}\n"
    )
    binary = _load_builder().compile_kernel(source, tmp_path / "k.so")
    out = ok(
        lib_dir,
        f"""
        import struct
        for n, a in {{"aclrtBinaryLoadFromFile": [ctypes.c_char_p, c_void_p, POINTER(c_void_p)],
                      "aclrtBinaryLoadFromData": [c_void_p, c_size_t, c_void_p, POINTER(c_void_p)],
                      "aclrtBinaryGetFunction": [c_void_p, ctypes.c_char_p, POINTER(c_void_p)],
                      "aclrtBinaryUnLoad": [c_void_p],
                      "aclrtLaunchKernelWithHostArgs": [c_void_p, c_uint32, c_void_p, c_void_p, c_void_p, c_size_t,
                                                        c_void_p, c_size_t]}}.items():
            getattr(A, n).argtypes = a
        path = {str(binary)!r}.encode()
        b, f = c_void_p(), c_void_p()
        assert A.aclrtBinaryLoadFromFile(path, None, byref(b)) == 100001   # before aclInit
        setup()
        assert A.aclrtBinaryLoadFromFile(b"/nonexistent.so", None, byref(b)) == 100003
        ck(A.aclrtBinaryLoadFromFile(path, None, byref(b)))
        assert A.aclrtBinaryGetFunction(b, b"missing", byref(f)) == 107000
        ck(A.aclrtBinaryGetFunction(b, b"fill", byref(f)))
        s = stream()
        p = dmalloc(8 * 100)
        args = struct.pack("=QIxxxxq", p, 100, 7)            # C layout: pointer, uint32 (+4 pad), int64
        buf = ctypes.create_string_buffer(args, len(args))
        assert A.aclrtLaunchKernelWithHostArgs(f, 0, s, None, buf, len(args), None, 0) == 100000   # no blocks
        assert A.aclrtLaunchKernelWithHostArgs(f, 3, s, None, buf, len(args) - 8, None, 0) == 100000  # short
        host = (ctypes.c_int64 * 4)()
        bad = ctypes.create_string_buffer(struct.pack("=QIxxxxq", ctypes.addressof(host), 4, 1), len(args))
        assert A.aclrtLaunchKernelWithHostArgs(f, 3, s, None, bad, len(args), None, 0) == 107000     # host pointer
        assert "not device memory" in msg()
        ck(A.aclrtLaunchKernelWithHostArgs(f, 3, s, None, buf, len(args), None, 0))
        got = (ctypes.c_int64 * 100)()
        ck(A.aclrtSynchronizeStream(s))
        ck(A.aclrtMemcpy(got, 800, p, 800, 2))
        assert list(got) == [7 + i for i in range(100)], list(got)[:5]
        # unloading with a launch queued: the launch still runs, then the binary goes
        ck(A.aclrtLaunchKernelWithHostArgs(f, 1, s, None, buf, len(args), None, 0))
        ck(A.aclrtBinaryUnLoad(b))
        assert A.aclrtBinaryUnLoad(b) == 107000
        assert A.aclrtLaunchKernelWithHostArgs(f, 1, s, None, buf, len(args), None, 0) == 107000
        ck(A.aclrtSynchronizeStream(s))
        data = open(path.decode(), "rb").read()
        ck(A.aclrtBinaryLoadFromData(data, len(data), None, byref(b)))
        ck(A.aclrtBinaryGetFunction(b, b"fill", byref(f)))
        ck(A.aclrtBinaryUnLoad(b))
        ck(A.aclrtFree(p)); ck(A.aclrtDestroyStream(s)); ck(A.aclrtResetDevice(0)); ck(A.aclFinalize())
        print("done")
        """,
    )
    assert out.strip() == "done"
