//! The profiler's event log: what the runtime, the dispatch layer and the bindings record while a
//! profile is active (operator calls, kernels where they ran, copies, pool events, waits, host
//! functions, plugin loads, JIT compiles), for `opbridge.profiler` to export as a Chrome trace
//! and to aggregate.
//!
//! Inactive, every instrumented point costs one relaxed atomic load ([`active`]). Active, an
//! event is a push into the calling thread's own buffer (an uncontended lock). Each thread is a track (a stream's worker thread is that
//! stream's track); work enqueued on a stream is linked to the call that enqueued it by a flow
//! (a `FlowStart` on the caller's track, a `FlowEnd` where the work begins).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

static ACTIVE: AtomicBool = AtomicBool::new(false);
static SHAPES: AtomicBool = AtomicBool::new(false);
static MEMORY: AtomicBool = AtomicBool::new(false);
static NEXT_FLOW: AtomicU64 = AtomicU64::new(1);
static NEXT_TRACK: AtomicU64 = AtomicU64::new(1);
/// Serializes start and stop; holds whether a profile is recording.
static CONTROL: Mutex<bool> = Mutex::new(false);
/// The profile now recording (incremented at each start): a thread's buffer holding events of an
/// older one is cleared before its next event.
static SESSION: AtomicU64 = AtomicU64::new(0);
/// Nanoseconds from `epoch()` to the start of the profile now recording.
static STARTED_NS: AtomicU64 = AtomicU64::new(0);
/// Every thread's event buffer. A thread appends to its own, so recording never contends
/// across threads; `stop` gathers them (buffers outlive their threads until then).
static BUFFERS: Mutex<Vec<Arc<Mutex<Buffer>>>> = Mutex::new(Vec::new());
/// Every track that ever recorded: (id, name, OS thread id). Grows with threads, not events.
static TRACKS: Mutex<Vec<(u64, String, u64)>> = Mutex::new(Vec::new());

thread_local! {
    static TRACK: Cell<u64> = const { Cell::new(0) };
    static BUFFER: std::cell::OnceCell<Arc<Mutex<Buffer>>> = const { std::cell::OnceCell::new() };
    /// Whether an operator call's span is open on this thread: the front end opened it (with
    /// the call's arguments as the caller gave them), so the layers below do not open another.
    static IN_CALL: Cell<bool> = const { Cell::new(false) };
    /// The operator call in progress on this thread (while memory is profiled): the pool
    /// records it as the origin of the blocks it hands out.
    static CURRENT_OP: std::cell::RefCell<Option<Arc<str>>> = const { std::cell::RefCell::new(None) };
}

/// The operator call in progress on this thread, when memory is being profiled.
pub fn current_op() -> Option<Arc<str>> {
    CURRENT_OP.try_with(|op| op.borrow().clone()).ok().flatten()
}

/// Whether a profile is recording. The one check instrumented code makes when none is.
#[inline]
pub fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Whether operator calls record their input shapes and dtypes.
#[inline]
pub fn record_shapes() -> bool {
    SHAPES.load(Ordering::Relaxed)
}

/// Whether pool events (allocations, frees, cache hits, OOMs, retries) are recorded.
#[inline]
pub fn profile_memory() -> bool {
    MEMORY.load(Ordering::Relaxed) && active()
}

/// What an event marks (the Chrome trace phases we use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A duration begins on this track (closed by the next unmatched `End`).
    Begin,
    End,
    /// A point in time (pool events).
    Instant,
    /// Work was enqueued here; it begins where the `FlowEnd` with the same id is.
    FlowStart,
    FlowEnd,
    /// A whole duration, recorded when it ends (`Event::dur_ns`): ranges that need not nest,
    /// such as two asyncio tasks' on one thread.
    Complete,
}

/// An event argument's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    Int(i64),
    Float(f64),
    Str(String),
    /// A fixed text: no allocation while recording.
    Static(&'static str),
    /// A device, rendered (`cpu:0`) when the recording is read: no allocation while recording.
    Device(crate::ids::DeviceId),
}

impl Arg {
    /// The value as text, for a front end that writes it out (numbers as written by Rust).
    pub fn to_text(&self) -> String {
        match self {
            Arg::Int(v) => v.to_string(),
            Arg::Float(v) => v.to_string(),
            Arg::Str(v) => v.clone(),
            Arg::Static(v) => (*v).to_string(),
            Arg::Device(d) => d.to_string(),
        }
    }
}

impl From<crate::ids::DeviceId> for Arg {
    fn from(v: crate::ids::DeviceId) -> Arg {
        Arg::Device(v)
    }
}

