//! Triton's system shared-memory extension: clients register `/dev/shm` regions, then name
//! them in an input's or output's `shared_memory_*` parameters instead of sending bytes.
//!
//! - A region is mapped once, at registration ([`opbridge_shm::Mapping`]); a CPU model's kernel
//!   then reads its inputs and writes its outputs right there (no copy), when the offsets are
//!   aligned for the dtype; otherwise, or for other devices, the bytes are copied through
//!   pooled tensors.
//! - Regions belong to the caller that registered them (its `opbridge-session`): to any other
//!   caller they do not exist.
//! - The table holds `Arc<Region>`s and a request clones those it uses: unregistering frees the
//!   name at once, the mapping goes when the last request using it ends.
//! - A file truncated by its owner is refused before use (its size checked) and, when it
//!   happens during a call, caught by the SIGBUS guard: the request fails, the server goes on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use opbridge_ops::dispatch::{self, HostOutputs};
use opbridge_ops::TensorView;
use opbridge_runtime::{DType, DeviceContext, StreamId, Tensor};
use opbridge_shm::{Mapping, ShmError};
use serde_json::{json, Value};

use crate::error::{Code, Result, ServeError};
use crate::infer::{self, Checked, CheckedInput, Output, Param};
use crate::models::{truncate, ModelVersion, Times};
use crate::sessions::Lease;

/// The parameters naming a tensor's place in shared memory.
pub const TENSOR_PARAMS: [&str; 3] = ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"];

/// A registered region: `byte_size` bytes at `offset` of the file of `key`.
#[derive(Debug)]
pub struct Region {
    pub name: String,
    pub key: String,
    pub offset: usize,
    pub byte_size: usize,
    /// The file mapped from its start to `offset + byte_size`.
    mapping: Mapping,
}

