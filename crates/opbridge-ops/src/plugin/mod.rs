//! Operator libraries: shared objects that declare operators through the C ABI of
//! `python/opbridge/include/opbridge/plugin.h`, loaded, listed and unloaded at run time.
//!
//! Three layers, as for every FFI in opbridge: [`sys`] declares the ABI, `result` turns status
//! codes into errors and raw descriptors into validated copies, and this module is the safe API:
//! [`Library::load_into`] registers a library's operators in the [`Registry`] (all or none), and
//! [`Library::unload`] unregisters them, waits for calls in flight, and closes the library.
//!
//! Each load opens a private copy of the file (dlopen caches by path, so a rebuilt file at the
//! same path would otherwise come back as the old code). Dropping a [`Library`] without
//! unloading leaves its operators registered for the rest of the process.
#![allow(unsafe_code)] // calls into the loaded library; every call site says why it holds.

pub(crate) mod result;
pub mod sys;

use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use opbridge_dtype::DType;

use opbridge_runtime::DeviceKind;

use crate::device::{DeviceCall, DeviceKernel};
use crate::error::{OpError, Result};
use crate::memo::Memo;
use crate::registry::{Entry, Operator, Registry, Source};
use crate::schema::{AttrValue, Attrs, Meta, Schema};
use crate::view::TensorView;

const RUNTIME_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The open library shared by its operators. `None` once unloaded: a call through an operator
/// looked up before the unload then fails cleanly instead of jumping into unmapped code.
struct Handle {
    path: PathBuf,
    lib: RwLock<Option<libloading::Library>>,
    /// Set when the library is closed: checked before a memo answers for it, so a call after
    /// the unload fails at the call (not only when its kernel runs).
    closed: AtomicBool,
    /// The library's release callback (ABI 3), run once before it is closed.
    release: Option<sys::OpbReleaseFn>,
    released: AtomicBool,
}

impl Drop for Handle {
    /// A library closed without an unload (a failed load, its registry gone): released too.
    fn drop(&mut self) {
        let lib = self.lib.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(lib) = lib {
            self.release_once();
            drop(lib);
        }
    }
}

impl Handle {
    fn unloaded(&self, schema: &Schema) -> OpError {
        OpError::Unloaded { name: schema.name.clone(), version: schema.version, path: self.path.display().to_string() }
    }

    /// Fails once the library is closed (no lock: what every entry into an operator checks
    /// first, remembered results included).
    fn check_open(&self, schema: &Schema) -> Result<()> {
        match self.closed.load(Ordering::Acquire) {
            true => Err(self.unloaded(schema)),
            false => Ok(()),
        }
    }

    /// The library, kept open (and its code mapped) while the guard lives.
    fn live(&self, schema: &Schema) -> Result<RwLockReadGuard<'_, Option<libloading::Library>>> {
        let guard = self.lib.read().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            return Err(self.unloaded(schema));
        }
        Ok(guard)
    }

    /// Closes the library once no callback runs (the write lock waits for them).
    fn close(&self) -> Result<()> {
        let lib = {
            let mut lib = self.lib.write().unwrap_or_else(|p| p.into_inner());
            self.closed.store(true, Ordering::Release);
            lib.take()
        };
        let Some(lib) = lib else { return Ok(()) };
        self.release_once();
        lib.close().map_err(|e| plugin_error(&self.path, format!("closing failed: {e}")))
    }

    /// Calls the library's release callback, once. The library must still be open, and no call
    /// of its operators running or queued (an unload waited for them; a failed load made none).
    fn release_once(&self) {
        if let Some(release) = self.release {
            if !self.released.swap(true, Ordering::SeqCst) {
                // SAFETY: the library is open (the caller's obligation: its mapping is dropped
                // only after this returns).
                unsafe { release() };
            }
        }
    }
}

/// Per-call lists (attribute values, metas, DLTensors, extents): inline for the usual sizes, so
/// a plugin call allocates no more than a built-in one.
type Inline<T, const N: usize> = smallvec::SmallVec<[T; N]>;

fn plugin_error(path: &Path, message: impl Into<String>) -> OpError {
    OpError::Plugin { path: path.display().to_string(), message: message.into() }
}

/// An operator library loaded into the process, with the operators it registered.
pub struct Library {
    path: PathBuf,
    /// The ABI version the library was built for (2 or 3).
    abi: u32,
    name: Option<String>,
    entries: Vec<Arc<Entry>>,
    handle: Arc<Handle>,
    registry: Arc<Registry>,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library").field("path", &self.path).field("ops", &self.ops()).finish()
    }
}