impl From<usize> for Arg {
    fn from(v: usize) -> Arg {
        Arg::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<u32> for Arg {
    fn from(v: u32) -> Arg {
        Arg::Int(v.into())
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<f64> for Arg {
    fn from(v: f64) -> Arg {
        Arg::Float(v)
    }
}

impl From<String> for Arg {
    fn from(v: String) -> Arg {
        Arg::Str(v)
    }
}

impl From<&'static str> for Arg {
    fn from(v: &'static str) -> Arg {
        Arg::Static(v)
    }
}

/// One recorded event.
#[derive(Debug, Clone)]
pub struct Event {
    pub phase: Phase,
    /// `op`, `kernel`, `copy`, `memory`, `sync`, `host_func`, `plugin`, `jit`, `user`.
    pub category: &'static str,
    pub name: Arc<str>,
    /// Nanoseconds since the profile started.
    pub ts_ns: u64,
    pub track: u64,
    /// The flow id of `FlowStart` / `FlowEnd` events (0 otherwise).
    pub flow: u64,
    /// The duration of a `Complete` event (0 otherwise).
    pub dur_ns: u64,
    pub args: Vec<(&'static str, Arg)>,
}

/// What a profile recorded: its events in recording order, and the names of their tracks.
#[derive(Debug, Default)]
pub struct Recording {
    pub events: Vec<Event>,
    /// (id, name, OS thread id): threads the runtime did not name (Python's, say) are named
    /// `thread <OS id>` here, for the front end to rename.
    pub tracks: Vec<(u64, String, u64)>,
}

#[derive(Debug, Default)]
struct Buffer {
    session: u64,
    events: Vec<Event>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's time origin: timestamps are taken against it, then shifted to the profile's.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// The calling thread's track id (assigned, and its name registered, on first use).
fn this_track() -> u64 {
    TRACK.with(|t| {
        if t.get() == 0 {
            let id = NEXT_TRACK.fetch_add(1, Ordering::Relaxed);
            let os_id = os_thread_id();
            let name = std::thread::current().name().map_or_else(|| format!("thread {os_id}"), str::to_string);
            lock(&TRACKS).push((id, name, os_id));
            t.set(id);
        }
        t.get()
    })
}

/// The calling thread's OS id (Linux: `/proc/thread-self` links to `<pid>/task/<tid>`), or 0.
fn os_thread_id() -> u64 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|link| link.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// Names the calling thread's track (a stream worker names itself after its stream).
pub fn name_this_track(name: String) {
    let id = this_track();
    let mut tracks = lock(&TRACKS);
    if let Some(entry) = tracks.iter_mut().find(|(t, _, _)| *t == id) {
        entry.1 = name;
    }
}

/// Starts recording. Fails when a profile is already recording (one at a time per process).
pub fn start(shapes: bool, memory: bool) -> Result<(), String> {
    let mut recording = lock(&CONTROL);
    if *recording {
        return Err("a profile is already recording in this process".into());
    }
    *recording = true;
    SESSION.fetch_add(1, Ordering::AcqRel);
    STARTED_NS.store(now_ns(), Ordering::Release);
    SHAPES.store(shapes, Ordering::Relaxed);
    MEMORY.store(memory, Ordering::Relaxed);
    ACTIVE.store(true, Ordering::Release);
    Ok(())
}

/// Stops recording and returns what was recorded (None when nothing was). Durations still open
/// are closed at the stop time; flows whose other end was not recorded are dropped, so the
/// trace is always well formed.
pub fn stop() -> Option<Recording> {
    let session = {
        let mut recording = lock(&CONTROL);
        if !*recording {
            return None;
        }
        *recording = false;
        ACTIVE.store(false, Ordering::Release);
        SESSION.load(Ordering::Acquire)
    };
    let started = STARTED_NS.load(Ordering::Acquire);
    let end_ns = now_ns().saturating_sub(started);
    let mut gathered = Vec::new();
    {
        let mut buffers = lock(&BUFFERS);
        for buffer in buffers.iter() {
            let mut buffer = lock(buffer);
            // Taken, not drained: the buffer's capacity goes back to the allocator too.
            let events = std::mem::take(&mut buffer.events);
            if buffer.session == session {
                gathered.extend(events);
            }
        }
        // The buffers of threads that have exited are not needed any more.
        buffers.retain(|b| Arc::strong_count(b) > 1);
    }
    // One timeline: by time (stable, so each track keeps its own order).
    gathered.sort_by_key(|e| e.ts_ns);
    // Ends without their begin (a span that began before this profile) are dropped; begins left
    // open are closed at the stop time, per track, innermost first.
    let mut open: HashMap<u64, Vec<(&'static str, Arc<str>)>> = HashMap::new();
    let mut events = Vec::with_capacity(gathered.len());
    for e in gathered {
        match e.phase {
            Phase::Begin => open.entry(e.track).or_default().push((e.category, e.name.clone())),
            // An end whose begin this profile did not record.
            Phase::End if open.entry(e.track).or_default().pop().is_none() => continue,
            _ => {}
        }
        events.push(e);
    }
    for (track, stack) in open {
        for (category, name) in stack.into_iter().rev() {
            events.push(Event {
                phase: Phase::End,
                category,
                name,
                ts_ns: end_ns,
                track,
                flow: 0,
                dur_ns: 0,
                args: Vec::new(),
            });
        }
    }
    // Keep only flows with both ends.
    let mut starts = HashSet::new();
    let mut ends = HashSet::new();
    for e in &events {
        match e.phase {
            Phase::FlowStart => {
                starts.insert(e.flow);
            }
            Phase::FlowEnd => {
                ends.insert(e.flow);
            }
            _ => {}
        }
    }
    events.retain(|e| {
        !matches!(e.phase, Phase::FlowStart | Phase::FlowEnd) || (starts.contains(&e.flow) && ends.contains(&e.flow))
    });
    let used: HashSet<u64> = events.iter().map(|e| e.track).collect();
    let tracks = lock(&TRACKS).iter().filter(|(id, _, _)| used.contains(id)).cloned().collect();
    Some(Recording { events, tracks })
}

/// Records one event on the calling thread's track (nothing when no profile is recording).
pub fn record(phase: Phase, category: &'static str, name: &str, flow: u64, args: Vec<(&'static str, Arg)>) {
    if active() {
        record_named(phase, category, name.into(), flow, args);
    }
}

/// [`record`] with the name already shared (a span's end reuses its begin's).
fn record_named(phase: Phase, category: &'static str, name: Arc<str>, flow: u64, args: Vec<(&'static str, Arg)>) {
    if !active() {
        return;
    }
    let ts_ns = now_ns().saturating_sub(STARTED_NS.load(Ordering::Acquire));
    push_event(Event { phase, category, name, ts_ns, track: this_track(), flow, dur_ns: 0, args });
}

/// Appends to the calling thread's buffer (for the profile now recording).
fn push_event(event: Event) {
    let session = SESSION.load(Ordering::Acquire);
    let _ = BUFFER.try_with(|cell| {
        let buffer = cell.get_or_init(|| {
            let buffer = Arc::new(Mutex::new(Buffer::default()));
            lock(&BUFFERS).push(Arc::clone(&buffer));
            buffer
        });
        let mut buffer = lock(buffer);
        if buffer.session > session {
            return; // recorded for a profile that has ended since
        }
        if buffer.session < session {
            buffer.events = Vec::new();
            buffer.session = session;
        }
        buffer.events.push(event);
    });
}

/// Nanoseconds since the profile now recording started (0 when none is).
pub fn now() -> u64 {
    if active() {
        now_ns().saturating_sub(STARTED_NS.load(Ordering::Acquire))
    } else {
        0
    }
}

/// Records a whole duration that began at `begin_ns` (from [`now`]) and ends now.
pub fn complete(category: &'static str, name: &str, begin_ns: u64, args: Vec<(&'static str, Arg)>) {
    if !active() {
        return;
    }
    let end = now();
    let begin = begin_ns.min(end);
    push_event(Event {
        phase: Phase::Complete,
        category,
        name: name.into(),
        ts_ns: begin,
        track: this_track(),
        flow: 0,
        dur_ns: end - begin,
        args,
    });
}

/// A fresh flow id, to link a call with the work it enqueued.
pub fn new_flow() -> u64 {
    NEXT_FLOW.fetch_add(1, Ordering::Relaxed)
}

/// A duration on the calling thread's track, ended when dropped.
#[derive(Debug)]
#[must_use = "the span ends when dropped"]
pub struct Span {
    category: &'static str,
    name: Arc<str>,
    /// For an operator span: whether one was open on this thread before (restored at the end).
    outer_call: Option<bool>,
    /// For an operator span while memory is profiled: its allocations are attributed to it.
    _allocations: Option<AllocationsBy>,
}

/// While alive (and memory is profiled), the pool attributes this thread's allocations to an
/// operator; the attribution in force before is restored when it drops.
#[derive(Debug)]
#[must_use = "the attribution ends when dropped"]
pub struct AllocationsBy {
    outer: Option<Arc<str>>,
}

/// Attributes this thread's allocations to the operator `name` until the guard drops (nothing,
/// at the cost of two atomic loads, unless memory is being profiled). Front ends that allocate
/// a call's outputs before dispatching it open one around the whole call.
#[inline]
pub fn allocations_by(name: &str) -> Option<AllocationsBy> {
    if !profile_memory() {
        return None;
    }
    let outer = CURRENT_OP.try_with(|op| op.replace(Some(name.into()))).ok().flatten();
    Some(AllocationsBy { outer })
}

impl Drop for AllocationsBy {
    fn drop(&mut self) {
        let outer = self.outer.take();
        let _ = CURRENT_OP.try_with(|op| op.replace(outer));
    }
}

impl Span {
    /// Begins a span (and, with `flow_end`, ends that flow where it begins).
    pub fn begin(category: &'static str, name: &str, flow_end: u64, args: Vec<(&'static str, Arg)>) -> Span {
        if flow_end != 0 {
            record(Phase::FlowEnd, category, name, flow_end, Vec::new());
        }
        let name: Arc<str> = name.into();
        record_named(Phase::Begin, category, Arc::clone(&name), 0, args);
        let (allocations, outer_call) = if category == "op" {
            (allocations_by(&name), IN_CALL.try_with(|c| c.replace(true)).ok())
        } else {
            (None, None)
        };
        Span { category, name, outer_call, _allocations: allocations }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(outer) = self.outer_call {
            let _ = IN_CALL.try_with(|c| c.set(outer));
        }
        self._allocations.take();
        record_named(Phase::End, self.category, Arc::clone(&self.name), 0, Vec::new());
    }
}

/// Whether an operator call's span is open on this thread (see [`Span::begin`]).
pub fn in_call() -> bool {
    IN_CALL.try_with(Cell::get).unwrap_or(false)
}

/// A span when a profile is recording, else nothing (the inactive path: one atomic load).
#[inline]
pub fn span(category: &'static str, name: &str, args: impl FnOnce() -> Vec<(&'static str, Arg)>) -> Option<Span> {
    if active() {
        Some(Span::begin(category, name, 0, args()))
    } else {
        None
    }
}

/// A pool event (when memory is being profiled).
#[inline]
pub fn memory_event(name: &str, args: impl FnOnce() -> Vec<(&'static str, Arg)>) {
    if profile_memory() {
        record(Phase::Instant, "memory", name, 0, args());
    }
}

/// Work about to be enqueued from this thread: a flow id recorded here (0 when inactive), for
/// the span that runs the work to end.
pub fn enqueue(category: &'static str, name: &str) -> u64 {
    if !active() {
        return 0;
    }
    let flow = new_flow();
    record(Phase::FlowStart, category, name, flow, Vec::new());
    flow
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test owns the process-wide profiler (other tests' threads may add events: only this
    /// thread's track is checked).
    #[test]
    fn stop_closes_open_spans_and_drops_half_flows_and_stray_ends() {
        let stray = Span::begin("op", "before", 0, Vec::new()); // begun before the profile: never recorded
        start(true, true).unwrap();
        assert!(start(false, false).is_err(), "one profile at a time");
        drop(stray); // its end has no begin in this profile
        let flow = enqueue("kernel", "paired");
        {
            let _k = Span::begin("kernel", "paired", flow, vec![("bytes", 8usize.into())]);
        }
        let _lost = enqueue("kernel", "never ran");
        let open = Span::begin("op", "left open", 0, Vec::new());
        let recording = stop().expect("recorded");
        drop(open); // after the stop: not recorded
        assert!(!active());
        let track = this_track();
        let mine: Vec<(Phase, &str)> =
            recording.events.iter().filter(|e| e.track == track).map(|e| (e.phase, &*e.name)).collect();
        assert_eq!(
            mine,
            [
                (Phase::FlowStart, "paired"),
                (Phase::FlowEnd, "paired"),
                (Phase::Begin, "paired"),
                (Phase::End, "paired"),
                (Phase::Begin, "left open"),
                (Phase::End, "left open"),
            ]
        );
        let times: Vec<u64> = recording.events.iter().filter(|e| e.track == track).map(|e| e.ts_ns).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert!(recording.tracks.iter().any(|(id, _, _)| *id == track));
        assert!(stop().is_none());
    }
}
