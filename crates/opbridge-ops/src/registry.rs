//! The operator registry: name + version -> operator, for built-ins and loaded libraries alike.
//! Lookups are by name (latest version) or name + version; unknown names and versions are
//! errors that list what exists. Calls hold a guard so an unload can wait for calls in flight.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};

use opbridge_runtime::{DType, DeviceKind};

use crate::error::{OpError, Result};
use crate::schema::{AttrSpec, AttrValue, Attrs, InputSpec, Meta, Schema};
use crate::view::TensorView;

/// An operator: a schema, a shape/dtype function, and kernels per device.
///
/// Built-in operators and plugin operators implement the same trait; most are made with
/// [`OpBuilder`], which fills in the boilerplate.
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

    /// The CPU kernel: `inputs` already have the dtypes of `input_dtypes` (any strides),
    /// `outputs` are contiguous, of the inferred metas, and do not overlap the inputs unless
    /// [`Operator::in_place_ok`] says so.
    fn run_cpu(&self, inputs: &[Option<TensorView>], outputs: &[TensorView], attrs: &Attrs) -> Result<()>;

    /// Elementwise operators may write an output over an input of the same layout.
    fn in_place_ok(&self) -> bool {
        false
    }
}

type InferFn = dyn Fn(&[Option<Meta>], &Attrs) -> Result<Vec<Meta>> + Send + Sync;
type CastFn = dyn Fn(&[Option<Meta>], &Attrs) -> Result<Vec<Option<DType>>> + Send + Sync;
type KernelFn = dyn Fn(&[Option<TensorView>], &[TensorView], &Attrs) -> Result<()> + Send + Sync;

/// An operator assembled from closures by [`OpBuilder`].
pub struct OpDef {
    schema: Schema,
    infer: Box<InferFn>,
    cast: Option<Box<CastFn>>,
    cpu: Box<KernelFn>,
    in_place_ok: bool,
}

impl fmt::Debug for OpDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpDef({} v{})", self.schema.name, self.schema.version)
    }
}

impl Operator for OpDef {
    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn input_dtypes(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Option<DType>>> {
        match &self.cast {
            Some(cast) => cast(inputs, attrs),
            None => Ok(inputs.iter().map(|m| m.as_ref().map(|m| m.dtype)).collect()),
        }
    }

    fn infer(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Meta>> {
        (self.infer)(inputs, attrs)
    }

    fn run_cpu(&self, inputs: &[Option<TensorView>], outputs: &[TensorView], attrs: &Attrs) -> Result<()> {
        (self.cpu)(inputs, outputs, attrs)
    }

    fn in_place_ok(&self) -> bool {
        self.in_place_ok
    }
}

/// Declares an operator in a few lines; `build` refuses an incomplete declaration.
///
/// ```
/// use opbridge_ops::registry::OpBuilder;
/// use opbridge_ops::schema::Meta;
/// use opbridge_runtime::DType;
///
/// let op = OpBuilder::new("identity_shape", 1)
///     .doc("Returns an array of the input's shape (example).")
///     .input("x")
///     .dtypes(&[DType::F32])
///     .infer(|inputs, _| Ok(vec![inputs[0].clone().unwrap()]))
///     .cpu(|_, _, _| Ok(()))
///     .build()
///     .unwrap();
/// ```
#[must_use]
pub struct OpBuilder {
    schema: Schema,
    infer: Option<Box<InferFn>>,
    cast: Option<Box<CastFn>>,
    cpu: Option<Box<KernelFn>>,
    in_place_ok: bool,
}

impl fmt::Debug for OpBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpBuilder({} v{})", self.schema.name, self.schema.version)
    }
}

impl OpBuilder {
    pub fn new(name: &str, version: u32) -> OpBuilder {
        OpBuilder {
            schema: Schema {
                name: name.to_string(),
                version,
                doc: String::new(),
                inputs: Vec::new(),
                outputs: Vec::new(),
                attrs: Vec::new(),
                dtypes: DType::ALL.to_vec(),
            },
            infer: None,
            cast: None,
            cpu: None,
            in_place_ok: false,
        }
    }

    pub fn doc(mut self, doc: &str) -> Self {
        self.schema.doc = doc.trim().to_string();
        self
    }

    pub fn input(mut self, name: &str) -> Self {
        self.schema.inputs.push(InputSpec { name: name.into(), optional: false });
        self
    }

    pub fn optional_input(mut self, name: &str) -> Self {
        self.schema.inputs.push(InputSpec { name: name.into(), optional: true });
        self
    }

