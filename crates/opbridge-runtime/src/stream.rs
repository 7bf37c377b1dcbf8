//! Streams, events and the per-thread current stream (the seed's stream manager).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::device::{CopyKind, Device, EventBackend, HostFn, StreamBackend};
use crate::error::{AsyncError, Error, Result};
use crate::ids::{DeviceId, DevicePtr};
use crate::memory::MemoryPool;
use crate::profiler;
use crate::DeviceContext;

/// Identifies a stream inside its device. `StreamId::HOST` is the synchronous host path (the
/// numpy convenience path), which never has work in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl StreamId {
    pub const HOST: StreamId = StreamId(0);
}

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

struct StreamInner {
    id: StreamId,
    device: Arc<dyn Device>,
    backend: Arc<dyn StreamBackend>,
    registry: Weak<StreamRegistry>,
    /// Device work launched since the last synchronize (latest last, at most
    /// [`RECENT_LAUNCHES`]): an asynchronous failure names them, since the driver does not say
    /// which one failed.
    launches: Mutex<VecDeque<Launch>>,
    /// Points of this stream's order that tensors remember (see [`Mark`]).
    marks: Arc<Marks>,
}

/// Device work launched on a stream, as an asynchronous failure names it: what ran (`add v1`)
/// and the caller's source line. Kept as parts and formatted only for an error message, so
/// noting a launch costs no formatting.
#[derive(Debug, Clone)]
pub struct Launch {
    pub what: Arc<str>,
    pub site: Option<CallSite>,
}

/// A source line of the program that made a call (`app.py:12`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSite {
    pub file: Arc<str>,
    pub line: u32,
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

impl fmt::Display for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.site {
            Some(site) => write!(f, "{} at {site}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// How many launches a stream remembers for its next asynchronous error.
const RECENT_LAUNCHES: usize = 8;

impl Drop for StreamInner {
    /// Work queued on a dropped stream still runs (as after `cudaStreamDestroy`): hand the
    /// backend to the registry so device-wide synchronization keeps waiting for it. Retired
    /// streams whose work has finished since are let go here too, so dropping streams never
    /// piles up workers.
    fn drop(&mut self) {
        // Marks taken on it keep their meaning without the stream: an event ends their epoch
        // (a stream whose work cannot run here, a fork's, has nothing to record).
        let _ = self.marks.seal();
        // Its resources (a worker thread) go once the queued work is done, however long the
        // registry or a pool block's record of use keeps the backend.
        self.backend.close();
        let Some(registry) = self.registry.upgrade() else { return };
        registry.prune_retired();
        if self.backend.query() {
            registry.stream_finished(self.id);
        } else {
            registry.retire(self.id, Arc::clone(&self.backend));
        }
    }
}

/// A stream: an ordered queue of work on one device. Cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Stream(Arc<StreamInner>);

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({} #{})", self.0.device.id(), self.0.id.0)
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}
impl Eq for Stream {}

impl Stream {
    /// Creates a new stream on the device of `ctx` and registers it for `synchronize_all`.
    pub fn new(ctx: &DeviceContext) -> Result<Stream> {
        let backend = ctx.device().create_stream()?;
        let marks = Marks::new(Arc::clone(ctx.device()), Arc::downgrade(&backend));
        let stream = Stream(Arc::new(StreamInner {
            id: StreamId(NEXT_STREAM.fetch_add(1, Ordering::Relaxed)),
            device: Arc::clone(ctx.device()),
            backend,
            registry: Arc::downgrade(&ctx.streams),
            launches: Mutex::default(),
            marks,
        }));
        ctx.streams.register(&stream);
        Ok(stream)
    }

    pub fn id(&self) -> StreamId {
        self.0.id
    }

    pub fn device(&self) -> DeviceId {
        self.0.device.id()
    }

    /// Enqueues a kernel; returns at once.
    pub fn launch(&self, kernel: HostFn) -> Result<()> {
        self.0.backend.launch(kernel)
    }

    /// Enqueues a host function, run after all earlier work on this stream.
    pub fn launch_host_func(&self, func: HostFn) -> Result<()> {
        // Marks taken so far must not come to mean "after this function" (which may block on
        // the host, e.g. on a thread that waits for one of them): see [`Mark`].
        self.0.marks.seal()?;
        let flow = profiler::enqueue("host_func", "host function");
        if flow == 0 {
            return self.0.backend.launch_host_func(func);
        }
        self.0.backend.launch_host_func(Box::new(move || {
            let _span = profiler::Span::begin("host_func", "host function", flow, Vec::new());
            func()
        }))
    }

    /// Enqueues an asynchronous copy.
    pub fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, kind: CopyKind) -> Result<()> {
        if !profiler::active() {
            return self.0.backend.copy(dst, src, bytes, kind);
        }
        // Profiled: the copy is bracketed by two host functions on the stream, which mark where
        // it ran (stream order puts the copy between them) and measure it there. Marks taken so
        // far end before them, as before any host function.
        if self.0.marks.seal().is_err() {
            return self.0.backend.copy(dst, src, bytes, kind);
        }
        let name = match kind {
            CopyKind::HostToDevice => "copy H2D",
            CopyKind::DeviceToHost => "copy D2H",
            CopyKind::DeviceToDevice => "copy D2D",
        };
        let flow = profiler::enqueue("copy", name);
        let started = std::sync::Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
        let mark = std::sync::Arc::clone(&started);
        let opened = self.0.backend.launch_host_func(Box::new(move || {
            profiler::record(profiler::Phase::FlowEnd, "copy", name, flow, Vec::new());
            profiler::record(profiler::Phase::Begin, "copy", name, 0, vec![("bytes", bytes.into())]);
            *mark.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
            Ok(())
        }));
        if opened.is_err() {
            // No marker: the copy goes unprofiled, as it would have gone.
            return self.0.backend.copy(dst, src, bytes, kind);
        }
        let copied = self.0.backend.copy(dst, src, bytes, kind);
        // The closing marker runs even when the copy could not be enqueued (the span then ends
        // at once). Its own failure is not the copy's: the copy is enqueued, so Ok.
        let _ = self.0.backend.launch_host_func(Box::new(move || {
            let began = *started.lock().unwrap_or_else(|p| p.into_inner());
            let seconds = began.map_or(0.0, |t| t.elapsed().as_secs_f64());
            let rate = if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 };
            profiler::record(profiler::Phase::End, "copy", name, 0, vec![("gb_per_s", rate.into())]);
            Ok(())
        }));
        copied
    }

