//! The operator registry: name + version -> operator, for built-ins and loaded libraries alike.
//! Lookups are by name (latest version) or name + version; unknown names and versions are
//! errors that list what exists. Calls hold a guard so an unload can wait for calls in flight.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

use opbridge_runtime::{DType, DeviceKind, Mark};

use crate::error::{OpError, Result};
use crate::schema::{Attrs, Meta, Schema};
use crate::view::{Dims, TensorView};

/// An operator: a schema, a shape/dtype function, and kernels per device.
///
/// Built-in operators and plugin operators implement the same trait, through the same adapters:
/// an operator written with the plugin SDK's `Op` trait becomes one in-process with
/// [`crate::native`] (every built-in) or through the C ABI with [`crate::plugin::Library`].
pub trait Operator: Send + Sync {
    fn schema(&self) -> &Schema;

    /// The dtype each input must have when the kernel runs (the caller converts, once).
    /// Default: unchanged.
    fn input_dtypes(&self, inputs: &[Option<Meta>], _attrs: &Attrs) -> Result<Vec<Option<DType>>> {
        Ok(inputs.iter().map(|m| m.as_ref().map(|m| m.dtype)).collect())
    }

    /// Checks the inputs and returns the outputs' dtypes and shapes (the schema's shape function
    /// and dtype rule). Receives the inputs as the caller passed them.
    fn infer(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Meta>>;

    /// Devices with a kernel.
    fn devices(&self) -> Vec<DeviceKind> {
        vec![DeviceKind::Cpu]
    }

    /// The operator's own kernel on an accelerator (a plugin's, through ABI 3), if it has one.
    /// Built-ins have none here: backends register theirs in [`crate::device`].
    fn device_kernel(&self, _kind: DeviceKind) -> Option<&dyn crate::device::DeviceKernel> {
        None
    }

    /// Whether calls take scratch memory ([`Operator::workspace_size`]): checked first, so
    /// operators without one pay nothing for describing their inputs.
    fn needs_workspace(&self) -> bool {
        false
    }

    /// Bytes of scratch memory a call needs, from the inputs as the kernel receives them (after
    /// `input_dtypes`). Pure.
    fn workspace_size(&self, _inputs: &[Option<Meta>], _attrs: &Attrs) -> Result<usize> {
        Ok(0)
    }

    /// The CPU kernel: `inputs` already have the dtypes of `input_dtypes` (any strides),
    /// `outputs` are contiguous, of the inferred metas, and do not overlap the inputs unless
    /// [`Operator::in_place_ok`] says so. `workspace` is zeroed and exactly
    /// [`Operator::workspace_size`] bytes (empty without one); whoever calls brings it, so it
    /// can come from the call's allocator (a session's quota covers it).
    fn run_cpu_in(
        &self,
        inputs: &[Option<TensorView>],
        outputs: &[TensorView],
        attrs: &Attrs,
        workspace: &mut [u8],
    ) -> Result<()>;

    /// [`Operator::run_cpu_in`] with a workspace allocated on the host for the call.
    fn run_cpu(&self, inputs: &[Option<TensorView>], outputs: &[TensorView], attrs: &Attrs) -> Result<()> {
        if !self.needs_workspace() {
            return self.run_cpu_in(inputs, outputs, attrs, &mut []);
        }
        let metas: smallvec::SmallVec<[Option<Meta>; 4]> =
            inputs.iter().map(|v| v.as_ref().map(|v| Meta::new(v.dtype, &v.shape))).collect();
        let bytes = self.workspace_size(&metas, attrs)?;
        let mut workspace = crate::workspace::Workspace::new(bytes).ok_or_else(|| OpError::Workspace {
            op: self.schema().name.as_str().into(),
            bytes,
            reason: "the host cannot allocate that much".into(),
        })?;
        self.run_cpu_in(inputs, outputs, attrs, workspace.bytes())
    }

    /// Elementwise operators may write an output over an input of the same layout.
    fn in_place_ok(&self) -> bool {
        false
    }

    /// The fast lane of elementwise operators, if this is one (see [`Lane`]).
    fn lane(&self) -> Option<&Lane> {
        None
    }

    /// The fast lane of operators over strided views of one dtype (see [`ViewLane`]).
    fn view_lane(&self) -> Option<&ViewLane> {
        None
    }

    /// How independent calls merge into one along axis 0 (a server's dynamic batching), if
    /// they can: see [`Batching`]. Default: never.
    fn batching(&self) -> Option<Batching> {
        None
    }

    /// The checks of the CPU kernel that need the inputs' values (`embedding_bag`'s indices in
    /// range), made on their bytes by a caller that has them on the host before a device runs
    /// the call: a device kernel cannot make them before it runs. Inputs as the caller passes
    /// them (little-endian bytes, any alignment). Default: none.
    fn check_host_values(&self, _inputs: &[Option<(&[u8], Meta)>], _attrs: &Attrs) -> Result<()> {
        Ok(())
    }
}

/// A [`Operator::check_host_values`] function.
pub type HostValueCheck = fn(&[Option<(&[u8], Meta)>], &Attrs) -> Result<()>;

/// How calls of an operator merge into one call along axis 0, the way a server batches small
/// requests: the calls' inputs are concatenated along axis 0, except the `shared` ones, which
/// must be equal (dtype, shape and bytes) in all of them; the attributes are equal; and each
/// output of the merged call is split back along axis 0 in the calls' order. The operator
/// promises that each part then equals, bit for bit, what the call alone would have given:
/// rows are computed independently of each other and of how many there are.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    /// Indexes of the inputs every merged call shares (`matmul`'s `b`, a norm's weight).
    pub shared: &'static [usize],
    /// Whether a call with these inputs (as the caller passes them) and attributes can take
    /// part: e.g. an elementwise call only without broadcasting, softmax only over an axis
    /// other than 0.
    pub accepts: fn(&[Option<Meta>], &Attrs) -> bool,
}