impl Library {
    /// Loads the library at `path` and registers its operators in `registry`.
    ///
    /// Errors (and nothing stays registered or open): the file is missing or not a shared
    /// library, it does not export `opbridge_plugin_init`, it speaks another ABI version, a
    /// descriptor is malformed, or a name + version is registered already.
    /// The library holds the registry (`Arc`) until it is unloaded.
    pub fn load_into(registry: Arc<Registry>, path: impl AsRef<Path>) -> Result<Library> {
        let path = std::path::absolute(path.as_ref()).unwrap_or_else(|_| path.as_ref().to_path_buf());
        let _span = opbridge_runtime::profiler::span("plugin", "plugin load", || {
            vec![("path", path.display().to_string().into())]
        });
        if !path.exists() {
            return Err(plugin_error(&path, "no such file"));
        }
        if !path.is_file() {
            return Err(plugin_error(&path, "not a file"));
        }
        let lib = open_private_copy(&path)?;
        // SAFETY: the symbol is declared by the ABI with this signature; a library that exports
        // the name with another type breaks the ABI's contract, which loading it accepts.
        let init: sys::OpbPluginInitFn = match unsafe { lib.get::<sys::OpbPluginInitFn>(sys::OPB_PLUGIN_INIT_SYMBOL) } {
            Ok(symbol) => *symbol,
            Err(_) => {
                return Err(plugin_error(
                    &path,
                    "does not export `opbridge_plugin_init` (not an opbridge operator library)",
                ))
            }
        };
        // The newest ABI first; a library built for an older one that this loader still speaks
        // answers with its version (touching nothing else) and is initialized again as such.
        let mut abi = sys::OPBRIDGE_PLUGIN_ABI_VERSION;
        let (status, info) = loop {
            let host = sys::OpbPluginHost {
                abi_version: abi,
                reserved0: 0,
                runtime_version: RUNTIME_VERSION.as_ptr().cast(),
                reserved: [std::ptr::null_mut(); 4],
            };
            let mut info = sys::OpbPluginInfo::zeroed();
            // SAFETY: `host` and `info` are valid for the call; the library is open.
            let status = unsafe { init(&host, &mut info) };
            let theirs = info.abi_version;
            if theirs != abi && theirs < abi && theirs >= sys::OPBRIDGE_PLUGIN_ABI_OLDEST {
                abi = theirs;
                continue;
            }
            if theirs != abi && abi != sys::OPBRIDGE_PLUGIN_ABI_VERSION {
                return Err(plugin_error(
                    &path,
                    format!(
                        "ABI version mismatch: the library answered ABI {abi} to an ABI {} host, then ABI {theirs} \
                         to an ABI {abi} host (rebuild it against opbridge.get_include())",
                        sys::OPBRIDGE_PLUGIN_ABI_VERSION
                    ),
                ));
            }
            if theirs != abi {
                return Err(plugin_error(
                    &path,
                    format!(
                        "ABI version mismatch: the library was built for plugin ABI {theirs}, this opbridge loads ABI {} \
                         to {} (rebuild it against opbridge.get_include())",
                        sys::OPBRIDGE_PLUGIN_ABI_OLDEST,
                        sys::OPBRIDGE_PLUGIN_ABI_VERSION
                    ),
                ));
            }
            break (status, info);
        };
        if status != sys::OPB_OK {
            // SAFETY: a library of an ABI version we speak sets `error` to NULL or a C string.
            let why = unsafe { result::init_error(info.error) }.unwrap_or_else(|| "no message".into());
            return Err(plugin_error(&path, format!("opbridge_plugin_init failed with status {status}: {why}")));
        }
        // ABI 2 had `reserved` where ABI 3 has `release` (NULL in a valid version 2 library).
        let release = if abi >= 3 { info.release } else { None };
        // From here the library is initialized: however the load ends, the handle calls its
        // release callback once before closing it (see `Drop for Handle`).
        let handle = Arc::new(Handle {
            path: path.clone(),
            lib: RwLock::new(Some(lib)),
            closed: AtomicBool::new(false),
            release,
            released: AtomicBool::new(false),
        });
        // SAFETY: as above, `name` is NULL or a C string.
        let name = unsafe { result::library_name(info.name) };
        let n_ops =
            usize::try_from(info.n_ops).ok().filter(|&n| (1..=sys::OPB_MAX_OPS as usize).contains(&n)).ok_or_else(
                || plugin_error(&path, format!("n_ops is {}; expected 1 to {}", info.n_ops, sys::OPB_MAX_OPS)),
            )?;
        if info.ops.is_null() {
            return Err(plugin_error(&path, format!("ops is NULL but n_ops is {n_ops}")));
        }
        // SAFETY: the library declares `n_ops` descriptors at `ops`, valid while it is open.
        let descs = unsafe { std::slice::from_raw_parts(info.ops, n_ops) };
        let mut specs: Vec<result::OpSpec> = Vec::with_capacity(n_ops);
        for (i, desc) in descs.iter().enumerate() {
            // SAFETY: the descriptor's pointers follow the header's rules (reads are bounded).
            let spec = unsafe { result::validate(desc, abi) }
                .map_err(|message| plugin_error(&path, format!("malformed descriptor ops[{i}]: {message}")))?;
            if specs.iter().any(|s| s.schema.name == spec.schema.name && s.schema.version == spec.schema.version) {
                return Err(plugin_error(
                    &path,
                    format!("declares operator {:?} version {} twice", spec.schema.name, spec.schema.version),
                ));
            }
            specs.push(spec);
        }

        let mut library = Library {
            path: path.clone(),
            abi,
            name,
            entries: Vec::new(),
            handle: Arc::clone(&handle),
            registry: Arc::clone(&registry),
        };
        for spec in specs {
            let op = PluginOp::new(spec, Arc::clone(&handle));
            match registry.register(Arc::new(op), Source::Library(path.clone())) {
                Ok(entry) => library.entries.push(entry),
                Err(error) => {
                    // All or nothing: take back what this load registered (another thread may
                    // have started calls already), then close.
                    let _ = library.unload();
                    return Err(match error {
                        OpError::DuplicateOperator { name, version, existing } => plugin_error(
                            &path,
                            format!("operator {name:?} version {version} is already registered (from {existing})"),
                        ),
                        other => other,
                    });
                }
            }
        }
        Ok(library)
    }