    /// Enqueues a fill of `bytes` bytes from `dst` with `value`.
    pub fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        self.0.backend.memset(dst, value, bytes)
    }

    /// The vendor's handle of this stream (null on the CPU); see [`StreamBackend::native_handle`].
    pub fn native_handle(&self) -> *mut std::ffi::c_void {
        self.0.backend.native_handle()
    }

    /// Makes this stream's device current on the calling thread (see
    /// [`StreamBackend::bind_current`]).
    pub fn bind_current(&self) -> Result<()> {
        self.0.backend.bind_current()
    }

    /// Records a fresh event at the current end of this stream.
    pub fn record_new_event(&self) -> Result<Event> {
        let event = Event::from_device(self.0.device.as_ref())?;
        event.record(self)?;
        Ok(event)
    }

    /// The point after the work enqueued on this stream so far, for whoever may later have to
    /// wait for it (see [`Mark`]): no driver call on an accelerator.
    pub fn mark(&self) -> Result<Mark> {
        self.0.marks.mark()
    }

    /// Later work on this stream waits for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.0.marks.seal()?; // as for host functions: a wait may depend on the host
        let _span = profiler::span("sync", "stream wait_event", || vec![("stream", self.id().0.into())]);
        self.0.backend.wait(&event.backend)
    }

    /// Blocks until everything enqueued so far is done, leaving asynchronous errors in place.
    pub fn drain(&self) -> Result<()> {
        let _span = profiler::span("sync", "stream drain", || vec![("stream", self.id().0.into())]);
        self.0.backend.drain()
    }

    /// Blocks until everything enqueued so far is done; reports the first asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        let _span = profiler::span("sync", "stream synchronize", || vec![("stream", self.id().0.into())]);
        let outcome = self.0.backend.synchronize();
        let launched: Vec<String> = {
            let mut launches = self.0.launches.lock().unwrap_or_else(|p| p.into_inner());
            if launches.is_empty() {
                return outcome;
            }
            launches.drain(..).map(|launch| launch.to_string()).collect()
        };
        match outcome {
            Err(Error::Async { stream, error }) => {
                let message = format!(
                    "{error} [device work launched on this stream since its last synchronize, latest last: {}]",
                    launched.join("; ")
                );
                let error = AsyncError::from_error(error.kind(), ContextError { message, cause: error });
                Err(Error::Async { stream, error })
            }
            other => other,
        }
    }

    /// Notes device work just launched on this stream (an operator, its version and the call
    /// site), for the message of an asynchronous failure at the next synchronize.
    pub fn note_launch(&self, what: Launch) {
        let mut launches = self.0.launches.lock().unwrap_or_else(|p| p.into_inner());
        if launches.len() == RECENT_LAUNCHES {
            launches.pop_front();
        }
        launches.push_back(what);
    }

    /// True when everything enqueued so far is done.
    pub fn query(&self) -> bool {
        self.0.backend.query()
    }

    /// True for a stream made before a `fork()` in a process that is now its child: its
    /// worker stayed in the parent (see `crate::fork`); using it raises a device error.
    pub fn orphaned(&self) -> bool {
        self.0.backend.orphaned()
    }

    /// A record of this stream's use of something (a pool block) that does not keep the stream
    /// alive: see [`StreamUse`].
    pub fn usage(&self) -> StreamUse {
        StreamUse { id: self.0.id, backend: Arc::downgrade(&self.0.backend) }
    }
}