impl Batching {
    /// Elementwise operators: every call whose inputs have one shape of at least one dimension
    /// (broadcasting would mix rows).
    pub const ELEMENTWISE: Batching = Batching { shared: &[], accepts: same_shapes };

    /// The number of rows (axis-0 length) of a call that can take part, or `None`: every
    /// concatenated input present has at least one dimension and the same axis-0 length, and
    /// `accepts` agrees.
    pub fn rows_of(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Option<usize> {
        let mut lengths = (0..inputs.len())
            .filter(|i| !self.shared.contains(i))
            .filter_map(|i| inputs[i].as_ref())
            .map(|m| m.shape.first().copied());
        let rows = lengths.next()??;
        (lengths.all(|n| n == Some(rows)) && (self.accepts)(inputs, attrs)).then_some(rows)
    }
}

/// Every present input of one shape, with at least one dimension.
fn same_shapes(inputs: &[Option<Meta>], _: &Attrs) -> bool {
    let mut present = inputs.iter().flatten();
    let Some(first) = present.next() else { return false };
    !first.shape.is_empty() && present.all(|m| m.shape == first.shape)
}

/// Whether an elementwise operator's lane takes inputs of a dtype (and gives that dtype back).
pub type LaneAcceptsFn = dyn Fn(DType) -> bool + Send + Sync;
/// A lane kernel: `(dtype, input addresses, output address, element count)`.
pub type LaneKernelFn = dyn Fn(DType, &[usize], usize, usize) -> Result<()> + Send + Sync;

/// The fast lane of an elementwise operator: every input and the output C-contiguous, of one
/// shape and one dtype, attributes at their defaults. A small call spends most of its time
/// describing itself (shape function, dtype rule, views); in the lane a caller that has checked
/// those conditions skips the description and hands the kernel raw addresses. numpy's ufuncs
/// have the same lane for contiguous operands. Results must equal the generic path's.
pub struct Lane {
    /// dtypes the lane serves: the result has the inputs' dtype and no input check is left
    /// (integer `div` or `pow`, for instance, stay on the generic path).
    pub accepts: Box<LaneAcceptsFn>,
    /// For binary operators whose input-dtype rule is exactly numpy's promotion of the two
    /// (`vector_add`): the dtype inputs of two different dtypes are converted to before the
    /// lane runs. `None`: calls with mixed dtypes take the generic path.
    pub promote: Option<fn(DType, DType) -> DType>,
    /// Runs over `len` elements. The caller guarantees what [`Operator::run_cpu`]'s callers
    /// guarantee for views: each address is aligned for the dtype and valid for `len` elements,
    /// and the output is disjoint from every input or exactly equal to one when the operator
    /// is [`Operator::in_place_ok`].
    pub run: Box<LaneKernelFn>,
}

impl fmt::Debug for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Lane")
    }
}

