//! `opbridge-serve`: the standalone server binary (the same flags as `opbridge serve`).

/// mimalloc: buffers allocated on the connection threads and freed on the compute workers (each
/// request's) go back without a lock; under glibc's allocator they contended for its arena
/// locks, a futex wake-up in a request's path.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    opbridge_serve::main_with_args(std::env::args_os())
}
