//! Repeatable aclnn executors, cached per host thread by the layout of a call.
//!
//! Phase 1 of an aclnn operator (`aclnnXxxGetWorkspaceSize`) checks the call and computes its
//! tiling on the host: on real CANN it is most of an operator's host cost. A call that repeats
//! an earlier one in everything but its addresses (operator, dtypes, shapes, strides, offsets,
//! storage sizes, by-value arguments) needs none of that again. After phase 1 the executor is
//! made repeatable (`aclSetAclOpExecutorRepeatable`) and kept with its `aclTensor`s; the next
//! such call points it at the new storage (`aclSetInputTensorAddr` /
//! `aclSetOutputTensorAddr`) and runs phase 2 alone, as MindSpore's aclnn cache does.
//!
//! Each thread has its own cache (a thread launches on its own streams, so an executor is
//! never used by two threads at once), of at most [`CAPACITY`] executors, the least recently
//! used evicted first. [`clear`] empties every thread's cache before ACL is finalized.
//! `OPBRIDGE_ASCEND_EXECUTOR_CACHE=0` turns the cache off (every call runs both phases).
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, Weak};

use opbridge_runtime::{DType, Tensor};

use crate::aclnn::{AclScalar, AclTensor, Executor, Phase2};
use crate::device::Runtime;

/// Executors kept per thread.
pub const CAPACITY: usize = 64;

/// Whether calls may reuse executors (`OPBRIDGE_ASCEND_EXECUTOR_CACHE=0` says no; read once).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("OPBRIDGE_ASCEND_EXECUTOR_CACHE").map_or(true, |v| v != "0"))
}

/// What phase 1 saw of one tensor, but its address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TensorLayout {
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    byte_offset: usize,
    storage_bytes: usize,
}

impl TensorLayout {
    fn of(tensor: &Tensor) -> TensorLayout {
        TensorLayout {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
            byte_offset: tensor.byte_offset(),
            storage_bytes: tensor.storage().len(),
        }
    }

    fn matches(&self, tensor: &Tensor) -> bool {
        self.dtype == tensor.dtype()
            && self.shape == tensor.shape()
            && self.strides == tensor.strides()
            && self.byte_offset == tensor.byte_offset()
            && self.storage_bytes == tensor.storage().len()
    }
}

/// What identifies a reusable executor: the operator, its device, its by-value arguments and
/// the layout of its tensors (inputs, then the output). Hashed once, for the lookup and for the
/// insert that follows a miss.
#[derive(Debug)]
pub struct CallKey<'a> {
    op: &'static str,
    device: usize,
    /// By-value arguments of phase 1 besides tensors (the target dtype of a cast).
    extra: i64,
    tensors: &'a [&'a Tensor],
    hash: u64,
}