/// The output shape a [`ViewLane`] gives for its inputs' shapes, or `None` when it does not
/// serve the call.
pub type ViewLaneShapeFn = dyn Fn(&[&[usize]]) -> Option<Dims> + Send + Sync;
/// A view-lane kernel: inputs of one dtype (any strides in whole elements), the output
/// contiguous, of the lane's shape, disjoint from the inputs.
pub type ViewLaneKernelFn = dyn Fn(&[TensorView], &TensorView) -> Result<()> + Send + Sync;

/// The fast lane of an operator over strided views (`matmul`, the whole-array reductions): every
/// input of one dtype the lane accepts, any strides, attributes at their defaults, one output.
/// As with [`Lane`], the caller that has checked those conditions skips the generic description
/// of the call (input-dtype rule, shape function memo, output checks): the lane's own shape rule
/// answers, or declines and the generic path takes the call (errors included). Results must
/// equal the generic path's.
pub struct ViewLane {
    /// dtypes the lane serves (the inputs all of that one dtype).
    pub accepts: fn(DType) -> bool,
    /// The output's dtype for inputs of `dtype` (`argmax` gives int64, `sum` of int32 int64).
    pub out_dtype: fn(DType) -> DType,
    /// The output's shape, or `None` to decline (shapes the generic path must reject or that
    /// need more than the lane knows).
    pub shape: Box<ViewLaneShapeFn>,
    /// Bytes of memory traffic a call does, so the caller can release its interpreter lock for
    /// long calls (`host` GIL threshold).
    pub work_bytes: fn(&[&[usize]], DType) -> usize,
    pub run: Box<ViewLaneKernelFn>,
}

impl fmt::Debug for ViewLane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ViewLane")
    }
}

