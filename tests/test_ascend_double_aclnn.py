"""The aclnn part of the Ascend test double (libnnopbase.so, libopapi_math.so, libopapi_nn.so,
libopapi.so): results bit-identical to numpy, the checks of notes §6.2 rows 34-36, executor and
tensor lifetimes, fault injection and the timing model.

Every scenario initializes ACL, so each runs in a fresh interpreter (subprocess). All libraries come
from the double's builder (python/opbridge/testing/ascend_double.py, imported by path).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "python" / "opbridge" / "testing" / "ascend_double.py"


def _load_builder():
    spec = importlib.util.spec_from_file_location("ascend_double_builder_aclnn", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def libdir(tmp_path_factory) -> Path:
    """The builder's folder: the runtime double and the aclnn libraries (built if needed)."""
    os.environ.setdefault("OPBRIDGE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    d = _load_builder().lib_dir()
    for name in ("libnnopbase.so", "libopapi_math.so", "libopapi_nn.so", "libopapi.so"):
        assert (d / name).is_file(), name
    return d


PRELUDE = r"""
import ctypes, os, sys, time
import numpy as np
LIB = sys.argv[1]
G = os.RTLD_GLOBAL
rt = ctypes.CDLL(os.path.join(LIB, "libacl_rt_impl.so"), mode=G)
nn = ctypes.CDLL(os.path.join(LIB, "libnnopbase.so"), mode=G)
math_ = ctypes.CDLL(os.path.join(LIB, "libopapi_math.so"), mode=G)
nnops = ctypes.CDLL(os.path.join(LIB, "libopapi_nn.so"), mode=G)
P, U64, I64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
nn.aclCreateTensor.restype = P
nn.aclCreateTensor.argtypes = [ctypes.POINTER(I64), U64, ctypes.c_int, ctypes.POINTER(I64), I64,
                               ctypes.c_int, ctypes.POINTER(I64), U64, P]
nn.aclCreateScalar.restype = P
nn.aclCreateScalar.argtypes = [P, ctypes.c_int]
for f in ("aclDestroyTensor", "aclDestroyScalar", "aclDestroyAclOpExecutor",
          "aclSetAclOpExecutorRepeatable"):
    getattr(nn, f).argtypes = [P]
nn.acldoubleAclnnLastErrMsg.restype = ctypes.c_char_p
rt.aclrtMalloc.argtypes = [ctypes.POINTER(P), ctypes.c_size_t, ctypes.c_int]
rt.aclrtFree.argtypes = [P]
rt.aclrtMemcpy.argtypes = [P, ctypes.c_size_t, P, ctypes.c_size_t, ctypes.c_int]
rt.aclrtSynchronizeStream.argtypes = [P]
rt.aclrtCreateStream.argtypes = [ctypes.POINTER(P)]
rt.aclrtDestroyStream.argtypes = [P]

DT = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 3, np.dtype(np.int64): 9,
      np.dtype(np.float64): 11, np.dtype(np.bool_): 12}
assert rt.aclInit(None) == 0
assert rt.aclrtSetDevice(0) == 0
STREAM = P()
assert rt.aclrtCreateStream(ctypes.byref(STREAM)) == 0
ALLOCS = []

def dmalloc(n):
    p = P()
    assert rt.aclrtMalloc(ctypes.byref(p), max(n, 1), 0) == 0
    ALLOCS.append(p.value)
    return p.value

def dfree(p):
    ALLOCS.remove(p)
    assert rt.aclrtFree(p) == 0

def upload(arr):
    arr = np.ascontiguousarray(arr)
    p = dmalloc(arr.nbytes)
    if arr.nbytes:
        assert rt.aclrtMemcpy(p, arr.nbytes, arr.ctypes.data, arr.nbytes, 1) == 0
    return p

def download(p, shape, dtype, storage=None):
    n = int(np.prod(shape)) if storage is None else storage
    out = np.empty(n, dtype)
    if out.nbytes:
        assert rt.aclrtMemcpy(out.ctypes.data, out.nbytes, p, out.nbytes, 2) == 0
    return out if storage is not None else out.reshape(shape)

def i64s(vals):
    vals = list(vals)
    return (I64 * max(len(vals), 1))(*vals)

def tensor(p, shape, dtype, strides=None, offset=0, storage=None):
    shape = list(shape)
    if strides is None:
        strides, acc = [], 1
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= d
    if storage is None:
        storage = offset + sum((d - 1) * s for d, s in zip(shape, strides)) + 1 if all(shape) else 0
    t = nn.aclCreateTensor(i64s(shape), len(shape), DT[np.dtype(dtype)], i64s(strides), offset, 2,
                           i64s([storage]), 1, p)
    return t

def dev_tensor(arr):
    # a device copy of arr and a contiguous tensor over it
    p = upload(arr)
    t = tensor(p, arr.shape, arr.dtype)
    assert t, nn.acldoubleAclnnLastErrMsg()
    return p, t

def dev_transposed(arr2d):
    # arr2d.T as a strided (transposed) view over a contiguous device copy of arr2d
    p = upload(arr2d)
    r, c = arr2d.shape
    t = tensor(p, (c, r), arr2d.dtype, strides=(1, c))
    assert t
    return p, t

def scalar(value, dtype):
    v = np.array([value], dtype=dtype)
    s = nn.aclCreateScalar(v.ctypes.data, DT[np.dtype(dtype)])
    assert s
    return s

def op(lib, name, *args, ws_override=None, expect=0, expect2=0):
    ws = U64(0)
    ex = P()
    phase1 = getattr(lib, name + "GetWorkspaceSize")
    rc = phase1(*args, ctypes.byref(ws), ctypes.byref(ex))
    assert rc == expect, (name, rc, nn.acldoubleAclnnLastErrMsg())
    if rc:
        return rc
    wsp = dmalloc(ws.value) if ws.value else None
    size = ws.value if ws_override is None else ws_override
    rc = getattr(lib, name)(P(wsp), U64(size), ex, STREAM)
    assert rc == expect2, (name, rc, nn.acldoubleAclnnLastErrMsg())
    assert rt.aclrtSynchronizeStream(STREAM) == 0
    if wsp:
        dfree(wsp)
    return rc

def bits_equal(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
    if got.dtype.kind == "f":
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(got), nan), (got, ref)
        u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
        ok = got.view(u) == ref.view(u)
        assert np.all(ok | nan), (got[~(ok | nan)], ref[~(ok | nan)])
    else:
        assert np.array_equal(got, ref), (got, ref)

def counts():
    t, s, e = U64(), U64(), U64()
    assert nn.acldoubleAclnnOutstanding(ctypes.byref(t), ctypes.byref(s), ctypes.byref(e)) == 0
    return t.value, s.value, e.value

def finish():
    for p in list(ALLOCS):
        dfree(p)
    assert counts() == (0, 0, 0), counts()
    assert rt.aclrtDestroyStream(STREAM) == 0
    assert rt.aclrtResetDevice(0) == 0
    assert rt.aclFinalize() == 0
    print("OK")
"""


def run_scenario(libdir: Path, body: str, env_extra: dict | None = None, timeout: float = 60):
    code = PRELUDE + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACLDOUBLE_")}
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", code, str(libdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc


def test_binary_ops_bit_exact_with_broadcast_and_strides(libdir):
    run_scenario(
        libdir,
        r"""
        rng = np.random.default_rng(1)
        np.seterr(all="ignore")
        for dt in (np.float16, np.float32, np.float64, np.int32, np.int64):
            if np.dtype(dt).kind == "f":
                a2 = (rng.standard_normal((5, 4)) * 10).astype(dt)
                b = (rng.standard_normal((3, 1, 5)) * 10).astype(dt)
                a2[0, 0], b[0, 0, 1], a2[1, 1] = np.nan, np.nan, np.inf
                alpha_dt, alpha = np.float32, 2.5
            else:
                info = np.iinfo(dt)
                a2 = rng.integers(-1000, 1000, (5, 4)).astype(dt)
                b = rng.integers(-1000, 1000, (3, 1, 5)).astype(dt)
                a2[0, 0], a2[0, 1], b[0, 0, 0] = info.max, info.min, info.max  # wrap-around
                b[1, 0, 2] = 0
                alpha_dt, alpha = dt, 3
            a = a2.T                     # (4, 5) strided view
            pa, ta = dev_transposed(a2)
            pb, tb = dev_tensor(b)
            al = scalar(alpha, alpha_dt)
            al_ref = np.array(alpha, dtype=dt)
            refs = {
                "aclnnAdd": a + al_ref * b,
                "aclnnSub": a - al_ref * b,
                "aclnnMul": a * b,
                "aclnnMaximum": np.maximum(a, b),
                "aclnnMinimum": np.minimum(a, b),
            }
            if np.dtype(dt).kind == "f":
                refs["aclnnDiv"] = a / b
                refs["aclnnPowTensorTensor"] = np.power(np.abs(a), b / 4)
            else:
                refs["aclnnDiv"] = (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)
            for name, ref in refs.items():
                po = dmalloc(ref.nbytes)
                to = tensor(po, ref.shape, ref.dtype)
                if name in ("aclnnAdd", "aclnnSub"):
                    op(math_, name, P(ta), P(tb), P(al), P(to))
                elif name == "aclnnPowTensorTensor":
                    pa2, ta2 = dev_tensor(np.abs(a))
                    pb2, tb2 = dev_tensor(b / 4)
                    op(math_, name, P(ta2), P(tb2), P(to))
                    nn.aclDestroyTensor(P(ta2)); nn.aclDestroyTensor(P(tb2))
                else:
                    op(math_, name, P(ta), P(tb), P(to))
                got = download(po, ref.shape, ref.dtype)
                if name == "aclnnPowTensorTensor" and dt in (np.float32, np.float64):
                    # numpy's float32/float64 power is SIMD (SVML) code on AVX-512 machines, not
                    # libm's pow()/powf(): equal to within an ulp or two, not bit for bit
                    assert np.array_equal(np.isnan(got), np.isnan(ref))
                    assert np.allclose(got, ref, rtol=4 * np.finfo(dt).eps, atol=0, equal_nan=True)
                else:
                    bits_equal(got, ref)
                nn.aclDestroyTensor(P(to))
            if np.dtype(dt).kind == "i":
                # integer pow (non-negative exponents, wrapping)
                base = rng.integers(-9, 9, (4, 5)).astype(dt)
                ex_ = rng.integers(0, 12, (5,)).astype(dt)
                p1, t1 = dev_tensor(base)
                p2, t2 = dev_tensor(ex_)
                po = dmalloc(base.nbytes)
                to = tensor(po, base.shape, dt)
                op(math_, "aclnnPowTensorTensor", P(t1), P(t2), P(to))
                bits_equal(download(po, base.shape, dt), np.power(base, ex_))
                for t in (t1, t2, to):
                    nn.aclDestroyTensor(P(t))
            for t in (ta, tb):
                nn.aclDestroyTensor(P(t))
            nn.aclDestroyScalar(P(al))
        # in place: out aliases self (aclnnInplaceAdd-style use of aclnnAdd)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        px, tx = dev_tensor(x)
        one = scalar(1.0, np.float32)
        op(math_, "aclnnAdd", P(tx), P(tx), P(one), P(tx))
        bits_equal(download(px, x.shape, x.dtype), x + x)
        nn.aclDestroyTensor(P(tx)); nn.aclDestroyScalar(P(one))
        finish()
        """,
    )


def test_cast_all_pairs_and_inplace_copy(libdir):
    run_scenario(
        libdir,
        r"""
        rng = np.random.default_rng(2)
        np.seterr(all="ignore")
        dts = (np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_)
        wide = np.concatenate([rng.standard_normal(64) * s for s in (1e-7, 1e-3, 1, 1e3, 7e4, 1e40)])
        wide = np.concatenate([wide, [0.0, -0.0, np.inf, -np.inf, np.nan, 0.5, -0.5, 2.5, 65504.0, 65520.0]])
        small = np.concatenate([rng.uniform(-100, 100, 64), [0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 99.99]])
        ints = np.concatenate([rng.integers(-100000, 100000, 64), [0, 1, -1, 2**24 + 1, 65519, 65520]])
        for src in dts:
            for dst in dts:
                if np.dtype(src).kind == "f":
                    vals = wide if np.dtype(dst).kind == "f" else small
                elif np.dtype(src).kind == "i":
                    vals = ints
                else:
                    vals = rng.integers(0, 2, 70)
                a = np.asarray(vals).astype(src).reshape(1, -1).repeat(2, 0)  # (2, n)
                ref = a.astype(dst)
                pa, ta = dev_tensor(a)
                po = dmalloc(ref.nbytes)
                to = tensor(po, ref.shape, dst)
                op(math_, "aclnnCast", P(ta), DT[np.dtype(dst)], P(to))
                bits_equal(download(po, ref.shape, ref.dtype), ref)
                nn.aclDestroyTensor(P(ta)); nn.aclDestroyTensor(P(to))
        # out-of-range float -> int is UB in numpy: any value, no crash
        bad = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30], np.float64)
        for dst in (np.int32, np.int64):
            pa, ta = dev_tensor(bad)
            po = dmalloc(bad.size * 8)
            to = tensor(po, bad.shape, dst)
            op(math_, "aclnnCast", P(ta), DT[np.dtype(dst)], P(to))
            nn.aclDestroyTensor(P(ta)); nn.aclDestroyTensor(P(to))
        # bf16 round trip (no numpy bf16: reference by bit manipulation, round to nearest even)
        f = (rng.standard_normal(100) * 100).astype(np.float32)
        u = f.view(np.uint32).astype(np.uint64)
        ref = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
        pa, ta = dev_tensor(f)
        pb = dmalloc(f.size * 2)
        tb = nn.aclCreateTensor(i64s([f.size]), 1, 27, i64s([1]), 0, 2, i64s([f.size]), 1, pb)
        pc = dmalloc(f.nbytes)
        tc = tensor(pc, f.shape, np.float32)
        op(math_, "aclnnCast", P(ta), 27, P(tb))
        op(math_, "aclnnCast", P(tb), 0, P(tc))
        bits_equal(download(pc, f.shape, np.float32), ref)
        for t in (ta, tb, tc):
            nn.aclDestroyTensor(P(t))
        # InplaceCopy: a transposed view into a contiguous tensor ("contiguous")
        m = rng.standard_normal((5, 7)).astype(np.float32)
        pm, tm = dev_transposed(m)
        pd = dmalloc(m.nbytes)
        td = tensor(pd, (7, 5), np.float32)
        op(math_, "aclnnInplaceCopy", P(td), P(tm))
        bits_equal(download(pd, (7, 5), np.float32), np.ascontiguousarray(m.T))
        # with broadcasting and a dtype change, into a strided view with an offset
        row = rng.standard_normal((1, 5)).astype(np.float64)
        pr, tr = dev_tensor(row)
        storage = np.zeros(3 + 4 * 10, np.float16)
        ps = upload(storage)
        tv = tensor(ps, (4, 5), np.float16, strides=(10, 2), offset=3, storage=storage.size)
        assert tv
        op(math_, "aclnnInplaceCopy", P(tv), P(tr))
        want = storage.copy()
        want[3:].reshape(4, 10)[:, 0:10:2] = row.astype(np.float16)
        bits_equal(download(ps, None, np.float16, storage=storage.size), want)
        for t in (tm, td, tr, tv):
            nn.aclDestroyTensor(P(t))
        finish()
        """,
    )


def test_matmul_shapes_and_dtypes(libdir):
    run_scenario(
        libdir,
        r"""
        rng = np.random.default_rng(3)
        cases = [((7, 13), (13, 9)), ((2, 1, 3, 4), (5, 4, 6)), ((4,), (4, 6)), ((3, 4), (4,)),
                 ((4,), (4,)), ((2, 3, 4), (4,)), ((1, 2), (2, 9000))]
        for dt in (np.float16, np.float32, np.float64, np.int32, np.int64):
            for sa, sb in cases:
                if np.dtype(dt).kind == "f":
                    a = rng.standard_normal(sa).astype(dt)
                    b = rng.standard_normal(sb).astype(dt)
                else:
                    a = rng.integers(-2**20, 2**20, sa).astype(dt)
                    b = rng.integers(-2**20, 2**20, sb).astype(dt)
                with np.errstate(all="ignore"):
                    ref = np.matmul(a, b)
                ref = np.asarray(ref, dtype=dt)
                pa, ta = dev_tensor(a)
                pb, tb = dev_tensor(b)
                po = dmalloc(ref.nbytes)
                to = tensor(po, ref.shape, dt)
                op(nnops, "aclnnMatmul", P(ta), P(tb), P(to), ctypes.c_int8(0))
                got = download(po, ref.shape, dt)
                if np.dtype(dt).kind == "f":
                    tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5,
                           np.dtype(np.float64): 1e-12}[np.dtype(dt)]
                    ref64 = np.matmul(a.astype(np.float64), b.astype(np.float64))
                    assert np.allclose(got, ref64, rtol=tol, atol=tol * 4), (dt, sa, sb)
                else:
                    bits_equal(got, ref)
                for t in (ta, tb, to):
                    nn.aclDestroyTensor(P(t))
        # transposed mat2 (strided)
        a = rng.standard_normal((3, 4)).astype(np.float32)
        b2 = rng.standard_normal((6, 4)).astype(np.float32)
        pa, ta = dev_tensor(a)
        pb, tb = dev_transposed(b2)
        po = dmalloc(3 * 6 * 4)
        to = tensor(po, (3, 6), np.float32)
        op(nnops, "aclnnMatmul", P(ta), P(tb), P(to), ctypes.c_int8(1))
        assert np.allclose(download(po, (3, 6), np.float32), a @ b2.T, rtol=1e-5, atol=1e-5)
        for t in (ta, tb, to):
            nn.aclDestroyTensor(P(t))
        finish()
        """,
    )


def test_error_codes_lifetimes_and_combined_library(libdir):
    run_scenario(
        libdir,
        r"""
        def last():
            m = nn.acldoubleAclnnLastErrMsg()
            return m.decode() if m else ""
        a = np.ones((2, 3), np.float32)
        pa, ta = dev_tensor(a)
        pb, tb = dev_tensor(np.ones((4,), np.float32))
        po = dmalloc(2 * 3 * 8)
        to = tensor(po, (2, 3), np.float32)
        to64 = tensor(po, (2, 3), np.float64)
        toi = tensor(po, (2, 3), np.int32)
        one = scalar(1.0, np.float32)
        ws, ex = U64(), P()
        # row 34: NULL tensor / scalar / out-pointer -> 161001
        assert math_.aclnnAddGetWorkspaceSize(None, P(ta), P(one), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 161001
        assert "self is NULL" in last()
        assert math_.aclnnAddGetWorkspaceSize(P(ta), P(ta), None, P(to), ctypes.byref(ws), ctypes.byref(ex)) == 161001
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(ta), P(to), None, ctypes.byref(ex)) == 161001
        # shapes not broadcastable, wrong out shape / dtype -> 161002
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(tb), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 161002
        assert "broadcastable" in last()
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(ta), P(tb), ctypes.byref(ws), ctypes.byref(ex)) == 161002
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(ta), P(to64), ctypes.byref(ws), ctypes.byref(ex)) == 161002
        pi, ti = dev_tensor(np.ones((2, 3), np.int32))
        assert math_.aclnnDivGetWorkspaceSize(P(ti), P(ti), P(toi), ctypes.byref(ws), ctypes.byref(ex)) == 161002
        assert "true division" in last()
        def mm1(a, b, o):
            return nnops.aclnnMatmulGetWorkspaceSize(P(a), P(b), P(o), ctypes.c_int8(0), ctypes.byref(ws),
                                                     ctypes.byref(ex))
        assert mm1(ta, ta, to) == 161002
        assert counts()[2] == 0
        # workspace too small / NULL -> 161002 (double-only); the executor stays live for a retry
        pm, tm = dev_tensor(np.ones((3, 2), np.float32))
        pq = dmalloc(4 * 4)
        tq = tensor(pq, (2, 2), np.float32)
        assert mm1(ta, tm, tq) == 0
        assert ws.value > 0
        small = dmalloc(16)
        assert nnops.aclnnMatmul(P(small), U64(16), ex, STREAM) == 161002
        assert "double" in last()
        assert nnops.aclnnMatmul(None, ws, ex, STREAM) == 161002
        big = dmalloc(ws.value)
        assert nnops.aclnnMatmul(P(big), U64(ws.value - 1), ex, STREAM) == 161002
        assert nnops.aclnnMatmul(P(big), ws, ex, STREAM) == 0
        # row 35: phase 2 twice -> 161002 (double-only); destroy NULL -> 561103
        assert nnops.aclnnMatmul(P(big), ws, ex, STREAM) == 161002
        assert "already run" in last()
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        assert np.array_equal(download(pq, (2, 2), np.float32), np.full((2, 2), 3, np.float32))
        assert nn.aclDestroyAclOpExecutor(None) == 561103
        assert nnops.aclnnMatmul(P(big), ws, None, STREAM) == 161001
        # destroying a non-repeatable executor is phase 2's job
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(ta), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert nn.aclDestroyAclOpExecutor(ex) == 161002
        # an executor of another op is refused
        assert nnops.aclnnMatmul(None, U64(0), ex, STREAM) == 161002
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        # repeatable executor: run twice, destroyed by the caller
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(ta), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert nn.aclSetAclOpExecutorRepeatable(ex) == 0
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        assert counts()[2] == 1
        assert nn.aclDestroyAclOpExecutor(ex) == 0
        assert counts()[2] == 0
        # row 36: aclCreateTensor on a host pointer, unaligned, NULL dims, negative stride, beyond storage
        host = np.zeros(64, np.float32)
        hp = (host.ctypes.data + 31) & ~31
        assert nn.aclCreateTensor(i64s([4]), 1, 0, i64s([1]), 0, 2, i64s([4]), 1, hp) is None
        assert "device allocation" in last()
        assert nn.aclCreateTensor(i64s([4]), 1, 0, i64s([1]), 0, 2, i64s([4]), 1, pa + 4) is None
        assert "32-byte aligned" in last()
        assert nn.aclCreateTensor(None, 2, 0, i64s([1, 1]), 0, 2, i64s([4]), 1, pa) is None
        assert nn.aclCreateTensor(i64s([2, 3]), 2, 0, i64s([-3, 1]), 3, 2, i64s([6]), 1, pa) is None
        assert nn.aclCreateTensor(i64s([2, 3]), 2, 0, i64s([3, 1]), 1, 2, i64s([6]), 1, pa) is None
        assert nn.aclCreateTensor(i64s([4]), 1, 0, i64s([1]), 0, 2, i64s([1 << 20]), 1, pa) is None
        # a zero stride (broadcast view) is accepted
        tz = nn.aclCreateTensor(i64s([2, 3]), 2, 0, i64s([0, 1]), 0, 2, i64s([3]), 1, pa)
        assert tz
        nn.aclDestroyTensor(P(tz))
        # tensors destroyed right after phase 1 still compute correctly (executor snapshots them)
        x = np.arange(6, dtype=np.float64).reshape(2, 3)
        y = np.array([10.0, 20.0, 30.0])
        px, tx = dev_tensor(x)
        py, ty = dev_tensor(y)
        pz = dmalloc(x.nbytes)
        tz = tensor(pz, x.shape, np.float64)
        two = scalar(2.0, np.float64)
        assert math_.aclnnSubGetWorkspaceSize(P(tx), P(ty), P(two), P(tz), ctypes.byref(ws), ctypes.byref(ex)) == 0
        for t in (tx, ty, tz):
            assert nn.aclDestroyTensor(P(t)) == 0
        assert nn.aclDestroyScalar(P(two)) == 0
        assert math_.aclnnSub(None, U64(0), ex, STREAM) == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        bits_equal(download(pz, x.shape, np.float64), x - 2.0 * y)
        # use after free: the output allocation freed between phase 1 and phase 2 -> the task fails
        pf = dmalloc(x.nbytes)
        tf = tensor(pf, x.shape, np.float64)
        pu, tu = dev_tensor(x)
        assert math_.aclnnMulGetWorkspaceSize(P(tu), P(tu), P(tf), ctypes.byref(ws), ctypes.byref(ex)) == 0
        nn.aclDestroyTensor(P(tf)); nn.aclDestroyTensor(P(tu))
        dfree(pf)
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 507015
        rt.aclGetRecentErrMsg()
        # libopapi.so (combined name) finds every symbol through its DT_NEEDED libraries
        comb = ctypes.CDLL(os.path.join(LIB, "libopapi.so"))
        for sym in ("aclnnAdd", "aclnnCastGetWorkspaceSize", "aclnnInplaceCopy", "aclnnMatmul",
                    "aclnnMatmulGetWorkspaceSize", "aclCreateTensor", "aclDestroyAclOpExecutor"):
            assert getattr(comb, sym)
        for t in (ta, tb, to, to64, toi, ti, tm, tq):
            assert nn.aclDestroyTensor(P(t)) == 0
        assert nn.aclDestroyScalar(P(one)) == 0
        finish()
        """,
    )


def test_injected_failures(libdir):
    run_scenario(
        libdir,
        r"""
        x = np.arange(8, dtype=np.float32)
        px, tx = dev_tensor(x)
        po = dmalloc(x.nbytes)
        to = tensor(po, x.shape, np.float32)
        one = scalar(1.0, np.float32)
        ws, ex = U64(), P()
        op(math_, "aclnnAdd", P(tx), P(tx), P(one), P(to))            # 1st: fine
        assert math_.aclnnAddGetWorkspaceSize(P(tx), P(tx), P(one), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert math_.aclnnAdd(None, U64(0), ex, STREAM) == 0           # 2nd: enqueued, fails on the stream
        assert rt.aclrtSynchronizeStream(STREAM) == 507015
        rt.aclGetRecentErrMsg()
        assert counts()[2] == 0
        zero = np.zeros_like(x)
        assert rt.aclrtMemcpy(po, x.nbytes, zero.ctypes.data, x.nbytes, 1) == 0
        op(math_, "aclnnAdd", P(tx), P(tx), P(one), P(to))            # the stream works afterwards
        bits_equal(download(po, x.shape, np.float32), x + x)
        # phase-1 injection: 561000, then fine
        op(math_, "aclnnMul", P(tx), P(tx), P(to), expect=561000)
        assert "ACLDOUBLE_FAIL" in nn.acldoubleAclnnLastErrMsg().decode()
        op(math_, "aclnnMul", P(tx), P(tx), P(to))
        bits_equal(download(po, x.shape, np.float32), x * x)
        # the runtime refuses the 5th kernel launch: phase 2 answers 361001, the executor is consumed
        assert math_.aclnnMulGetWorkspaceSize(P(tx), P(tx), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 361001
        assert "failed with ACL error" in nn.acldoubleAclnnLastErrMsg().decode()
        rt.aclGetRecentErrMsg()
        assert counts()[2] == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        for t in (tx, to):
            nn.aclDestroyTensor(P(t))
        nn.aclDestroyScalar(P(one))
        finish()
        """,
        env_extra={"ACLDOUBLE_FAIL": "aclnnAdd:2,aclnnMulGetWorkspaceSize:1,acldouble_enqueue_kernel:5"},
    )


def test_kernel_timing_model(libdir):
    run_scenario(
        libdir,
        r"""
        x = np.zeros(25000, np.float32)   # 100 kB per tensor: 300 kB read+written
        px, tx = dev_tensor(x)
        po = dmalloc(x.nbytes)
        to = tensor(po, x.shape, np.float32)
        ws, ex = U64(), P()
        t0 = time.perf_counter()
        for _ in range(2):
            assert math_.aclnnMulGetWorkspaceSize(P(tx), P(tx), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
            assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        enqueued = time.perf_counter() - t0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        took = time.perf_counter() - t0
        assert enqueued < 0.12, enqueued  # phase 2 is asynchronous: it does not wait for the kernel
        assert took >= 2 * 300e3 / 1e9 / 0.002 * 0.95, took     # 0.002 GB/s -> 0.15 s per kernel
        nn.aclDestroyTensor(P(tx)); nn.aclDestroyTensor(P(to))
        finish()
        """,
        env_extra={"ACLDOUBLE_KERNEL_GBPS": "0.002"},
    )


def test_threads_on_their_own_streams(libdir):
    run_scenario(
        libdir,
        r"""
        import threading
        errors = []

        def worker(k):
            try:
                assert rt.aclrtSetDevice(0) == 0
                s = P()
                assert rt.aclrtCreateStream(ctypes.byref(s)) == 0
                x = np.arange(64, dtype=np.float32) * (k + 1)
                px, tx = dev_tensor(x)
                po = dmalloc(x.nbytes)
                to = tensor(po, x.shape, np.float32)
                one = scalar(1.0, np.float32)
                ws, ex = U64(), P()
                for _ in range(20):
                    rc = math_.aclnnAddGetWorkspaceSize(
                        P(tx), P(tx), P(one), P(to), ctypes.byref(ws), ctypes.byref(ex)
                    )
                    assert rc == 0
                    assert math_.aclnnAdd(None, U64(0), ex, s) == 0
                    rc = math_.aclnnMulGetWorkspaceSize(P(to), P(tx), P(to), ctypes.byref(ws), ctypes.byref(ex))
                    assert rc == 0
                    assert math_.aclnnMul(None, U64(0), ex, s) == 0
                assert rt.aclrtSynchronizeStream(s) == 0
                bits_equal(download(po, x.shape, np.float32), (x + x) * x)
                for t in (tx, to):
                    nn.aclDestroyTensor(P(t))
                nn.aclDestroyScalar(P(one))
                assert rt.aclrtDestroyStream(s) == 0
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        finish()
        """,
    )


def test_repeatable_executor_pointed_at_new_addresses(libdir):
    run_scenario(
        libdir,
        """
        for f in ("aclSetInputTensorAddr", "aclSetOutputTensorAddr"):
            getattr(nn, f).argtypes = [P, ctypes.c_size_t, P, P]
        a, b = np.arange(8, dtype=np.float32), np.full(8, 10, np.float32)
        pa, ta = dev_tensor(a)
        pb, tb = dev_tensor(b)
        po = dmalloc(32)
        to = tensor(po, (8,), np.float32)
        ws, ex = U64(0), P()
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(tb), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        # not repeatable yet: refused (double-only), and phase 2 still consumes it
        assert nn.aclSetInputTensorAddr(ex, 0, ta, pa) == 161002
        assert "not repeatable" in nn.acldoubleAclnnLastErrMsg().decode()
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert math_.aclnnMulGetWorkspaceSize(P(ta), P(tb), P(to), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert nn.aclSetAclOpExecutorRepeatable(ex) == 0
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        assert np.array_equal(download(po, (8,), np.float32), a * b)
        # new storage for input 1 and the output: phase 2 alone computes there
        c = np.full(8, -2, np.float32)
        pc = upload(c)
        po2 = dmalloc(32)
        assert nn.aclSetInputTensorAddr(ex, 1, tb, pc) == 0
        assert nn.aclSetOutputTensorAddr(ex, 0, to, po2) == 0
        assert math_.aclnnMul(None, U64(0), ex, STREAM) == 0
        assert rt.aclrtSynchronizeStream(STREAM) == 0
        assert np.array_equal(download(po2, (8,), np.float32), a * c)
        assert np.array_equal(download(po, (8,), np.float32), a * b)   # the old output untouched
        # refusals: NULL, an index past the operator's tensors, unaligned, not device memory
        assert nn.aclSetInputTensorAddr(None, 0, ta, pa) == 561103
        assert nn.aclSetInputTensorAddr(ex, 0, None, pa) == 561103
        assert nn.aclSetInputTensorAddr(ex, 2, ta, pa) == 161002
        assert nn.aclSetOutputTensorAddr(ex, 1, to, po) == 161002
        assert nn.aclSetInputTensorAddr(ex, 0, ta, pa + 4) == 161002
        host = np.zeros(64, np.float32)
        assert nn.aclSetInputTensorAddr(ex, 0, ta, (host.ctypes.data + 31) & ~31) == 161002
        assert "device allocation" in nn.acldoubleAclnnLastErrMsg().decode()
        assert nn.aclDestroyAclOpExecutor(ex) == 0
        assert nn.aclSetInputTensorAddr(ex, 0, ta, pa) == 161002   # a dead executor
        for t in (ta, tb, to):
            assert nn.aclDestroyTensor(t) == 0
        finish()
        """,
    )
