//! The Linux implementation: `mmap` of `/dev/shm/<name>` and the SIGBUS guard.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::{ShmError, MAX_MAPPINGS};

/// A live mapping's entry in the guard's table: `start` 0 is a free slot.
struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    damaged: AtomicBool,
}

static SLOTS: [Slot; MAX_MAPPINGS] =
    [const { Slot { start: AtomicUsize::new(0), len: AtomicUsize::new(0), damaged: AtomicBool::new(false) } };
        MAX_MAPPINGS];

/// The page size, read once at installation (`sysconf` is not async-signal-safe).
static PAGE: AtomicUsize = AtomicUsize::new(0);

/// The SIGBUS action before ours, to chain to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// The slot whose mapping holds `addr`, if any (async-signal-safe: atomic loads only). `len` is
/// published after `start` and cleared before it, so a slot being filled or freed matches
/// nothing.
fn slot_of(addr: usize) -> Option<&'static Slot> {
    SLOTS.iter().find(|slot| {
        let start = slot.start.load(Ordering::Acquire);
        start != 0 && addr >= start && addr - start < slot.len.load(Ordering::Acquire)
    })
}

/// A client's shared-memory file mapped shared and read-write, from its start to `len`.
pub struct Mapping {
    key: String,
    file: File,
    /// The file's (device, inode): two mappings of one file alias each other.
    identity: (u64, u64),
    addr: usize,
    len: usize,
    slot: &'static Slot,
}

impl Mapping {
    /// Opens `/dev/shm/<key>` read-write and maps its first `len` bytes, once the file is
    /// known to hold them. The key must name a regular file there: a symbolic link is not
    /// followed (as `shm_open` does not: it would let a client map any file the server can
    /// open), and a FIFO, device or folder is refused. Pages are mapped as the kernels touch
    /// them, not all at once (a large sparse file costs nothing until used).
    pub fn open(key: &str, len: usize) -> Result<Mapping, ShmError> {
        let name = crate::file_name(key)?;
        let failed = |e: std::io::Error| ShmError::Open { key: key.into(), message: e.to_string() };
        let file = File::options()
            .read(true)
            .write(true)
            // Non-blocking: opening a FIFO must not wait for a writer before it is refused.
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(format!("/dev/shm/{name}"))
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => ShmError::Open { key: key.into(), message: "it is a symbolic link".into() },
                _ => failed(e),
            })?;
        let metadata = file.metadata().map_err(failed)?;
        if !metadata.is_file() {
            return Err(ShmError::Open { key: key.into(), message: "it is not a regular file".into() });
        }
        let identity = (metadata.dev(), metadata.ino());
        let file_len = metadata.len();
        if len == 0 || file_len < len as u64 {
            return Err(ShmError::TooSmall { key: key.into(), file: file_len, need: len });
        }
        let slot = SLOTS
            .iter()
            .find(|slot| slot.start.compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed).is_ok())
            .ok_or(ShmError::Full)?;
        // SAFETY: a fresh mapping chosen by the kernel (no fixed address), of a file we hold
        // open; nothing in this process refers to its memory yet.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            slot.start.store(0, Ordering::Release);
            let message = std::io::Error::last_os_error().to_string();
            return Err(ShmError::Map { key: key.into(), message });
        }
        let addr = addr as usize;
        slot.damaged.store(false, Ordering::Release);
        slot.start.store(addr, Ordering::Release);
        slot.len.store(len, Ordering::Release);
        Ok(Mapping { key: key.into(), file, identity, addr, len, slot })
    }

    /// The mapped file's identity (device, inode).
    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// The address of the file's first byte.
    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a page of the mapping faulted (its file truncated under us) since it was made:
    /// what was read there since is zeros, what was written is lost.
    pub fn damaged(&self) -> bool {
        self.slot.damaged.load(Ordering::Acquire)
    }

    /// Before a use: the mapping is undamaged and its file still holds every mapped byte.
    pub fn check(&self) -> Result<(), ShmError> {
        if self.damaged() {
            return Err(ShmError::Damaged { key: self.key.clone() });
        }
        let file = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        if file < self.len as u64 {
            return Err(ShmError::TooSmall { key: self.key.clone(), file, need: self.len });
        }
        Ok(())
    }

    fn bounds(&self, offset: usize, len: usize) -> Result<usize, ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(ShmError::OutOfBounds { offset, len, mapped: self.len }),
        }
    }

    /// Copies `dst.len()` bytes from `offset` of the mapping.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        let src = self.bounds(offset, dst.len())?;
        // SAFETY: `src..src + dst.len()` is inside our live mapping (checked above), which no
        // Rust reference covers (the client may write it any time: only raw copies touch it);
        // a truncated page faults into the guard, which maps zeros there.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` to `offset` of the mapping.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        let dst = self.bounds(offset, src.len())?;
        // SAFETY: as in `read`: inside our live, writable mapping, which no reference covers.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Out of the guard's table first: a fault there from now on is not ours.
        self.slot.len.store(0, Ordering::Release);
        self.slot.start.store(0, Ordering::Release);
        // SAFETY: our own mapping (patched pages included: they lie inside it), unmapped once;
        // whoever read or wrote it through `addr` held this `Mapping`, now being dropped.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
    }
}