/// Where an operator comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Builtin,
    Library(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Builtin => f.write_str("built-in"),
            Source::Library(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A registered operator version, with its count of calls in flight.
pub struct Entry {
    pub op: Arc<dyn Operator>,
    pub source: Source,
    /// Calls in flight: an atomic, so a call costs no lock (the lock below is for unloads).
    /// Counted only for operators whose code can go away (a library's): a built-in's code lives
    /// as long as the process, so its calls skip the two sequentially consistent atomics.
    calls: AtomicUsize,
    counted: bool,
    /// Unloads waiting for `calls` to reach zero (they sleep on `idle` under `wait`).
    waiters: AtomicUsize,
    wait: Mutex<()>,
    idle: Condvar,
    /// Where asynchronous calls end in their streams (some may be done): an unload started from
    /// stream work checks them before it blocks, so it fails instead of waiting for a call
    /// queued behind that very work.
    queued: Mutex<std::collections::VecDeque<Mark>>,
    /// `name vN`, made once: how device launches name the operator.
    label: std::sync::OnceLock<Arc<str>>,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Entry({} v{}, {})", self.op.schema().name, self.op.schema().version, self.source)
    }
}

impl Entry {
    /// Devices this operator runs on: its own kernels, plus the accelerator kernels backends
    /// registered for it (built-ins only: a library's operator of the same name is not theirs).
    pub fn devices(&self) -> Vec<DeviceKind> {
        let mut devices = self.op.devices();
        if matches!(self.source, Source::Builtin) {
            devices.extend(crate::device::kinds(&self.op.schema().name));
        }
        devices.sort();
        devices.dedup();
        devices
    }

    /// The operator's kernel on `kind`: its own (a library's), or the one a backend registered
    /// for this built-in.
    pub fn device_kernel(&self, kind: DeviceKind) -> Option<&dyn crate::device::DeviceKernel> {
        if let Some(kernel) = self.op.device_kernel(kind) {
            return Some(kernel);
        }
        match self.source {
            Source::Builtin => crate::device::find(kind, &self.op.schema().name),
            Source::Library(_) => None,
        }
    }

    /// Whether the operator's kernel on `kind` computes in `dtype` (what routing a call there
    /// must know first).
    pub fn runs_on(&self, kind: DeviceKind, dtype: DType) -> bool {
        self.device_kernel(kind).is_some_and(|k| k.dtypes().is_none_or(|allowed| allowed.contains(&dtype)))
    }

    fn new(op: Arc<dyn Operator>, source: Source) -> Entry {
        Entry {
            op,
            counted: source != Source::Builtin,
            source,
            calls: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            wait: Mutex::new(()),
            idle: Condvar::new(),
            queued: Mutex::new(std::collections::VecDeque::new()),
            label: std::sync::OnceLock::new(),
        }
    }

    /// `name vN` (`add v1`), shared: how a device launch names this operator.
    pub fn label(&self) -> Arc<str> {
        let schema = self.schema();
        Arc::clone(self.label.get_or_init(|| format!("{} v{}", schema.name, schema.version).into()))
    }

    pub fn schema(&self) -> &Schema {
        self.op.schema()
    }

    /// Marks a call in flight until the guard drops (async calls move it into the kernel).
    pub fn enter(self: &Arc<Self>) -> CallGuard {
        if self.counted {
            self.calls.fetch_add(1, Ordering::SeqCst);
        }
        CallGuard(Arc::clone(self))
    }

    /// Like [`Entry::enter`] for a call that ends before the caller returns (no `Arc` to
    /// clone: the synchronous numpy path).
    pub fn enter_scoped(&self) -> ScopedCall<'_> {
        if self.counted {
            self.calls.fetch_add(1, Ordering::SeqCst);
        }
        ScopedCall(self)
    }

    /// Ends a call: wakes an unload waiting for the last one.
    fn exit(&self) {
        if !self.counted {
            return;
        }
        // Waking costs a lock and a system call: only when an unload is actually waiting.
        if self.calls.fetch_sub(1, Ordering::SeqCst) == 1 && self.waiters.load(Ordering::SeqCst) > 0 {
            // Taking the lock orders the wake after the waiter's check (it holds the lock from
            // its check until it sleeps).
            let _lock = self.wait.lock().unwrap_or_else(|p| p.into_inner());
            self.idle.notify_all();
        }
    }

    /// Notes where an asynchronous call ends in its stream (see [`Entry::wait_idle`]).
    pub fn track(&self, done: Mark) {
        if !self.counted {
            return; // a built-in: nothing waits for its calls (see `counted`)
        }
        let mut queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        // Calls on one stream complete in order: drop finished ones from the front, and sweep
        // the rest when the list doubles (amortized constant per call).
        while queued.front().is_some_and(Mark::known_done) {
            queued.pop_front();
        }
        if queued.len() >= 64 && queued.len().is_power_of_two() {
            queued.retain(|e| !e.query()); // seals the marks' epochs: an event per sweep
        }
        queued.push_back(done);
    }

    /// Blocks until no call of this operator is in flight, device work they queued included
    /// (built-ins, whose code cannot be unloaded, are not counted: it returns at once).
    ///
    /// From stream work (a host function) a call queued behind that work, directly or through
    /// other streams, could never finish: that is a `Device` error instead of a hang.
    pub fn wait_idle(&self) -> std::result::Result<(), opbridge_runtime::Error> {
        if !self.counted {
            return Ok(());
        }
        let checked = opbridge_runtime::on_stream_worker();
        let mut lock = self.wait.lock().unwrap_or_else(|p| p.into_inner());
        // SeqCst on both sides: either the last call sees this waiter and wakes it, or this
        // waiter sees the count at zero (store, then load, in each thread).
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut outcome = Ok(());
        while self.calls.load(Ordering::SeqCst) > 0 {
            if !checked {
                lock = self.idle.wait(lock).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            // Wait for each queued call with the runtime's checked waits (outside the lock, so
            // the last call can wake us), then look again: a call launched meanwhile on another
            // thread is noted just after it is queued, so the timeout bounds how late we see it.
            drop(lock);
            let pending: Vec<Mark> = self.queued.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
            outcome = pending.iter().try_for_each(Mark::synchronize);
            lock = self.wait.lock().unwrap_or_else(|p| p.into_inner());
            if outcome.is_err() {
                break;
            }
            if self.calls.load(Ordering::SeqCst) > 0 {
                lock = self
                    .idle
                    .wait_timeout(lock, std::time::Duration::from_millis(20))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        drop(lock);
        outcome?;
        // Device launches end when their stream gets there, not when the call returns: wait
        // for every one still queued (checked waits: from stream work, one queued behind it
        // fails instead of hanging).
        let pending: Vec<Mark> = self.queued.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        for mark in &pending {
            if let Err(error) = mark.synchronize() {
                // From stream work: a launch queued behind it (the wait would never end); the
                // marks stay, for a later wait. Elsewhere the launch has ended, failed: nothing
                // of the operator runs any more.
                if checked {
                    return Err(error);
                }
            }
        }
        // Every one waited for, so passed: forget those (a launch noted meanwhile stays).
        self.queued.lock().unwrap_or_else(|p| p.into_inner()).retain(|m| !m.known_done());
        Ok(())
    }
}

/// Keeps an operator counted as in use (see [`Entry::enter`]).
#[derive(Debug)]
pub struct CallGuard(Arc<Entry>);

impl CallGuard {
    pub fn entry(&self) -> &Arc<Entry> {
        &self.0
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// A call in flight for the duration of a borrow (see [`Entry::enter_scoped`]).
#[derive(Debug)]
pub struct ScopedCall<'a>(&'a Entry);

impl ScopedCall<'_> {
    pub fn entry(&self) -> &Entry {
        self.0
    }
}

impl Drop for ScopedCall<'_> {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// What `list_ops` reports for one operator name.
#[derive(Debug, Clone, PartialEq)]
pub struct OpInfo {
    pub name: String,
    /// (version, source, dtypes, devices), oldest first.
    pub versions: Vec<(u32, Source, Vec<DType>, Vec<DeviceKind>)>,
}

/// Operators by name, then version. Owned by whoever needs one (`Arc`): Python uses the
/// process-wide default of the builtins layer, a server one per model repository.
#[derive(Default)]
pub struct Registry {
    ops: RwLock<BTreeMap<String, BTreeMap<u32, Arc<Entry>>>>,
    /// Bumped by every register/unregister, so callers can cache lookups.
    generation: AtomicU64,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registry({} operators)", self.read().len())
    }
}

impl Registry {
    /// An empty registry (the built-ins are added by `crate::builtins::register_builtins`;
    /// the process-wide default with them is `crate::builtins::global`).
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, BTreeMap<u32, Arc<Entry>>>> {
        self.ops.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds an operator version; a name + version that exists already is an error.
    pub fn register(&self, op: Arc<dyn Operator>, source: Source) -> Result<Arc<Entry>> {
        let (name, version) = (op.schema().name.clone(), op.schema().version);
        let mut ops = self.ops.write().unwrap_or_else(|p| p.into_inner());
        let versions = ops.entry(name.clone()).or_default();
        if let Some(existing) = versions.get(&version) {
            return Err(OpError::DuplicateOperator { name, version, existing: existing.source.to_string() });
        }
        let entry = Arc::new(Entry::new(op, source));
        versions.insert(version, Arc::clone(&entry));
        self.generation.fetch_add(1, Ordering::SeqCst);
        Ok(entry)
    }

    /// Removes an operator version (calls already holding its entry finish normally).
    pub fn unregister(&self, name: &str, version: u32) -> Option<Arc<Entry>> {
        let mut ops = self.ops.write().unwrap_or_else(|p| p.into_inner());
        let versions = ops.get_mut(name)?;
        let entry = versions.remove(&version);
        if versions.is_empty() {
            ops.remove(name);
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        entry
    }

    /// `name` at `version`, or its latest version.
    pub fn get(&self, name: &str, version: Option<u32>) -> Result<Arc<Entry>> {
        let ops = self.read();
        let Some(versions) = ops.get(name) else {
            return Err(OpError::UnknownOperator {
                name: name.to_string(),
                available: ops.keys().cloned().collect::<Vec<_>>().join(", "),
            });
        };
        let found = match version {
            Some(v) => versions.get(&v),
            None => versions.values().next_back(),
        };
        found.cloned().ok_or_else(|| OpError::UnknownVersion {
            name: name.to_string(),
            version: version.unwrap_or(0),
            available: versions.keys().map(u32::to_string).collect::<Vec<_>>().join(", "),
        })
    }

    /// Changes whenever an operator is registered or unregistered.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    pub fn list(&self) -> Vec<OpInfo> {
        self.read()
            .iter()
            .map(|(name, versions)| OpInfo {
                name: name.clone(),
                versions: versions
                    .iter()
                    .map(|(&v, e)| (v, e.source.clone(), e.schema().dtypes.clone(), e.devices()))
                    .collect(),
            })
            .collect()
    }
}