/// That a stream used something, without keeping the stream (or, on the CPU, its worker thread)
/// alive. While the stream lives, or is dropped with work still queued (retired), an event can
/// still be recorded on it; once it is gone with all its work done, there is nothing to wait for.
#[derive(Debug, Clone)]
pub struct StreamUse {
    id: StreamId,
    backend: Weak<dyn StreamBackend>,
}

impl StreamUse {
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// False once the stream is gone with all its work done.
    pub fn may_be_busy(&self) -> bool {
        self.backend.strong_count() > 0
    }

    /// Records a new event at the current end of the stream on `device` (the stream's device);
    /// `None` when the stream is gone with all its work done, or, in the child of a `fork()`,
    /// is the parent's: its queued work never runs in this process, so nothing here can still
    /// touch what it used (recording on it would raise and poison the pool's next allocation).
    pub fn record_new_event(&self, device: &dyn Device) -> Result<Option<Event>> {
        // The registry holds a dropped stream's backend until its work is done, so a failed
        // upgrade means nothing queued on it can still be running.
        let Some(backend) = self.backend.upgrade() else { return Ok(None) };
        if backend.orphaned() {
            return Ok(None);
        }
        let event = Event::from_device(device)?;
        backend.record(&event.backend)?;
        Ok(Some(event))
    }
}

/// A point in a stream's order (the end of a launch), made into a driver event only when
/// someone has to wait for it.
///
/// Most launches on an accelerator are never waited on from another stream or the host: their
/// output is read by later work on the same stream, or dropped. Recording an event after each
/// one costs driver calls per launch. Instead, marks taken between two events share an
/// *epoch*, which one event recorded later closes (`seal`). That event comes after more work
/// than the mark needs, which only delays a waiter, never lets it pass early. To keep that
/// delay finite, an epoch is sealed before anything that may wait on the host is enqueued on
/// the stream (a host function, a wait for another stream's event): between a mark and its
/// event there is then only device work, which completes once the work before it has. (Two
/// threads sharing one stream can interleave a host function between another thread's launch
/// and its mark, as they could between a launch and its event before.)
///
/// On the CPU, where kernels are host closures that could wait on anything, and where a
/// fork's child must tell finished parent work from lost work, every mark is sealed at once:
/// an event per launch, as a plain event would be.
#[derive(Clone)]
pub struct Mark(Arc<Epoch>);

struct Epoch {
    /// The event that ends this epoch, once sealed.
    event: OnceLock<Event>,
    /// The stream's marks (the stream seals its last epoch when it is dropped).
    marks: Weak<Marks>,
    /// To seal without the stream, should its last seal have failed: a retired stream's
    /// backend lives until its work is done.
    backend: Weak<dyn StreamBackend>,
    device: Arc<dyn Device>,
}

impl Epoch {
    /// Records the event that ends this epoch at the current end of its stream; `None` when
    /// the stream is gone with its work done. A stream left in a fork's parent is an error.
    fn record_end(&self) -> Result<Option<Event>> {
        let Some(backend) = self.backend.upgrade() else { return Ok(None) };
        if backend.orphaned() {
            return Err(Error::Device {
                device: self.device.id(),
                message: crate::fork::orphaned_message("the stream of this work"),
            });
        }
        let event = Event::from_device(self.device.as_ref())?;
        backend.record(&event.backend)?;
        let _ = self.event.set(event);
        Ok(self.event.get().cloned())
    }
}