impl Region {
    pub fn json(&self) -> Value {
        json!({"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size})
    }

    /// Refuses a region whose file was truncated (now, or during an earlier call).
    fn check(&self) -> Result<()> {
        self.mapping.check().map_err(|e| self.truncated(e))
    }

    fn truncated(&self, error: ShmError) -> ServeError {
        ServeError::invalid(format!(
            "shared memory region '{}' was truncated by its owner ({error}); unregister it and register it again",
            self.name
        ))
    }
}

/// A tensor's bytes in a region: `size` bytes at `offset` of the region.
#[derive(Debug, Clone)]
pub struct ShmSlice {
    pub region: Arc<Region>,
    pub offset: usize,
    pub size: usize,
}

impl ShmSlice {
    /// Offset of the slice in the mapping.
    fn at(&self) -> usize {
        self.region.offset + self.offset
    }

    fn addr(&self) -> usize {
        self.region.mapping.addr() + self.at()
    }

    fn aligned(&self, dtype: DType) -> bool {
        self.addr() % dtype.size() == 0
    }

    /// Whether the two slices share bytes of one file: compared by the file's identity and
    /// offsets in it, not by address, since two regions of one file are two mappings.
    fn overlaps(&self, other: &ShmSlice) -> bool {
        let (a, b) = (self.at(), other.at());
        self.region.mapping.identity() == other.region.mapping.identity()
            && self.size > 0
            && other.size > 0
            && a < b + other.size
            && b < a + self.size
    }

    /// The parameters an output written here is answered with (Triton's).
    pub fn params(&self) -> [(&'static str, Value); 3] {
        [
            ("shared_memory_region", json!(self.region.name)),
            ("shared_memory_offset", json!(self.offset)),
            ("shared_memory_byte_size", json!(self.size)),
        ]
    }
}

/// Each mapping keeps its file open (to see truncation before each use): the soft limit of
/// open files (often 1024) is raised to the hard one, so registered regions cannot starve the
/// listeners of sockets. Best effort.
fn raise_open_file_limit() {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let mut limit = getrlimit(Resource::Nofile);
        if limit.current < limit.maximum {
            limit.current = limit.maximum;
            if let Err(e) = setrlimit(Resource::Nofile, limit) {
                tracing::warn!("cannot raise the open-file limit for shared memory: {e}");
            }
        }
    }
}

/// The owner of the regions an inference request names: its `opbridge-session` header, else
/// its `session_id` parameter (the two name one session, as for its memory), else nobody.
/// Register, status and unregister calls carry no parameters: their owner is the header's.
pub fn owner_of<'a>(header: &'a [u8], params: &'a [(String, Param)]) -> Result<&'a [u8]> {
    let param = params.iter().find(|(k, _)| k == crate::sessions::SESSION_PARAM).map(|(_, v)| v);
    match (header, param) {
        (_, Some(other)) if !matches!(other, Param::Str(_)) => {
            Err(ServeError::invalid(format!("parameter 'session_id' must be a string, got {other}")))
        }
        ([], Some(Param::Str(id))) => Ok(id.as_bytes()),
        (header, _) => Ok(header),
    }
}

/// The longest region name and key taken (longer ones are refused, not stored and echoed).
const MAX_NAME_BYTES: usize = 255;

/// Regions one owner may have registered at once: one client cannot take every mapping of
/// the server ([`opbridge_shm::MAX_MAPPINGS`]) from the others.
pub const MAX_REGIONS_PER_OWNER: usize = opbridge_shm::MAX_MAPPINGS / 8;

/// Regions by owner (the `opbridge-session` value, empty without) and name.
type Table = BTreeMap<(Vec<u8>, String), Arc<Region>>;

/// The regions of every caller, by owner (the `opbridge-session` value, empty without) and name.
/// The default: shared memory disabled.
#[derive(Debug, Default)]
pub struct Regions {
    enabled: bool,
    table: Mutex<Table>,
}

impl Regions {
    /// Shared memory allowed (the SIGBUS guard installed first).
    pub fn allowed() -> std::result::Result<Regions, String> {
        opbridge_shm::install_sigbus_guard().map_err(|e| format!("--allow-shared-memory: {e}"))?;
        raise_open_file_limit();
        Ok(Regions { enabled: true, table: Mutex::default() })
    }

    fn table(&self) -> Result<std::sync::MutexGuard<'_, Table>> {
        if !self.enabled {
            return Err(ServeError::invalid(
                "system shared memory is disabled; start the server with --allow-shared-memory",
            ));
        }
        Ok(self.table.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Maps `byte_size` bytes at `offset` of `key`'s file as region `name` of `owner`.
    pub fn register(&self, owner: &[u8], name: &str, key: &str, offset: u64, byte_size: u64) -> Result<()> {
        // (An empty key is refused by the mapping, as a key that is no file name.)
        for (what, text, empty_ok) in [("name", name, false), ("key", key, true)] {
            if text.len() > MAX_NAME_BYTES || (text.is_empty() && !empty_ok) {
                return Err(ServeError::invalid(format!(
                    "shared memory region {what} '{}' must be 1 to {MAX_NAME_BYTES} bytes long (it is {})",
                    truncate(text, 64),
                    text.len()
                )));
            }
        }
        let mut table = self.table()?;
        if table.contains_key(&(owner.to_vec(), name.to_string())) {
            return Err(ServeError::new(
                Code::AlreadyExists,
                format!("shared memory region '{}' is already registered", truncate(name, 64)),
            ));
        }
        if table.keys().filter(|(o, _)| o == owner).count() >= MAX_REGIONS_PER_OWNER {
            return Err(ServeError::new(
                Code::QuotaExceeded,
                format!(
                    "too many shared memory regions registered by this caller (at most {MAX_REGIONS_PER_OWNER}); \
                     unregister some first"
                ),
            ));
        }
        let span = |n: u64| usize::try_from(n).ok();
        let (offset, byte_size) = match (span(offset), span(byte_size)) {
            (Some(o), Some(s)) if s > 0 && o.checked_add(s).is_some_and(|end| end <= isize::MAX as usize) => (o, s),
            _ => {
                return Err(ServeError::invalid(format!(
                    "shared memory region '{}': offset {offset} and byte_size {byte_size} are not a valid span \
                     (byte_size must be positive)",
                    truncate(name, 64)
                )))
            }
        };
        let mapping = Mapping::open(key, offset + byte_size).map_err(|e| match e {
            ShmError::Full | ShmError::Map { .. } => ServeError::unavailable(e.to_string()),
            ShmError::Unsupported => ServeError::new(Code::Unimplemented, e.to_string()),
            _ => ServeError::invalid(format!("shared memory region '{}': {e}", truncate(name, 64))),
        })?;
        let region = Region { name: name.into(), key: key.into(), offset, byte_size, mapping };
        table.insert((owner.to_vec(), name.into()), Arc::new(region));
        Ok(())
    }

    /// Unregisters `name`, or every region of `owner`. An unknown name is no error (Triton's).
    pub fn unregister(&self, owner: &[u8], name: Option<&str>) -> Result<()> {
        let mut table = self.table()?;
        match name {
            Some(name) => {
                table.remove(&(owner.to_vec(), name.to_string()));
            }
            None => table.retain(|(o, _), _| o != owner),
        }
        Ok(())
    }

    /// The status of `name` (404 when `owner` has no such region), or of all of `owner`'s.
    pub fn status(&self, owner: &[u8], name: Option<&str>) -> Result<Vec<Arc<Region>>> {
        let table = self.table()?;
        let mine = table.iter().filter(|((o, n), _)| o == owner && name.is_none_or(|name| name == n));
        let regions: Vec<Arc<Region>> = mine.map(|(_, region)| Arc::clone(region)).collect();
        if let (Some(name), true) = (name, regions.is_empty()) {
            return Err(ServeError::not_found(format!(
                "unable to find system shared memory region '{}'",
                truncate(name, 64)
            )));
        }
        Ok(regions)
    }

    /// The slice a tensor's parameters name, if they name one.
    pub fn tensor(
        &self,
        owner: &[u8],
        what: &str,
        tensor: &str,
        params: &[(String, Param)],
    ) -> Result<Option<ShmSlice>> {
        let get = |key: &str| params.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        if TENSOR_PARAMS.iter().all(|key| get(key).is_none()) {
            return Ok(None);
        }
        let table = self.table()?;
        let tensor = truncate(tensor, 64);
        let bad = |message: String| ServeError::invalid(format!("{what} '{tensor}': {message}"));
        let number = |key: &str, default: Option<u64>| match get(key) {
            None => default.ok_or_else(|| bad(format!("shared memory needs parameter '{key}'"))),
            Some(Param::Int(i)) => u64::try_from(*i).map_err(|_| bad(format!("'{key}' must not be negative"))),
            Some(Param::Uint(u)) => Ok(*u),
            Some(other) => Err(bad(format!("'{key}' must be an integer, got {other}"))),
        };
        let name = match get("shared_memory_region") {
            Some(Param::Str(name)) => name,
            Some(other) => return Err(bad(format!("'shared_memory_region' must be a string, got {other}"))),
            None => return Err(bad("shared memory needs parameter 'shared_memory_region'".into())),
        };
        let offset = number("shared_memory_offset", Some(0))?;
        let size = number("shared_memory_byte_size", None)?;
        let region = table
            .get(&(owner.to_vec(), name.clone()))
            .cloned()
            .ok_or_else(|| bad(format!("unknown shared memory region '{}' (register it first)", truncate(name, 64))))?;
        let within = offset.checked_add(size).is_some_and(|end| end <= region.byte_size as u64);
        if !within {
            return Err(bad(format!(
                "shared_memory_offset {offset} + shared_memory_byte_size {size} exceed the {} bytes of region '{}'",
                region.byte_size, region.name
            )));
        }
        Ok(Some(ShmSlice { region, offset: offset as usize, size: size as usize }))
    }
}

/// The shared memory a checked request uses, per schema input and output.
#[derive(Debug, Default)]
pub struct ShmUse {
    pub inputs: Vec<Option<ShmSlice>>,
    pub outputs: Vec<Option<ShmSlice>>,
}

impl ShmUse {
    fn slices(&self) -> impl Iterator<Item = &ShmSlice> {
        self.inputs.iter().chain(&self.outputs).flatten()
    }

    /// Checks the output slices against the plan (each large enough, none overlapping an input
    /// or another output); `None` when the request uses no shared memory.
    pub(crate) fn check(self, plan: &opbridge_ops::Plan) -> Result<Option<ShmUse>> {
        if self.slices().next().is_none() {
            return Ok(None);
        }
        for (k, (slice, meta)) in self.outputs.iter().zip(&plan.outputs).enumerate() {
            let Some(slice) = slice else { continue };
            let need = meta.shape.iter().fold(meta.dtype.size(), |n, &d| n.saturating_mul(d));
            if slice.size < need {
                return Err(ServeError::invalid(format!(
                    "output {k}: shared_memory_byte_size {} is less than the output's {need} bytes",
                    slice.size
                )));
            }
            let others = self.inputs.iter().chain(&self.outputs[..k]).flatten();
            if let Some(other) = others.into_iter().find(|other| slice.overlaps(other)) {
                return Err(ServeError::invalid(format!(
                    "output {k}: its shared memory overlaps another tensor's in region '{}'",
                    other.region.name
                )));
            }
        }
        Ok(Some(self))
    }
}

/// Runs a checked request that uses shared memory, as one execution: in place when the model
/// runs its kernels on the worker and every slice is aligned, else through pooled copies.
pub(crate) fn run_alone(
    model: &ModelVersion,
    checked: Checked,
    shm: ShmUse,
    stream: &opbridge_runtime::Stream,
    session: Option<&Lease>,
    queue_ns: u64,
    inferences: u64,
) -> Result<Vec<Output>> {
    for slice in shm.slices() {
        slice.region.check()?;
    }
    let ctx = DeviceContext::get(model.device)?;
    let alloc = infer::allocator(ctx, session);
    let plan = &checked.plan;
    let dtypes_planned =
        checked.inputs.iter().zip(&plan.inputs).all(|(input, planned)| input.as_ref().map(|i| i.dtype) == *planned);
    let aligned = checked.inputs.iter().zip(&shm.inputs).all(|(input, slice)| match (input, slice) {
        (Some(input), Some(slice)) => slice.aligned(input.dtype),
        _ => true,
    }) && plan
        .outputs
        .iter()
        .zip(&shm.outputs)
        .all(|(meta, slice)| slice.as_ref().is_none_or(|s| s.aligned(meta.dtype)));
    let input_ns = checked.started.elapsed().as_nanos() as u64;
    let started = Instant::now();
    let results = if model.runs_on_worker && dtypes_planned && aligned {
        run_in_place(model, &checked, &shm, stream, alloc)?
    } else {
        run_copied(model, &checked, &shm, stream, alloc)?
    };
    if let Some(lease) = session {
        lease.observe_peak();
    }
    // A page truncated under the kernel read zeros or lost its writes: no result stands.
    if let Some(slice) = shm.slices().find(|s| s.region.mapping.damaged()) {
        return Err(slice.region.truncated(ShmError::Damaged { key: slice.region.key.clone() }));
    }
    let infer_ns = started.elapsed().as_nanos() as u64;
    let encoding = Instant::now();
    let mut outputs = Vec::new();
    for (k, (result, slice)) in results.into_iter().zip(shm.outputs).enumerate() {
        let Some(binary) = checked.wanted[k] else { continue };
        match (result, slice) {
            (Some(tensor), _) => outputs.push(infer::output(model, k, infer::host_bytes(tensor, stream)?, binary)),
            (None, slice) => {
                let meta = &plan.outputs[k];
                outputs.push(Output {
                    name: model.entry.schema().outputs[k].clone(),
                    datatype: crate::datatype::Datatype::of(meta.dtype),
                    shape: meta.shape.to_vec(),
                    data: None,
                    shm: slice,
                    binary,
                });
            }
        }
    }
    let times = Times { queue_ns, input_ns, infer_ns, output_ns: encoding.elapsed().as_nanos() as u64 };
    model.stats.request(&times, inferences);
    model.stats.execution(&times, inferences as usize, model.path());
    Ok(outputs)
}

/// A pooled tensor holding an input: its bytes from the request, or copied from its slice (to
/// an accelerator on `stream`).
fn load(
    input: &CheckedInput,
    slice: Option<&ShmSlice>,
    alloc: &dyn opbridge_runtime::Allocate,
    stream: &opbridge_runtime::Stream,
) -> Result<Tensor> {
    match slice {
        None => infer::tensor_from_bytes(alloc, &input.shape, input.dtype, &input.bytes, stream),
        Some(slice) => {
            let mut bytes = vec![0u8; slice.size];
            slice.region.mapping.read(slice.at(), &mut bytes).map_err(|e| slice.region.truncated(e))?;
            infer::tensor_from_bytes(alloc, &input.shape, input.dtype, &bytes, stream)
        }
    }
}

/// The kernel reads and writes the regions themselves (`None`: an output written there).
fn run_in_place(
    model: &ModelVersion,
    checked: &Checked,
    shm: &ShmUse,
    stream: &opbridge_runtime::Stream,
    alloc: &dyn opbridge_runtime::Allocate,
) -> Result<Vec<Option<Tensor>>> {
    let loaded: Vec<Option<Tensor>> = checked
        .inputs
        .iter()
        .zip(&shm.inputs)
        .map(|(input, slice)| match (input, slice) {
            (Some(input), None) => load(input, None, alloc, stream).map(Some),
            _ => Ok(None),
        })
        .collect::<Result<_>>()?;
    let inputs: Vec<Option<TensorView>> = checked
        .inputs
        .iter()
        .zip(&shm.inputs)
        .zip(&loaded)
        .map(|((input, slice), tensor)| match (input, slice, tensor) {
            (Some(input), Some(slice), _) => Some(TensorView::contiguous(slice.addr(), input.dtype, &input.shape)),
            (_, _, tensor) => tensor.as_ref().map(TensorView::of_tensor),
        })
        .collect();
    let results: Vec<Option<Tensor>> = checked
        .plan
        .outputs
        .iter()
        .zip(&shm.outputs)
        .map(|(meta, slice)| match slice {
            Some(_) => Ok(None),
            None => Tensor::empty_in(alloc, &meta.shape, meta.dtype, StreamId::HOST).map(Some),
        })
        .collect::<std::result::Result<_, _>>()?;
    let views: Vec<TensorView> = results
        .iter()
        .zip(&shm.outputs)
        .zip(&checked.plan.outputs)
        .map(|((tensor, slice), meta)| match (tensor, slice) {
            (Some(tensor), _) => TensorView::of_tensor(tensor),
            (None, slice) => TensorView::contiguous(slice.as_ref().map_or(0, ShmSlice::addr), meta.dtype, &meta.shape),
        })
        .collect();
    // Given, not New: the aliasing of outputs and inputs in the regions is checked again.
    dispatch::run_host(&model.entry, &checked.attrs, &checked.plan, &inputs, HostOutputs::Given(&views), alloc)?;
    Ok(results)
}

/// The inputs copied into pooled tensors, the call run as any other, the outputs copied back.
fn run_copied(
    model: &ModelVersion,
    checked: &Checked,
    shm: &ShmUse,
    stream: &opbridge_runtime::Stream,
    alloc: &dyn opbridge_runtime::Allocate,
) -> Result<Vec<Option<Tensor>>> {
    let inputs: infer::Loaded = checked
        .inputs
        .iter()
        .zip(&shm.inputs)
        .map(|(input, slice)| {
            input.as_ref().map(|input| load(input, slice.as_ref(), alloc, stream).map(Arc::new)).transpose()
        })
        .collect::<Result<_>>()?;
    let results = infer::compute(model, &checked.attrs, &checked.plan, &inputs, stream, alloc)?;
    results
        .into_iter()
        .zip(&shm.outputs)
        .map(|(tensor, slice)| {
            let Some(slice) = slice else { return Ok(Some(tensor)) };
            let data = infer::host_bytes(tensor, stream)?;
            slice.region.mapping.write(slice.at(), data.as_ref()).map_err(|e| slice.region.truncated(e))?;
            Ok(None)
        })
        .collect()
}
