//! Fork safety. `fork()` copies only the calling thread: in the child, every stream worker and
//! every thread of rayon's global pool is gone, while the objects that wait for them (queues,
//! completion counters, condition variables) are copied as they were. Waiting on them there
//! would wait forever. The child handler registered here with `pthread_atfork` bumps a
//! process-wide *fork generation*; everything that owns threads records the generation it was
//! made in and, seen from a later one, refuses with a typed error (a stream, a recorded event
//! still pending) or is replaced (the calling thread's current stream; the compute pool of
//! `opbridge-ops`, which builds a pool of its own per generation, as rayon's global pool cannot
//! be rebuilt). Reading the generation is one relaxed atomic load.
//!
//! The handler is registered the first time [`generation`] or [`register`] runs, which
//! everything that starts a thread does first; a fork before that has nothing to lose.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Bumped in the child of every `fork()` once [`register`] has run.
static GENERATION: AtomicU64 = AtomicU64::new(0);
/// Guards the one registration of the handler.
static REGISTERED: Once = Once::new();

/// Runs in the child right after `fork()`, on its only thread: one atomic increment, which is
/// async-signal-safe.
#[cfg(unix)]
extern "C" fn after_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
}

/// Registers the fork handler (once per process; later calls are one atomic load).
pub fn register() {
    REGISTERED.call_once(|| {
        #[cfg(unix)]
        {
            // SAFETY: `after_fork_in_child` is an `extern "C" fn()` that lives as long as the
            // process (this library is never unloaded while the process runs: Rust statics and
            // threads refer to it) and only does an atomic increment. `pthread_atfork` fails
            // only with ENOMEM; then forks are not tracked, as before this module existed.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
            let _ = rc;
        }
    });
}

/// The fork generation of this process: 0 in the process that first used the runtime, `g + 1`
/// in a child forked from a process of generation `g`.
pub fn generation() -> u64 {
    register();
    GENERATION.load(Ordering::Relaxed)
}

/// True in a process forked (directly or not) from one that had already used the runtime.
pub fn is_forked_child() -> bool {
    generation() > 0
}

/// The message of the error raised for an object made before a fork and used after it.
pub fn orphaned_message(what: &str) -> String {
    format!(
        "{what} was created before fork() in the parent process; its worker thread does not exist in this \
         process (pid {}). Create a new Stream in the child (the current stream of each thread is replaced \
         automatically), or use the 'spawn' or 'forkserver' start method of multiprocessing",
        std::process::id()
    )
}