/// A stream's open epoch.
pub(crate) struct Marks {
    current: Mutex<Arc<Epoch>>,
    /// Seal every mark at once (host-accessible devices: see [`Mark`]).
    eager: bool,
}

impl Marks {
    fn new(device: Arc<dyn Device>, backend: Weak<dyn StreamBackend>) -> Arc<Marks> {
        let eager = device.host_accessible();
        Arc::new_cyclic(|me: &Weak<Marks>| Marks {
            current: Mutex::new(Arc::new(Epoch { event: OnceLock::new(), marks: me.clone(), backend, device })),
            eager,
        })
    }

    fn mark(&self) -> Result<Mark> {
        if self.eager {
            let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let mark = Mark(Arc::clone(&current));
            Marks::seal_locked(&mut current)?;
            return Ok(mark);
        }
        Ok(Mark(Arc::clone(&self.current.lock().unwrap_or_else(|p| p.into_inner()))))
    }

    /// Ends the open epoch with an event at the current end of the stream, if a live mark is
    /// in it (the current epoch's only other holders are marks, which are cloned under the
    /// lock).
    fn seal(&self) -> Result<()> {
        Marks::seal_locked(&mut self.current.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn seal_locked(current: &mut Arc<Epoch>) -> Result<()> {
        if Arc::strong_count(current) == 1 {
            return Ok(()); // no mark to seal
        }
        current.record_end()?;
        let next = Epoch {
            event: OnceLock::new(),
            marks: current.marks.clone(),
            backend: current.backend.clone(),
            device: Arc::clone(&current.device),
        };
        *current = Arc::new(next);
        Ok(())
    }
}

impl Mark {
    /// An event that completes once the stream has passed this mark (sealing its epoch if
    /// needed), or `None` when there is nothing left to wait for (the stream is gone with its
    /// work done). Shared by every mark of the epoch: never to be recorded again.
    pub(crate) fn event(&self) -> Result<Option<Event>> {
        if let Some(event) = self.0.event.get() {
            return Ok(Some(event.clone()));
        }
        match self.0.marks.upgrade() {
            Some(marks) => marks.seal()?,
            // The stream is dropped: its drop sealed this epoch, unless that failed. Then (or
            // when that seal is not visible here yet) record the end through its backend.
            None if self.0.event.get().is_none() => return self.0.record_end(),
            None => {}
        }
        Ok(self.0.event.get().cloned())
    }

    /// True when the stream has passed this mark (seals its epoch to find out).
    pub fn query(&self) -> bool {
        match self.event() {
            Ok(Some(event)) => event.query(),
            Ok(None) => true,
            Err(_) => false,
        }
    }

    /// True when the mark is known to be passed without asking for a new event: an unsealed
    /// mark answers false (it may still be pending).
    pub fn known_done(&self) -> bool {
        self.0.event.get().is_some_and(Event::query)
    }

    /// Blocks until the stream has passed this mark.
    pub fn synchronize(&self) -> Result<()> {
        match self.event()? {
            Some(event) => event.synchronize(),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.event.get() {
            Some(event) => write!(f, "Mark({event:?})"),
            None => f.write_str("Mark(unsealed)"),
        }
    }
}

/// An event: records a point in a stream; waited on, queried, and timed.
#[derive(Clone)]
pub struct Event {
    device: DeviceId,
    backend: Arc<dyn EventBackend>,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({}, done={})", self.device, self.query())
    }
}

impl Event {
    pub fn new(ctx: &DeviceContext) -> Result<Event> {
        Event::from_device(ctx.device().as_ref())
    }

    fn from_device(device: &dyn Device) -> Result<Event> {
        Ok(Event { device: device.id(), backend: device.create_event()? })
    }

    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Marks the current end of `stream`; the event completes when the stream gets there.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.0.backend.record(&self.backend)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize()
    }

    pub fn query(&self) -> bool {
        self.backend.query()
    }

    /// Milliseconds between this event and `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        self.backend.elapsed_ms(end.backend.as_ref())
    }
}

/// Every live stream of a device, so `synchronize()` can wait for all of them, and dropped
/// streams whose queued work has not finished yet.
#[derive(Default)]
pub(crate) struct StreamRegistry {
    streams: Mutex<Vec<Weak<StreamInner>>>,
    retired: Mutex<Vec<(StreamId, Arc<dyn StreamBackend>)>>,
    /// The device's pools, told when a stream is gone so they can release its cached memory.
    pools: Mutex<Vec<Weak<MemoryPool>>>,
}