impl<'a> CallKey<'a> {
    pub fn new(op: &'static str, device: usize, extra: i64, tensors: &'a [&'a Tensor]) -> CallKey<'a> {
        let mut hasher = rustc_hash::FxHasher::default(); // fast; a collision only costs a compare
        (op, device, extra).hash(&mut hasher);
        for tensor in tensors {
            (tensor.dtype(), tensor.shape(), tensor.strides(), tensor.byte_offset(), tensor.storage().len())
                .hash(&mut hasher);
        }
        CallKey { op, device, extra, tensors, hash: hasher.finish() }
    }
}

/// A repeatable executor and the descriptors it was made with, destroyed when the last user
/// lets go of it (a call running it holds it even if the cache evicts it meanwhile).
#[derive(Debug)]
pub struct Cached {
    runtime: Arc<Runtime>,
    pub executor: *mut Executor,
    /// `aclTensor`s of the inputs, then of the output: what the address setters take.
    pub tensors: Vec<*mut AclTensor>,
    scalar: *mut AclScalar,
    pub phase2: Phase2,
    pub workspace: u64,
}

// SAFETY: aclnn executors and descriptors are host objects not tied to the thread that made
// them. Only the owning thread runs one (the caches are per thread); another thread only ever
// drops one ([`clear`] at shutdown), after which the owner's in-flight call still holds it.
unsafe impl Send for Cached {}
// SAFETY: as above; shared references only read the handles.
unsafe impl Sync for Cached {}

impl Cached {
    pub fn new(
        runtime: Arc<Runtime>,
        executor: *mut Executor,
        tensors: Vec<*mut AclTensor>,
        scalar: *mut AclScalar,
        phase2: Phase2,
        workspace: u64,
    ) -> Cached {
        Cached { runtime, executor, tensors, scalar, phase2, workspace }
    }
}

impl Drop for Cached {
    fn drop(&mut self) {
        // A finalized driver or a fork's child: the handles are not ours to give back.
        if self.runtime.is_finalized() || self.runtime.forked() {
            return;
        }
        let Ok(aclnn) = self.runtime.aclnn() else { return };
        // SAFETY: the executor was made repeatable right after phase 1 and is destroyed once,
        // here; the descriptors and scalar were made for it and are destroyed once, after it.
        unsafe { aclnn.destroy_cached(self.executor, &self.tensors, self.scalar) };
    }
}

struct Slot {
    hash: u64,
    op: &'static str,
    device: usize,
    extra: i64,
    layouts: Vec<TensorLayout>,
    last_used: u64,
    cached: Arc<Cached>,
}

#[derive(Default)]
struct ThreadCache {
    slots: Vec<Slot>,
    clock: u64,
}

type Shared = Arc<Mutex<ThreadCache>>;

/// Every thread's cache, for [`clear`].
static ALL: Mutex<Vec<Weak<Mutex<ThreadCache>>>> = Mutex::new(Vec::new());

thread_local! {
    static MINE: RefCell<Option<Shared>> = const { RefCell::new(None) };
}

fn with_mine<R>(f: impl FnOnce(&mut ThreadCache) -> R) -> R {
    MINE.with(|mine| {
        let shared = Arc::clone(mine.borrow_mut().get_or_insert_with(|| {
            let shared: Shared = Arc::default();
            let mut all = ALL.lock().unwrap_or_else(|p| p.into_inner());
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&shared));
            shared
        }));
        let mut cache = shared.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut cache)
    })
}

/// The cached executor for `key`, if this thread has one.
pub fn find(key: &CallKey<'_>) -> Option<Arc<Cached>> {
    let hash = key.hash;
    with_mine(|cache| {
        cache.clock += 1;
        let now = cache.clock;
        let slot = cache.slots.iter_mut().find(|s| {
            s.hash == hash
                && s.op == key.op
                && s.device == key.device
                && s.extra == key.extra
                && s.layouts.len() == key.tensors.len()
                && s.layouts.iter().zip(key.tensors).all(|(l, t)| l.matches(t))
        })?;
        slot.last_used = now;
        Some(Arc::clone(&slot.cached))
    })
}

/// Keeps `cached` for calls like `key`, evicting the least recently used executor when full.
pub fn insert(key: &CallKey<'_>, cached: Cached) {
    let slot = Slot {
        hash: key.hash,
        op: key.op,
        device: key.device,
        extra: key.extra,
        layouts: key.tensors.iter().map(|t| TensorLayout::of(t)).collect(),
        last_used: 0,
        cached: Arc::new(cached),
    };
    let evicted = with_mine(|cache| {
        cache.clock += 1;
        let slot = Slot { last_used: cache.clock, ..slot };
        let evicted = if cache.slots.len() >= CAPACITY {
            let oldest = (0..cache.slots.len()).min_by_key(|&i| cache.slots[i].last_used).unwrap_or(0);
            Some(cache.slots.swap_remove(oldest))
        } else {
            None
        };
        cache.slots.push(slot);
        evicted
    });
    drop(evicted); // destroyed outside the lock
}

/// Forgets `cached` (its executor failed): later calls make a new one.
pub fn remove(cached: &Arc<Cached>) {
    let removed = with_mine(|cache| {
        let at = cache.slots.iter().position(|s| Arc::ptr_eq(&s.cached, cached))?;
        Some(cache.slots.swap_remove(at))
    });
    drop(removed);
}

/// Empties every thread's cache: called before ACL is finalized, so no executor outlives it.
pub fn clear() {
    let caches: Vec<Shared> = ALL.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(Weak::upgrade).collect();
    for cache in caches {
        let slots = std::mem::take(&mut cache.lock().unwrap_or_else(|p| p.into_inner()).slots);
        drop(slots);
    }
}

/// How many executors this thread keeps (for tests).
pub fn cached_here() -> usize {
    with_mine(|cache| cache.slots.len())
}