/// Installs the process-wide SIGBUS handler (once; later calls do nothing).
pub fn install_sigbus_guard() -> Result<(), ShmError> {
    static INSTALLED: OnceLock<Result<(), ShmError>> = OnceLock::new();
    INSTALLED.get_or_init(install).clone()
}

fn install() -> Result<(), ShmError> {
    // SAFETY: sysconf with a valid name has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    PAGE.store(usize::try_from(page).unwrap_or(4096), Ordering::Release);
    // SAFETY: an all-zero `sigaction` is a valid value (empty mask, no flags), filled below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: as above; `previous` is written by sigaction.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to initialized actions; the handler is async-signal-safe (atomics,
    // mmap, sigaction, and the previous handler).
    if unsafe { libc::sigaction(libc::SIGBUS, &action, &mut previous) } != 0 {
        let message = std::io::Error::last_os_error().to_string();
        return Err(ShmError::Map { key: "(SIGBUS handler)".into(), message });
    }
    let _ = PREVIOUS.set(previous);
    Ok(())
}

/// The SIGBUS handler (see the crate documentation).
extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid `siginfo_t`.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some(slot) = slot_of(addr) {
        let page = PAGE.load(Ordering::Acquire);
        let start = addr & !(page - 1);
        // SAFETY: replaces one page inside our live mapping (the slot matched) with private
        // zeros: no memory outside the mapping changes, and its users already accept that the
        // client may change or remove its bytes at any time.
        let patched = unsafe {
            libc::mmap(
                start as *mut c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if patched != libc::MAP_FAILED {
            slot.damaged.store(true, Ordering::Release);
            return;
        }
    }
    chain(signal, info, context);
}

/// Hands a fault that is not ours to the action before ours.
fn chain(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    let previous = PREVIOUS.get();
    match previous.map(|p| (p.sa_sigaction, p.sa_flags)) {
        Some((handler, flags)) if handler != libc::SIG_DFL && handler != libc::SIG_IGN => {
            if flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous action's handler, installed with SA_SIGINFO: this type.
                let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut c_void) =
                    unsafe { std::mem::transmute(handler) };
                handler(signal, info, context);
            } else {
                // SAFETY: the previous action's handler, installed without SA_SIGINFO: this type.
                let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
                handler(signal);
            }
        }
        _ => {
            // The default action: restored, the faulting instruction retries and dies of it.
            // SAFETY: an all-zero `sigaction` with SIG_DFL is a valid action.
            let mut default: libc::sigaction = unsafe { std::mem::zeroed() };
            default.sa_sigaction = libc::SIG_DFL;
            // SAFETY: a valid action; sigaction is async-signal-safe.
            unsafe { libc::sigaction(signal, &default, std::ptr::null_mut()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file in /dev/shm of `len` bytes, removed on drop.
    struct ShmFile(String);

    impl ShmFile {
        fn new(tag: &str, len: u64) -> ShmFile {
            let name = format!("opbridge-shm-test-{tag}-{}", std::process::id());
            let file = File::create(format!("/dev/shm/{name}")).expect("create");
            file.set_len(len).expect("set_len");
            ShmFile(name)
        }

        fn truncate(&self, len: u64) {
            File::options().write(true).open(self.path()).expect("open").set_len(len).expect("truncate");
        }

        fn path(&self) -> String {
            format!("/dev/shm/{}", self.0)
        }
    }

    impl Drop for ShmFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.path());
        }
    }

    #[test]
    fn maps_reads_and_writes_within_bounds() {
        let file = ShmFile::new("rw", 8192);
        let mapping = Mapping::open(&format!("/{}", file.0), 8192).expect("open");
        mapping.write(4096, &[1, 2, 3]).expect("write");
        let mut back = [0u8; 3];
        mapping.read(4096, &mut back).expect("read");
        assert_eq!(back, [1, 2, 3]);
        assert_eq!(std::fs::read(file.path()).expect("read file")[4096..4099], [1, 2, 3]);
        assert!(matches!(mapping.read(8190, &mut back), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(mapping.write(usize::MAX, &back), Err(ShmError::OutOfBounds { .. })));
        assert_eq!(mapping.check(), Ok(()));
    }

    #[test]
    fn refuses_files_shorter_than_the_region_and_missing_keys() {
        let file = ShmFile::new("short", 100);
        assert!(matches!(Mapping::open(&file.0, 101), Err(ShmError::TooSmall { file: 100, need: 101, .. })));
        assert!(matches!(Mapping::open("/opbridge-shm-test-missing", 1), Err(ShmError::Open { .. })));
        assert!(matches!(Mapping::open("../etc/passwd", 1), Err(ShmError::BadKey(_))));
    }

    #[test]
    fn refuses_symbolic_links_and_files_that_are_not_regular() {
        let target = ShmFile::new("target", 4096);
        let link = format!("opbridge-shm-test-link-{}", std::process::id());
        let _ = std::fs::remove_file(format!("/dev/shm/{link}"));
        std::os::unix::fs::symlink(target.path(), format!("/dev/shm/{link}")).expect("symlink");
        let refused = Mapping::open(&link, 16);
        let _ = std::fs::remove_file(format!("/dev/shm/{link}"));
        assert!(
            matches!(&refused, Err(ShmError::Open { message, .. }) if message.contains("symbolic link")),
            "{refused:?}"
        );
        let folder = format!("opbridge-shm-test-dir-{}", std::process::id());
        std::fs::create_dir(format!("/dev/shm/{folder}")).expect("mkdir");
        let refused = Mapping::open(&folder, 16);
        let _ = std::fs::remove_dir(format!("/dev/shm/{folder}"));
        assert!(matches!(&refused, Err(ShmError::Open { .. })), "{refused:?}");
        // Two mappings of one file have one identity.
        let (a, b) = (Mapping::open(&target.0, 16).expect("a"), Mapping::open(&target.0, 32).expect("b"));
        assert_eq!(a.identity(), b.identity());
        assert_ne!(a.addr(), b.addr());
    }

    #[test]
    fn a_truncated_file_is_seen_before_use_and_faults_into_the_guard() {
        install_sigbus_guard().expect("guard");
        let file = ShmFile::new("trunc", 3 * 4096);
        let mapping = Mapping::open(&file.0, 3 * 4096).expect("open");
        mapping.write(2 * 4096, &[7; 16]).expect("write");
        file.truncate(4096);
        assert!(matches!(mapping.check(), Err(ShmError::TooSmall { file: 4096, .. })));
        assert!(!mapping.damaged());
        // Past the new end: SIGBUS, caught; zeros read, the mapping marked.
        let mut back = [1u8; 16];
        mapping.read(2 * 4096, &mut back).expect("read");
        assert_eq!(back, [0; 16]);
        assert!(mapping.damaged());
        assert!(matches!(mapping.check(), Err(ShmError::Damaged { .. })));
        mapping.write(4096 + 8, &[9; 4]).expect("a write past the end is lost, not fatal");
        // Below the end the file is still shared.
        mapping.write(0, &[5]).expect("write");
        assert_eq!(std::fs::read(file.path()).expect("read file")[0], 5);
    }
}