impl StreamRegistry {
    fn register(&self, stream: &Stream) {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|s| s.strong_count() > 0);
        streams.push(Arc::downgrade(&stream.0));
        drop(streams);
        self.prune_retired();
    }

    fn retire(&self, id: StreamId, backend: Arc<dyn StreamBackend>) {
        self.retired.lock().unwrap_or_else(|p| p.into_inner()).push((id, backend));
    }

    pub(crate) fn add_pool(&self, pool: &Arc<MemoryPool>) {
        self.pools.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::downgrade(pool));
    }

    /// A dropped stream whose work is all done: its cached blocks can never be reused (they
    /// belong to it), so the pools release them.
    fn stream_finished(&self, id: StreamId) {
        let pools: Vec<Arc<MemoryPool>> =
            self.pools.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(Weak::upgrade).collect();
        for pool in pools {
            pool.forget_stream(id);
        }
    }

    /// Drops finished retired streams, telling the pools.
    fn prune_retired(&self) {
        let finished: Vec<StreamId> = {
            let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
            // One query per stream: a stream that finishes between two queries would otherwise
            // leave the list without its pools being told (its memory cached forever).
            let mut done = Vec::new();
            retired.retain(|(id, backend)| {
                let finished = backend.query();
                if finished {
                    done.push(*id);
                }
                !finished
            });
            done
        };
        for id in finished {
            self.stream_finished(id);
        }
    }

    /// The streams of this process: those made before a `fork()` have no worker here and
    /// nothing of theirs will run, so device-wide waits skip them (using one raises).
    fn backends(&self) -> Vec<Arc<dyn StreamBackend>> {
        let mut all: Vec<Arc<dyn StreamBackend>> = {
            let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            streams.iter().filter_map(Weak::upgrade).map(|s| Arc::clone(&s.backend)).collect()
        };
        all.extend(self.retired.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(_, b)| Arc::clone(b)));
        all.retain(|b| !b.orphaned());
        all
    }

    /// Synchronizes every live stream and the unfinished work of dropped ones; returns the
    /// first error after waiting for all.
    pub(crate) fn synchronize_all(&self) -> Result<()> {
        self.wait_all(|b| b.synchronize())
    }

    /// Waits for every stream like `synchronize_all` but leaves asynchronous errors to the
    /// user's next synchronize (the pool waits for its own reasons and must not eat them).
    pub(crate) fn drain_all(&self) -> Result<()> {
        self.wait_all(|b| b.drain())
    }

    fn wait_all(&self, wait: impl Fn(&Arc<dyn StreamBackend>) -> Result<()>) -> Result<()> {
        let mut first = Ok(());
        for outcome in self.backends().iter().map(wait) {
            if first.is_ok() {
                first = outcome;
            }
        }
        self.prune_retired();
        first
    }
}

/// True when the calling thread is running stream work (a kernel or host function on a CPU
/// stream's worker). Waits from there are checked for waiting on themselves; code that blocks
/// on something stream work finishes (an unload waiting for calls) uses this to check first.
pub fn on_stream_worker() -> bool {
    crate::cpu::on_worker()
}

/// One device's current stream on one thread: the stream set outside any `with` block (made
/// lazily), and the stack of streams entered since.
#[derive(Default)]
struct Current {
    base: Option<Stream>,
    entered: Vec<Entered>,
}

/// A stream made current by [`enter_stream`] until its [`StreamContext`] exits.
struct Entered {
    stream: Option<Stream>,
    open: Arc<AtomicBool>,
}

impl Current {
    /// Forgets entered streams whose context has exited (maybe on another thread) from the top.
    fn prune(&mut self) {
        while self.entered.last().is_some_and(|e| !e.open.load(Ordering::Acquire)) {
            self.entered.pop();
        }
    }

    /// Puts `stream` wherever this thread has no usable stream: the base when unset, and, in the
    /// child of a `fork()`, the base and every open block whose stream is the parent's (its
    /// worker stayed there). One new stream serves them all, so exiting the blocks the parent
    /// entered neither starts more workers nor falls back on a stream that cannot run.
    fn replace_orphaned(&mut self, stream: &Stream) {
        let slots = std::iter::once(&mut self.base).chain(self.entered.iter_mut().map(|e| &mut e.stream));
        for slot in slots {
            if slot.as_ref().is_some_and(Stream::orphaned) {
                *slot = Some(stream.clone());
            }
        }
        if self.base.is_none() {
            self.base = Some(stream.clone());
        }
    }

