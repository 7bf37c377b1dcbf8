//! The compute pool the parallel kernels run on. Normally rayon's global pool; in the child of a
//! `fork()` (see `opbridge_runtime::fork`) that pool's threads stayed in the parent and work
//! handed to it would wait forever, and rayon cannot rebuild its global pool, so the child builds
//! a pool of its own (one per fork generation, as many threads as the machine has) and runs
//! the parallel kernels inside it. Every parallel section of a kernel (`par_iter`,
//! `rayon::current_num_threads`, `gemm`'s rayon parallelism) runs inside [`install`].

use std::sync::{Arc, Mutex};

use rayon::{ThreadPool, ThreadPoolBuilder};

/// The pool of the current fork generation, once a forked child has needed one.
static CHILD_POOL: Mutex<Option<(u64, Arc<ThreadPool>)>> = Mutex::new(None);

/// Threads of the pool the parallel kernels run on now (rayon's, or a forked child's own).
pub fn threads() -> usize {
    install(rayon::current_num_threads)
}

/// Runs `f` where rayon's parallel iterators reach live threads: directly (on the global pool)
/// in the process that started the runtime, inside this generation's own pool in a forked
/// child. In the normal case it costs one atomic load.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let generation = opbridge_runtime::fork::generation();
    if generation == 0 {
        return f();
    }
    match child_pool(generation) {
        Some(pool) => pool.install(f),
        // Even one worker thread could not start: no parallel section can run, and rayon has no
        // single-threaded mode, so this is reported as the kernel's panic (a stream turns it into
        // its error).
        None => panic!("opbridge: cannot start a compute thread in this forked process"),
    }
}

fn child_pool(generation: u64) -> Option<Arc<ThreadPool>> {
    let mut slot = CHILD_POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((made_in, pool)) = slot.as_ref() {
        if *made_in == generation {
            return Some(Arc::clone(pool));
        }
        // Made in an earlier generation: its threads are gone too. Leaked, not dropped: dropping
        // a pool signals threads that no longer exist.
        std::mem::forget(slot.take());
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("opbridge-compute-{i}"))
        .build()
        .or_else(|_| ThreadPoolBuilder::new().num_threads(1).build())
        .ok()?;
    let pool = Arc::new(pool);
    *slot = Some((generation, Arc::clone(&pool)));
    Some(pool)
}