    /// The file this library was loaded from (absolute).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The plugin ABI version the library was built for (2: CPU kernels only).
    pub fn abi_version(&self) -> u32 {
        self.abi
    }

    /// The name the library gave itself, if any.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// (name, version) of each operator it registered, in declaration order.
    pub fn ops(&self) -> Vec<(String, u32)> {
        self.entries.iter().map(|e| (e.schema().name.clone(), e.schema().version)).collect()
    }

    /// Unregisters the library's operators (new lookups fail at once), waits for the calls in
    /// flight, then closes the library. A call through an operator looked up before the unload
    /// fails with [`OpError::Unloaded`]. Blocks: release the GIL around it.
    pub fn unload(self) -> Result<()> {
        let _span = opbridge_runtime::profiler::span("plugin", "plugin unload", || {
            vec![("path", self.path.display().to_string().into())]
        });
        for entry in &self.entries {
            let schema = entry.schema();
            if let Ok(current) = self.registry.get(&schema.name, Some(schema.version)) {
                if Arc::ptr_eq(&current, entry) {
                    self.registry.unregister(&schema.name, schema.version);
                }
            }
        }
        for entry in &self.entries {
            // From stream work, a call queued behind it fails the unload: the operators stay
            // unregistered and the library is closed when the last of its calls has run.
            entry.wait_idle()?;
        }
        self.handle.close()
    }
}

/// Checks that an ELF file holds everything its headers point to (the program headers, each
/// loadable segment's bytes, the section headers). Files that are not ELF pass: the loader
/// refuses them cleanly.
fn elf_fits(bytes: &[u8]) -> std::result::Result<(), String> {
    if bytes.len() < 4 || &bytes[..4] != b"\x7fELF" {
        return Ok(());
    }
    let truncated = |what: &str| Err(format!("truncated ELF file ({} bytes): {what} lies past its end", bytes.len()));
    let (class, little) = match (bytes.get(4), bytes.get(5)) {
        (Some(&c @ (1 | 2)), Some(&d @ (1 | 2))) => (c, d == 1),
        _ => return Err("malformed ELF identification".into()),
    };
    let wide = class == 2;
    let field = |at: usize, len: usize| -> Option<u64> {
        let raw = bytes.get(at..at.checked_add(len)?)?;
        let mut v = 0u64;
        for i in 0..len {
            let b = if little { raw[len - 1 - i] } else { raw[i] };
            v = (v << 8) | u64::from(b);
        }
        Some(v)
    };
    let word = if wide { 8 } else { 4 };
    let header_len = if wide { 64 } else { 52 };
    if bytes.len() < header_len {
        return truncated("the ELF header");
    }
    let get = |at: usize, len: usize| field(at, len).ok_or_else(|| "malformed ELF header".to_string());
    let (phoff, shoff) = (get(0x18 + word, word)?, get(0x18 + 2 * word, word)?);
    let at = 0x18 + 3 * word + 4; // after e_flags
    let (phentsize, phnum) = (get(at + 2, 2)?, get(at + 4, 2)?);
    let (shentsize, shnum) = (get(at + 6, 2)?, get(at + 8, 2)?);
    let len = bytes.len() as u64;
    let end = |off: u64, size: u64| off.checked_add(size).filter(|&e| e <= len);
    if phnum > 0 && end(phoff, phentsize.saturating_mul(phnum)).is_none() {
        return truncated("the program header table");
    }
    if shoff != 0 && shnum > 0 && end(shoff, shentsize.saturating_mul(shnum)).is_none() {
        return truncated("the section header table");
    }
    for i in 0..phnum {
        let ph = (phoff + i * phentsize) as usize;
        const PT_LOAD: u64 = 1;
        if get(ph, 4)? != PT_LOAD {
            continue;
        }
        // p_offset and p_filesz: (8, 32) in ELF64, (4, 16) in ELF32.
        let (offset, filesz) =
            if wide { (get(ph + 8, 8)?, get(ph + 32, 8)?) } else { (get(ph + 4, 4)?, get(ph + 16, 4)?) };
        if end(offset, filesz).is_none() {
            return truncated("a loadable segment");
        }
    }
    Ok(())
}