    /// The slot that `set_current_stream` replaces: the innermost open `with`, or the base.
    fn slot(&mut self) -> &mut Option<Stream> {
        self.prune();
        match self.entered.last_mut() {
            Some(top) => &mut top.stream,
            None => &mut self.base,
        }
    }
}

thread_local! {
    /// This thread's current stream per device.
    static CURRENT: RefCell<HashMap<DeviceId, Current>> = RefCell::new(HashMap::new());
}

/// The calling thread's current stream on `ctx`'s device, created lazily: each host thread
/// gets its own, so threads never serialize behind each other's work. In the child of a
/// `fork()`, a current stream inherited from the parent (whose worker stayed there) is
/// replaced by a new one.
pub fn current_stream(ctx: &DeviceContext) -> Result<Stream> {
    let found = CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let current = c.get_mut(&ctx.id())?;
        current.slot().clone().or_else(|| current.base.clone())
    });
    if let Some(stream) = found.filter(|s| !s.orphaned()) {
        return Ok(stream);
    }
    let stream = Stream::new(ctx)?;
    CURRENT.with(|c| c.borrow_mut().entry(ctx.id()).or_default().replace_orphaned(&stream));
    Ok(stream)
}

/// Makes `stream` the calling thread's current stream of its device; returns the previous one.
/// Inside a `with` block ([`enter_stream`]) it replaces that block's stream, which the block's
/// exit then undoes, as `torch.cuda.set_stream` inside `with torch.cuda.stream(...)` does.
pub fn set_current_stream(stream: Stream) -> Option<Stream> {
    replace_current_stream(stream.device(), Some(stream))
}

/// Sets (or, with `None`, clears back to lazily created) the calling thread's current stream
/// on `device`; returns the previous one. Like [`set_current_stream`] inside a `with` block.
pub fn replace_current_stream(device: DeviceId, stream: Option<Stream>) -> Option<Stream> {
    CURRENT.with(|c| std::mem::replace(c.borrow_mut().entry(device).or_default().slot(), stream))
}

/// Makes `stream` the calling thread's current stream of its device until the returned context
/// exits (`with stream:`). Contexts may exit in any order and from any thread (a generator
/// holding `with s:` resumed elsewhere): the current stream is always the stream of the
/// innermost context still open on this thread, or, with none open, the stream that was current
/// before the first of them (or set since outside any). In order, each exit restores exactly
/// what its entry replaced, as `torch.cuda.stream` does; out of order, an exit only removes its
/// own stream and never resurrects a stream whose context has already exited.
pub fn enter_stream(stream: Stream) -> StreamContext {
    let device = stream.device();
    let open = Arc::new(AtomicBool::new(true));
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let current = c.entry(device).or_default();
        current.prune();
        current.entered.push(Entered { stream: Some(stream), open: Arc::clone(&open) });
    });
    StreamContext { device, open, thread: std::thread::current().id() }
}

/// An open `with stream:` block from [`enter_stream`]; dropping it exits the block.
#[derive(Debug)]
pub struct StreamContext {
    device: DeviceId,
    open: Arc<AtomicBool>,
    thread: std::thread::ThreadId,
}

impl StreamContext {
    /// Exits the block (the same as dropping the context).
    pub fn exit(self) {}

    /// The thread that entered the block.
    pub fn thread(&self) -> std::thread::ThreadId {
        self.thread
    }
}

impl Drop for StreamContext {
    fn drop(&mut self) {
        self.open.store(false, Ordering::Release);
        if std::thread::current().id() != self.thread {
            return; // the entering thread forgets it at its next look-up
        }
        // `try_with`: this may run while the thread's locals are being destroyed.
        let _ = CURRENT.try_with(|c| {
            let Ok(mut c) = c.try_borrow_mut() else { return };
            if let Some(current) = c.get_mut(&self.device) {
                current.entered.retain(|e| !Arc::ptr_eq(&e.open, &self.open));
                current.prune();
            }
        });
    }
}

/// An asynchronous error with what was launched around it; the original stays its cause.
#[derive(Debug)]
struct ContextError {
    message: String,
    cause: AsyncError,
}

impl std::fmt::Display for ContextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ContextError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.cause)
    }
}