    pub fn output(mut self, name: &str) -> Self {
        self.schema.outputs.push(name.into());
        self
    }

    /// An attribute; `default: None` makes it required.
    pub fn attr(mut self, name: &str, default: Option<AttrValue>, doc: &str) -> Self {
        self.schema.attrs.push(AttrSpec { name: name.into(), default, doc: doc.into() });
        self
    }

    pub fn dtypes(mut self, dtypes: &[DType]) -> Self {
        self.schema.dtypes = dtypes.to_vec();
        self
    }

    pub fn infer(mut self, f: impl Fn(&[Option<Meta>], &Attrs) -> Result<Vec<Meta>> + Send + Sync + 'static) -> Self {
        self.infer = Some(Box::new(f));
        self
    }

    pub fn cast(
        mut self,
        f: impl Fn(&[Option<Meta>], &Attrs) -> Result<Vec<Option<DType>>> + Send + Sync + 'static,
    ) -> Self {
        self.cast = Some(Box::new(f));
        self
    }

    pub fn cpu(
        mut self,
        f: impl Fn(&[Option<TensorView>], &[TensorView], &Attrs) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.cpu = Some(Box::new(f));
        self
    }

    pub fn in_place_ok(mut self) -> Self {
        self.in_place_ok = true;
        self
    }

    pub fn build(mut self) -> Result<OpDef> {
        let name = self.schema.name.clone();
        let invalid = |message: &str| OpError::InvalidOperator { name: name.clone(), message: message.into() };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(invalid("names are ASCII letters, digits and '_'"));
        }
        if self.schema.version == 0 {
            return Err(invalid("versions start at 1"));
        }
        if self.schema.outputs.is_empty() {
            self.schema.outputs.push("out".into());
        }
        Ok(OpDef {
            infer: self.infer.ok_or_else(|| invalid("no shape function (infer)"))?,
            cpu: self.cpu.ok_or_else(|| invalid("no CPU kernel"))?,
            cast: self.cast,
            in_place_ok: self.in_place_ok,
            schema: self.schema,
        })
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
    /// Calls in flight, and whether an unload waits for them to end.
    in_flight: Mutex<InFlight>,
    idle: Condvar,
}

#[derive(Debug, Default)]
struct InFlight {
    calls: usize,
    waiters: usize,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Entry({} v{}, {})", self.op.schema().name, self.op.schema().version, self.source)
    }
}

impl Entry {
    pub fn schema(&self) -> &Schema {
        self.op.schema()
    }

    /// Marks a call in flight until the guard drops (async calls move it into the kernel).
    pub fn enter(self: &Arc<Self>) -> CallGuard {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).calls += 1;
        CallGuard(Arc::clone(self))
    }

    /// Blocks until no call of this operator is in flight.
    pub fn wait_idle(&self) {
        let mut state = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        state.waiters += 1;
        while state.calls > 0 {
            state = self.idle.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.waiters -= 1;
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
        let mut state = self.0.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        state.calls -= 1;
        // Waking costs a system call: only when an unload is actually waiting.
        if state.calls == 0 && state.waiters > 0 {
            self.0.idle.notify_all();
        }
    }
}

/// What `list_ops` reports for one operator name.
#[derive(Debug, Clone, PartialEq)]
pub struct OpInfo {
    pub name: String,
    /// (version, source, dtypes, devices), oldest first.
    pub versions: Vec<(u32, Source, Vec<DType>, Vec<DeviceKind>)>,
}

/// Operators by name, then version.
#[derive(Default)]
pub struct Registry {
    ops: RwLock<BTreeMap<String, BTreeMap<u32, Arc<Entry>>>>,
    /// Bumped by every register/unregister, so callers can cache lookups.
    generation: std::sync::atomic::AtomicU64,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registry({} operators)", self.read().len())
    }
}

impl Registry {
    /// The process-wide registry, with the built-in operators.
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let registry = Registry::default();
            crate::builtins::register_all(&registry).expect("built-in operators are valid and distinct");
            registry
        })
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
        let entry = Arc::new(Entry { op, source, in_flight: Mutex::new(InFlight::default()), idle: Condvar::new() });
        versions.insert(version, Arc::clone(&entry));
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn list(&self) -> Vec<OpInfo> {
        self.read()
            .iter()
            .map(|(name, versions)| OpInfo {
                name: name.clone(),
                versions: versions
                    .iter()
                    .map(|(&v, e)| (v, e.source.clone(), e.schema().dtypes.clone(), e.op.devices()))
                    .collect(),
            })
            .collect()
    }
}