/// Copies the file to a private name and opens that copy, so that every load maps the file's
/// current contents. On Unix the copy is deleted as soon as it is open (the mapping keeps it).
fn open_private_copy(path: &Path) -> Result<libloading::Library> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join("opbridge-plugins");
    std::fs::create_dir_all(&dir).map_err(|e| plugin_error(path, format!("cannot create {}: {e}", dir.display())))?;
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "plugin".into());
    let ext = path.extension().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "so".into());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let copy = dir.join(format!("{stem}-{}-{}-{nanos}.{ext}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    std::fs::copy(path, &copy).map_err(|e| plugin_error(path, format!("cannot copy to {}: {e}", copy.display())))?;
    // The dynamic loader maps segments without checking that the file holds them: a truncated
    // library faults (SIGBUS) inside dlopen. Refuse one whose ELF headers point past its end.
    let opened = match std::fs::read(&copy).map_err(|e| e.to_string()).and_then(|bytes| elf_fits(&bytes)) {
        Ok(()) => open(&copy),
        Err(why) => {
            let _ = std::fs::remove_file(&copy);
            return Err(plugin_error(path, format!("not a loadable shared library: {why}")));
        }
    };
    #[cfg(unix)]
    let _ = std::fs::remove_file(&copy);
    #[cfg(not(unix))]
    if opened.is_err() {
        let _ = std::fs::remove_file(&copy);
    }
    opened.map_err(|e| {
        // libloading's text is "dlopen failed"; its source holds dlerror() (the missing symbol).
        let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
        plugin_error(path, format!("not a loadable shared library: {why}"))
    })
}

#[cfg(unix)]
fn open(path: &Path) -> Result<libloading::Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading runs the library's initializers; accepting that is what loading a plugin
    // means. RTLD_NOW makes unresolved symbols an error here rather than a crash later.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Into::into)
}

#[cfg(not(unix))]
fn open(path: &Path) -> Result<libloading::Library, libloading::Error> {
    // SAFETY: as above.
    unsafe { libloading::Library::new(path) }
}

/// Attribute names as C pointers into the owning `OpSpec`'s `CString`s.
struct NamePtrs(Vec<*const c_char>);

// SAFETY: the pointers point into `CString`s owned by the same `PluginOp`, never written after
// construction; sharing them between threads shares only immutable bytes.
unsafe impl Send for NamePtrs {}
// SAFETY: as for `Send`.
unsafe impl Sync for NamePtrs {}

/// An operator of a loaded library: [`Operator`] by calling its C callbacks.
struct PluginOp {
    spec: result::OpSpec,
    names: NamePtrs,
    handle: Arc<Handle>,
    /// The last successful shape-function call. Shape functions are pure (plugin.h), and a
    /// loop calls an operator with one signature over and over: a repeat skips the C call and
    /// the conversions around it.
    memo: Mutex<Option<Memo<Vec<Meta>>>>,
    /// The last input-dtype call (as pure as the shape function).
    dtypes_memo: Mutex<Option<Memo<Vec<Option<DType>>>>>,
}

/// A call's attribute values in the C layout, in descriptor order, with the NUL-terminated
/// copies of its strings. Lists point into the host's [`Attrs`] (borrowed for `'a`).
struct CAttrs<'a> {
    values: Inline<sys::OpbAttrValue, 8>,
    /// What the `s` pointers of `values` point at (a `CString`'s bytes stay put when it moves).
    _strings: Inline<CString, 2>,
    _attrs: PhantomData<&'a Attrs>,
}

/// The `OpbMeta` of an optional input the caller left out.
fn absent_meta() -> sys::OpbMeta {
    sys::OpbMeta { ndim: sys::OPB_ABSENT, ..Default::default() }
}

impl PluginOp {
    fn new(spec: result::OpSpec, handle: Arc<Handle>) -> PluginOp {
        let names = NamePtrs(spec.attr_names.iter().map(|c| c.as_ptr()).collect());
        PluginOp { spec, names, handle, memo: Mutex::new(None), dtypes_memo: Mutex::new(None) }
    }

    fn name(&self) -> &str {
        &self.spec.schema.name
    }

    /// The call's attribute values in the C layout, in descriptor order, after checking them
    /// against the declared kinds (the library never sees a value of another kind).
    fn c_attrs<'a>(&self, attrs: &'a Attrs) -> Result<CAttrs<'a>> {
        let mut values = Inline::new();
        let mut strings = Inline::new();
        for (i, (spec, &kind)) in self.spec.schema.attrs.iter().zip(&self.spec.attr_kinds).enumerate() {
            let mut value = sys::OpbAttrValue { kind, ..Default::default() };
            let given = attrs.get(&spec.name).unwrap_or(&AttrValue::None);
            // Checked as it is converted: what the library reads must fit `kind`.
            self.spec.check_attr(i, given)?;
            match given {
                AttrValue::None => value.is_none = 1,
                AttrValue::Bool(b) => value.i = i64::from(*b),
                AttrValue::Int(i) if kind == sys::OPB_ATTR_FLOAT => value.f = *i as f64,
                AttrValue::Int(i) => value.i = *i,
                AttrValue::Float(x) => value.f = *x,
                AttrValue::Str(s) => {
                    let text = CString::new(s.as_str()).map_err(|_| OpError::InvalidAttribute {
                        op: self.name().into(),
                        message: format!("{} contains a NUL character, which C strings cannot hold", spec.name),
                    })?;
                    value.s = text.as_ptr();
                    strings.push(text);
                }
                AttrValue::Ints(list) => {
                    value.ints = list.as_ptr();
                    value.n_ints = list.len() as i64;
                }
            }
            values.push(value);
        }
        Ok(CAttrs { values, _strings: strings, _attrs: PhantomData })
    }

    fn attrs_struct(&self, values: &CAttrs<'_>) -> sys::OpbAttrs {
        sys::OpbAttrs { count: values.values.len(), values: values.values.as_ptr(), names: self.names.0.as_ptr() }
    }

    fn wrong_input_count(&self, got: usize) -> OpError {
        OpError::Kernel {
            op: self.name().into(),
            message: format!("takes {} inputs, got {got}", self.spec.schema.inputs.len()),
        }
    }

    /// A call on a device the operator has no kernel for: the devices it has.
    fn no_kernel_on(&self, kind: DeviceKind) -> OpError {
        let names: Vec<&str> = Operator::devices(self).iter().map(|d| d.name()).collect();
        OpError::Device {
            op: self.name().into(),
            message: format!(
                "no {} kernel for {} v{} (from {}); it has kernels for: {}",
                kind.name(),
                self.name(),
                self.spec.schema.version,
                self.handle.path.display(),
                names.join(", ")
            ),
        }
    }

    fn missing_input(&self, input: &str) -> OpError {
        OpError::Argument { op: self.name().into(), message: format!("input {input:?} is required") }
    }

    /// The inputs as the shape function sees them: their dtypes checked against the
    /// descriptor's, an optional input left out as an `OPB_ABSENT` meta.
    fn metas(&self, inputs: &[Option<Meta>]) -> Result<Inline<sys::OpbMeta, 4>> {
        let schema = &self.spec.schema;
        if inputs.len() != schema.inputs.len() {
            return Err(self.wrong_input_count(inputs.len()));
        }
        let mut metas = Inline::new();
        for (spec, input) in schema.inputs.iter().zip(inputs) {
            let Some(input) = input else {
                if !spec.optional {
                    return Err(self.missing_input(&spec.name));
                }
                metas.push(absent_meta());
                continue;
            };
            if !schema.dtypes.contains(&input.dtype) {
                let names: Vec<&str> = schema.dtypes.iter().map(|d| d.name()).collect();
                return Err(OpError::DType {
                    op: self.name().into(),
                    expected: format!("{} of dtype {}", spec.name, names.join(", ")),
                    got: input.dtype.to_string(),
                });
            }
            metas.push(meta_to_c(self.name(), &spec.name, input.dtype, &input.shape)?);
        }
        Ok(metas)
    }
}

fn meta_to_c(op: &str, input: &str, dtype: DType, shape: &[usize]) -> Result<sys::OpbMeta> {
    if shape.len() > sys::OPB_MAX_NDIM {
        return Err(OpError::Shape {
            op: op.into(),
            expected: format!("{input} with at most {} dimensions", sys::OPB_MAX_NDIM),
            got: format!("shape {shape:?}"),
        });
    }
    let mut meta = sys::OpbMeta { dtype: dtype.to_dl(), ndim: shape.len() as i32, shape: [0; sys::OPB_MAX_NDIM] };
    for (d, &s) in meta.shape.iter_mut().zip(shape) {
        *d = s as i64;
    }
    Ok(meta)
}

impl fmt::Debug for PluginOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PluginOp({} v{} from {})", self.name(), self.spec.schema.version, self.handle.path.display())
    }
}

impl Operator for PluginOp {
    fn schema(&self) -> &Schema {
        &self.spec.schema
    }

    fn input_dtypes(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Option<DType>>> {
        // Before the memo: a remembered answer must not outlive the library.
        self.handle.check_open(&self.spec.schema)?;
        match self.spec.input_dtypes {
            None => Ok(inputs.iter().map(|m| m.as_ref().map(|m| m.dtype)).collect()),
            Some(choose) => {
                Memo::through(&self.dtypes_memo, inputs, attrs, || self.call_input_dtypes(choose, inputs, attrs))
            }
        }
    }

    fn infer(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Meta>> {
        // Before the memo: a remembered answer must not outlive the library.
        self.handle.check_open(&self.spec.schema)?;
        // `call_infer` checks the attribute values; a remembered call had equal ones.
        Memo::through(&self.memo, inputs, attrs, || self.call_infer(inputs, attrs))
    }

    fn needs_workspace(&self) -> bool {
        self.spec.workspace.is_some()
    }

    fn workspace_size(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<usize> {
        let schema = &self.spec.schema;
        self.handle.check_open(schema)?;
        let Some(size_fn) = self.spec.workspace else { return Ok(0) };
        let metas: Inline<sys::OpbMeta, 4> = inputs
            .iter()
            .zip(&schema.inputs)
            .map(|(m, spec)| match m {
                Some(m) => meta_to_c(self.name(), &spec.name, m.dtype, &m.shape),
                None => Ok(absent_meta()),
            })
            .collect::<Result<_>>()?;
        let values = self.c_attrs(attrs)?;
        let c_attrs = self.attrs_struct(&values);
        let _open = self.handle.live(schema)?;
        // SAFETY: the library is open while `_open` lives; pointers valid for the call.
        Ok(unsafe { size_fn(metas.as_ptr(), metas.len() as c_int, &c_attrs) })
    }

    fn run_cpu_in(
        &self,
        inputs: &[Option<TensorView>],
        outputs: &[TensorView],
        attrs: &Attrs,
        workspace: &mut [u8],
    ) -> Result<()> {
        let Some(kernel) = self.spec.kernel else { return Err(self.no_kernel_on(DeviceKind::Cpu)) };
        let ws =
            (if workspace.is_empty() { std::ptr::null_mut() } else { workspace.as_mut_ptr().cast() }, workspace.len());
        let cpu = sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 };
        self.call_kernel(kernel, cpu, inputs, outputs, attrs, std::ptr::null_mut(), ws)
    }

    fn in_place_ok(&self) -> bool {
        self.spec.in_place_ok
    }

    fn devices(&self) -> Vec<DeviceKind> {
        let cpu = self.spec.kernel.map(|_| DeviceKind::Cpu);
        cpu.into_iter().chain(self.spec.device_kernels.iter().map(|(kind, _)| *kind)).collect()
    }

    fn device_kernel(&self, kind: DeviceKind) -> Option<&dyn DeviceKernel> {
        self.spec.device_kernels.iter().any(|(k, _)| *k == kind).then_some(self as &dyn DeviceKernel)
    }
}

/// The library's device kernels (ABI 3): the call's tensors as DLTensors of the stream's device,
/// its native stream with the device current, and a workspace from the call's allocator.
impl DeviceKernel for PluginOp {
    fn enqueue(&self, call: &DeviceCall<'_>) -> opbridge_runtime::Result<()> {
        self.enqueue_call(call).map_err(|e| match e {
            OpError::Runtime(e) => e,
            other => opbridge_runtime::Error::Device { device: call.stream.device(), message: other.to_string() },
        })
    }

    fn enqueue_call(&self, call: &DeviceCall<'_>) -> Result<()> {
        let device = call.stream.device();
        let kernel = self.spec.device_kernels.iter().find(|(k, _)| *k == device.kind).map(|(_, f)| *f);
        let kernel = kernel.ok_or_else(|| self.no_kernel_on(device.kind))?;
        let inputs: Inline<Option<TensorView>, 4> = call.inputs.iter().map(|t| t.map(TensorView::of_tensor)).collect();
        let outputs: Inline<TensorView, 2> = call.outputs.iter().map(|t| TensorView::of_tensor(t)).collect();
        let workspace = match self.needs_workspace() {
            false => None,
            true => {
                let metas: Inline<Option<Meta>, 4> =
                    inputs.iter().map(|v| v.as_ref().map(|v| Meta::new(v.dtype, &v.shape))).collect();
                match self.workspace_size(&metas, call.attrs)? {
                    0 => None,
                    // Stream-ordered: freed when this returns, reused only after the work.
                    bytes => Some(call.alloc.allocate(bytes, call.stream.id())?),
                }
            }
        };
        let ws = workspace.as_ref().map_or((std::ptr::null_mut(), 0), |b| (b.ptr().0 as *mut c_void, b.len()));
        call.stream.bind_current()?;
        let on = sys::DLDevice { device_type: device.kind.dlpack_code(), device_id: device.index as i32 };
        self.call_kernel(kernel, on, &inputs, &outputs, call.attrs, call.stream.native_handle(), ws)
    }
}

impl PluginOp {
    /// The library's input-dtype callback: the dtype each present input is converted to.
    fn call_input_dtypes(
        &self,
        choose: sys::OpbInputDtypesFn,
        inputs: &[Option<Meta>],
        attrs: &Attrs,
    ) -> Result<Vec<Option<DType>>> {
        let values = self.c_attrs(attrs)?;
        let c_attrs = self.attrs_struct(&values);
        let metas = self.metas(inputs)?;
        // Prefilled with the inputs' own dtypes (zeroed for absent ones), as plugin.h promises.
        let mut dtypes: Inline<sys::DLDataType, 4> =
            inputs.iter().map(|m| m.as_ref().map_or_else(Default::default, |m| m.dtype.to_dl())).collect();
        let mut err = [0u8; result::ERR_LEN];
        let status = {
            let _open = self.handle.live(&self.spec.schema)?;
            // SAFETY: the library is open while `_open` lives; `metas` and `dtypes` both hold
            // one entry per input, the attribute struct points into `values` (alive), and `err`
            // has `ERR_LEN` bytes.
            unsafe {
                choose(
                    metas.as_ptr(),
                    metas.len() as c_int,
                    dtypes.as_mut_ptr(),
                    &c_attrs,
                    err.as_mut_ptr().cast(),
                    err.len(),
                )
            }
        };
        err[result::ERR_LEN - 1] = 0;
        result::check(self.name(), status, &err)?;
        let schema = &self.spec.schema;
        let chosen: Vec<Option<DType>> = inputs
            .iter()
            .zip(&dtypes)
            .zip(&schema.inputs)
            .map(|((input, &t), spec)| match input {
                None => Ok(None),
                Some(_) => DType::from_dl(t).map(Some).ok_or_else(|| OpError::Kernel {
                    op: self.name().into(),
                    message: format!(
                        "input_dtypes chose an unknown dtype for input {:?} (code {}, bits {}, lanes {}); expected one \
                         of float16, float32, float64, int32, int64",
                        spec.name, t.code, t.bits, t.lanes
                    ),
                }),
            })
            .collect::<Result<_>>()?;
        self.spec.check_chosen_dtypes(inputs, &chosen)?;
        Ok(chosen)
    }

    /// The library's shape function on `inputs`, its outputs checked and converted.
    fn call_infer(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Meta>> {
        let values = self.c_attrs(attrs)?;
        let metas = self.metas(inputs)?;
        let c_attrs = self.attrs_struct(&values);
        let n_out = self.spec.schema.outputs.len();
        let mut outputs: Inline<sys::OpbMeta, 2> = smallvec::smallvec![sys::OpbMeta::default(); n_out];
        let mut err = [0u8; result::ERR_LEN];
        let status = {
            let _open = self.handle.live(&self.spec.schema)?;
            // SAFETY: the library is open while `_open` lives; every pointer is valid for the
            // call with the lengths passed (the attribute struct points into `values`, alive),
            // and `err` has `ERR_LEN` bytes.
            unsafe {
                (self.spec.infer)(
                    metas.as_ptr(),
                    metas.len() as c_int,
                    outputs.as_mut_ptr(),
                    n_out as c_int,
                    &c_attrs,
                    err.as_mut_ptr().cast(),
                    err.len(),
                )
            }
        };
        err[result::ERR_LEN - 1] = 0;
        result::check(self.name(), status, &err)?;
        let bad = |i: usize, what: String| OpError::Kernel {
            op: self.name().into(),
            message: format!("the shape function returned an invalid output {i}: {what}"),
        };
        let mut metas = Vec::with_capacity(n_out);
        for (i, m) in outputs.iter().enumerate() {
            let dtype = DType::from_dl(m.dtype).ok_or_else(|| {
                bad(i, format!("dtype code {} bits {} lanes {}", m.dtype.code, m.dtype.bits, m.dtype.lanes))
            })?;
            let ndim = usize::try_from(m.ndim)
                .ok()
                .filter(|&n| n <= sys::OPB_MAX_NDIM)
                .ok_or_else(|| bad(i, format!("ndim {}", m.ndim)))?;
            let extents = &m.shape[..ndim];
            if extents.iter().any(|&d| d < 0) {
                return Err(bad(i, format!("shape {extents:?}")));
            }
            metas.push(Meta { dtype, shape: extents.iter().map(|&d| d as usize).collect() });
        }
        Ok(metas)
    }

    /// One of the library's kernels over DLTensors describing the views, on `device` (the CPU,
    /// or the accelerator whose native `stream` it enqueues on). An optional input left out is
    /// a DLTensor with `ndim == OPB_ABSENT` and null data, shape and strides. `workspace` is
    /// (address, bytes), null and 0 when there is none.
    #[allow(clippy::too_many_arguments)]
    fn call_kernel(
        &self,
        kernel: sys::OpbKernelFn,
        device: sys::DLDevice,
        inputs: &[Option<TensorView>],
        outputs: &[TensorView],
        attrs: &Attrs,
        stream: *mut c_void,
        workspace: (*mut c_void, usize),
    ) -> Result<()> {
        let values = self.c_attrs(attrs)?;
        let c_attrs = self.attrs_struct(&values);
        let schema = &self.spec.schema;
        if inputs.len() != schema.inputs.len() {
            return Err(self.wrong_input_count(inputs.len()));
        }
        if let Some((spec, _)) = schema.inputs.iter().zip(inputs).find(|(spec, v)| v.is_none() && !spec.optional) {
            return Err(self.missing_input(&spec.name));
        }
        // Shapes and strides of all present tensors in one buffer, then DLTensors pointing into it.
        let present = || inputs.iter().flatten().chain(outputs);
        let dims: usize = present().map(TensorView::ndim).sum();
        let mut extents: Inline<i64, 64> = Inline::with_capacity(2 * dims);
        for v in present() {
            extents.extend(v.shape.iter().map(|&s| s as i64));
            extents.extend(v.strides.iter().map(|&s| s as i64));
        }
        let base = extents.as_mut_ptr();
        let mut at = 0usize;
        let mut dl = |v: &TensorView| {
            let n = v.ndim();
            // SAFETY: `at + 2n <= extents.len()`: the loop above laid out exactly these entries,
            // in the order this closure is called (present inputs, then outputs).
            let (shape, strides) = unsafe { (base.add(at), base.add(at + n)) };
            at += 2 * n;
            sys::DLTensor {
                data: v.data as *mut c_void,
                device,
                ndim: n as i32,
                dtype: v.dtype.to_dl(),
                shape,
                strides,
                byte_offset: 0,
            }
        };
        let c_inputs: Inline<sys::DLTensor, 4> = inputs
            .iter()
            .map(|v| match v {
                Some(v) => dl(v),
                None => sys::DLTensor {
                    data: std::ptr::null_mut(),
                    device,
                    ndim: sys::OPB_ABSENT,
                    dtype: sys::DLDataType::default(),
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
            })
            .collect();
        let mut c_outputs: Inline<sys::DLTensor, 2> = outputs.iter().map(dl).collect();
        let mut err = [0u8; result::ERR_LEN];

        let _open = self.handle.live(&self.spec.schema)?;
        // SAFETY: the library is open while `_open` lives. The views describe memory valid for
        // the kernel (the registry's contract; device memory for a device kernel, kept alive by
        // the launch until its work has run), the DLTensors' shape/stride pointers point into
        // `extents` (absent inputs' are null), alive until the call returns; the attribute struct
        // points into `values`, alive too; the workspace is the caller's (null, 0) or its
        // address and size, alive until the call returns (for a device, until its work has run).
        let status = unsafe {
            kernel(
                c_inputs.as_ptr(),
                c_inputs.len() as c_int,
                c_outputs.as_mut_ptr(),
                c_outputs.len() as c_int,
                &c_attrs,
                stream,
                workspace.0,
                workspace.1,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        drop(extents);
        err[result::ERR_LEN - 1] = 0;
        result::check(self.name(), status, &err)
    }
}

#[cfg(test)]
mod elf_tests {
    use super::elf_fits;

    #[test]
    fn a_truncated_elf_file_is_refused_and_a_whole_one_passes() {
        let whole = std::fs::read("/proc/self/exe").expect("the test binary");
        assert_eq!(elf_fits(&whole), Ok(()));
        for keep in [whole.len() / 2, whole.len() - 1, 100, 5] {
            let err = elf_fits(&whole[..keep]).expect_err("truncated");
            assert!(err.contains("truncated") || err.contains("malformed"), "{err}");
        }
        assert_eq!(elf_fits(b"not an elf file"), Ok(()), "left to the loader, which refuses it cleanly");
    }
}
