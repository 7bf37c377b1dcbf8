//! One inference, whatever protocol brought it: validate everything before compute (names,
//! datatypes, shapes, byte sizes, attributes), write the inputs straight into pooled memory,
//! run the operator on a compute worker, and hand the outputs back as host bytes owned by
//! their tensors (encoded without another copy).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use opbridge_ops::dispatch::{self, HostOutputs};
use opbridge_ops::hybrid::{self, Route};
use opbridge_ops::schema::{AttrSpec, InputSpec};
use opbridge_ops::{AttrValue, Attrs, Meta, Plan, TensorView};
use opbridge_runtime::{Allocate, DType, DeviceContext, DeviceId, HostBytes, StreamId, Tensor};

use crate::datatype::Datatype;
use crate::error::{Code, Result, ServeError};
use crate::executor::{Jobs, Queued};
use crate::models::{truncate, ModelVersion, Times};
use crate::sessions::Lease;
use crate::shm::{ShmSlice, ShmUse};

/// A request parameter's value (JSON scalar or gRPC `InferParameter`).
#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    /// A JSON array of integers (HTTP), for list attributes such as `axes`.
    Ints(Vec<i64>),
}

/// As the client wrote it (JSON forms), for error messages.
impl std::fmt::Display for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Param::Bool(b) => write!(f, "{b}"),
            Param::Int(i) => write!(f, "{i}"),
            Param::Uint(u) => write!(f, "{u}"),
            Param::Float(x) if x.is_nan() => f.write_str("NaN"),
            Param::Float(x) if x.is_infinite() => f.write_str(if *x > 0.0 { "Infinity" } else { "-Infinity" }),
            // Debug: the shortest text that reads back, with an exponent when that is shorter.
            Param::Float(x) => write!(f, "{x:?}"),
            Param::Str(s) => write!(f, "{}", serde_json::Value::String(truncate(s, 64))),
            Param::Ints(v) => {
                let items: Vec<String> = v.iter().map(i64::to_string).collect();
                write!(f, "[{}]", items.join(", "))
            }
        }
    }
}

/// An input tensor's data as it arrived.
#[derive(Debug, Clone)]
pub enum InputData {
    /// Row-major little-endian bytes (HTTP binary extension, gRPC raw contents).
    Raw(Bytes),
    /// Numbers, converted to the datatype (JSON `data` flattened, gRPC typed contents).
    Numbers(Numbers),
    /// In a registered shared-memory region (read there at compute time).
    Shm(ShmSlice),
}

/// Typed numbers of an input given as values rather than bytes.
#[derive(Debug, Clone)]
pub enum Numbers {
    F64(Vec<f64>),
    I64(Vec<i64>),
    U64(Vec<u64>),
    Bool(Vec<bool>),
}

impl Numbers {
    fn len(&self) -> usize {
        match self {
            Numbers::F64(v) => v.len(),
            Numbers::I64(v) => v.len(),
            Numbers::U64(v) => v.len(),
            Numbers::Bool(v) => v.len(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct InferInput {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    pub data: InputData,
}

#[derive(Debug, Clone)]
pub struct RequestedOutput {
    pub name: String,
    /// `binary_data` of this output (HTTP), overriding the request's `binary_data_output`.
    pub binary: Option<bool>,
    /// Where to write it instead of answering its bytes.
    pub shm: Option<ShmSlice>,
}

/// A request, protocol-neutral.
#[derive(Debug, Clone, Default)]
pub struct InferRequest {
    pub id: String,
    pub params: Vec<(String, Param)>,
    pub inputs: Vec<InferInput>,
    /// `None`: every output.
    pub outputs: Option<Vec<RequestedOutput>>,
}

/// One output of a finished inference.
#[derive(Debug)]
pub struct Output {
    pub name: String,
    pub datatype: Datatype,
    pub shape: Vec<usize>,
    /// `None`: written to shared memory, `shm`.
    pub data: Option<HostBytes>,
    pub shm: Option<ShmSlice>,
    /// Whether the client asked for it as binary (HTTP).
    pub binary: Option<bool>,
}

impl Output {
    pub fn bytes(&self) -> &[u8] {
        self.data.as_ref().map_or(&[], |data| data.as_ref())
    }
}

/// Parameters of the protocol itself, never operator attributes: honoured elsewhere or ignored,
/// as Triton does.
fn is_protocol_param(name: &str) -> bool {
    matches!(
        name,
        "binary_data_output"
            | "priority"
            | "timeout"
            | "headers"
            | "triton_enable_empty_final_response"
            | "ab_key"
            | "session_id"
    ) || name.starts_with("sequence_")
}

/// Triton's per-tensor parameters of extensions this server does not implement.
fn unimplemented_param(name: &str) -> Option<&'static str> {
    match name {
        "classification" => Some("the classification extension"),
        _ => None,
    }
}

/// Checks a tensor's parameters: `known` ones pass, those of extensions we lack are 501 /
/// UNIMPLEMENTED, any other is a client mistake named in a 400.
pub fn check_tensor_params<'a>(
    what: &str,
    tensor: &str,
    keys: impl IntoIterator<Item = &'a str>,
    known: &[&str],
) -> Result<()> {
    let mut unknown = Vec::new();
    for key in keys {
        if known.contains(&key) {
            continue;
        }
        if let Some(extension) = unimplemented_param(key) {
            return Err(ServeError::new(
                Code::Unimplemented,
                format!(
                    "{what} '{}': parameter '{key}' needs {extension}, which this server does not support",
                    truncate(tensor, 64)
                ),
            ));
        }
        unknown.push(format!("'{}'", truncate(key, 64)));
    }
    if unknown.is_empty() {
        return Ok(());
    }
    let takes = if known.is_empty() { "none".to_string() } else { known.join(", ") };
    Err(ServeError::invalid(format!(
        "{what} '{}': unknown parameter(s) {}; it takes {takes}",
        truncate(tensor, 64),
        unknown.join(", ")
    )))
}

/// The attribute value of a request parameter, typed by the schema's attribute.
pub(crate) fn attr_value(model: &str, spec: &AttrSpec, param: &Param) -> Result<AttrValue> {
    let bad = |what: &str| {
        ServeError::invalid(format!("model '{model}': parameter '{}' must be {what}, got {param}", spec.name))
    };
    let kind = spec.default.as_ref();
    // A list attribute, or one whose kind the schema does not say (default None, required).
    let maybe_list = matches!(kind, Some(AttrValue::Ints(_)) | Some(AttrValue::None) | None);
    Ok(match (kind, param) {
        (_, Param::Ints(v)) if maybe_list => AttrValue::Ints(v.clone()),
        (_, Param::Ints(_)) => return Err(bad("a single value")),
        (_, Param::Str(s)) if matches!(kind, Some(AttrValue::Ints(_))) => {
            AttrValue::Ints(parse_ints(s).ok_or_else(|| bad("a list of integers, like \"[0, 1]\""))?)
        }
        // gRPC has no list parameter: a list travels as the string "[1, 2]".
        (_, Param::Str(s)) if maybe_list && s.trim_start().starts_with('[') && parse_ints(s).is_some() => {
            AttrValue::Ints(parse_ints(s).unwrap_or_default())
        }
        (Some(AttrValue::Bool(_)), Param::Bool(b)) => AttrValue::Bool(*b),
        (Some(AttrValue::Bool(_)), _) => return Err(bad("a boolean")),
        (Some(AttrValue::Str(_)), Param::Str(s)) => AttrValue::Str(s.clone()),
        (Some(AttrValue::Str(_)), _) => return Err(bad("a string")),
        (Some(AttrValue::Ints(_)), Param::Int(i)) => AttrValue::Ints(vec![*i]),
        (Some(AttrValue::Ints(_)), _) => return Err(bad("a list of integers")),
        _ if spec.takes_float => match param {
            Param::Float(x) => AttrValue::Float(*x),
            Param::Int(i) => AttrValue::Float(*i as f64),
            Param::Uint(u) => AttrValue::Float(*u as f64),
            _ => return Err(bad("a number")),
        },
        (Some(AttrValue::Int(_)) | Some(AttrValue::None) | None, Param::Int(i)) => AttrValue::Int(*i),
        (Some(AttrValue::Int(_)) | Some(AttrValue::None) | None, Param::Uint(u)) => {
            AttrValue::Int(i64::try_from(*u).map_err(|_| bad("an integer in int64's range"))?)
        }
        (Some(AttrValue::Float(_)), Param::Float(x)) => AttrValue::Float(*x),
        (Some(AttrValue::Float(_)), Param::Int(i)) => AttrValue::Float(*i as f64),
        (_, Param::Bool(b)) if kind.is_none() => AttrValue::Bool(*b),
        (_, Param::Str(s)) if kind.is_none() => AttrValue::Str(s.clone()),
        (_, Param::Float(x)) if kind.is_none() => AttrValue::Float(*x),
        _ => return Err(bad("a value of the attribute's type")),
    })
}

fn parse_ints(text: &str) -> Option<Vec<i64>> {
    let text = text.trim();
    let inner = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or(text);
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    inner.split(',').map(|p| p.trim().parse().ok()).collect()
}

/// A request checked against its model and planned; nothing allocated yet.
#[derive(Debug)]
pub struct Checked {
    pub(crate) attrs: opbridge_ops::Attrs,
    /// Per schema input (`None`: an optional one not given).
    pub(crate) inputs: Vec<Option<CheckedInput>>,
    /// Per schema output: requested, and how.
    pub(crate) wanted: Vec<Option<Option<bool>>>,
    pub(crate) plan: Plan,
    /// The shared memory the call reads and writes, if any.
    pub(crate) shm: Option<ShmUse>,
    /// When checking began (the request's compute-input time runs from here).
    pub(crate) started: Instant,
}

/// An input checked against its model: its dtype, shape, and bytes as the tensor will hold them.
#[derive(Debug)]
pub struct CheckedInput {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Bytes,
}

impl CheckedInput {
    pub(crate) fn meta(&self) -> Meta {
        Meta::new(self.dtype, &self.shape)
    }
}

impl Checked {
    pub(crate) fn metas(&self) -> Vec<Option<Meta>> {
        self.inputs.iter().map(|i| i.as_ref().map(CheckedInput::meta)).collect()
    }
}

/// A call's inputs in memory (per schema input).
pub type Loaded = Vec<Option<Arc<Tensor>>>;

/// Checks `request` against `model` and plans the call. Every client mistake is an
/// `InvalidArgument` (or `TooLarge`, or a session's `QuotaExceeded`) here, before anything is
/// allocated or runs.
pub fn check(
    model: &ModelVersion,
    request: InferRequest,
    max_input_bytes: usize,
    session: Option<&Lease>,
) -> Result<Checked> {
    let started = Instant::now();
    let schema = model.entry.schema();
    let name = &model.model;
    // Attributes: request parameters named by the schema; the protocol's own are skipped.
    let mut given: Vec<(String, AttrValue)> = model.fixed.clone();
    let mut unknown = Vec::new();
    for (key, param) in &request.params {
        if is_protocol_param(key) {
            continue;
        }
        if key.starts_with("shared_memory_") {
            return Err(ServeError::invalid(format!(
                "parameter '{key}' belongs to an input or output, not to the request"
            )));
        }
        if model.fixed.iter().any(|(fixed, _)| fixed == key) {
            return Err(ServeError::invalid(format!("model '{name}' fixes parameter '{key}': it cannot be set")));
        }
        match schema.attrs.iter().find(|a| &a.name == key) {
            Some(spec) => given.push((key.clone(), attr_value(name, spec, param)?)),
            None => unknown.push(truncate(key, 64)),
        }
    }
    if !unknown.is_empty() {
        let known: Vec<&str> = schema.attrs.iter().map(|a| a.name.as_str()).collect();
        return Err(ServeError::invalid(format!(
            "model '{name}': unknown parameter(s) {}; it takes {}",
            unknown.join(", "),
            if known.is_empty() { "none".to_string() } else { known.join(", ") }
        )));
    }
    let attrs = schema.bind_attrs(given.iter().map(|(k, v)| (k.as_str(), v.clone())))?;

    // Inputs: each named once, by the schema; required ones present.
    let mut slots: Vec<Option<InferInput>> = vec![None; schema.inputs.len()];
    for input in request.inputs {
        let Some(k) = schema.inputs.iter().position(|s| s.name == input.name) else {
            let names: Vec<&str> = schema.inputs.iter().map(|s| s.name.as_str()).collect();
            return Err(ServeError::invalid(format!(
                "unexpected inference input '{}' for model '{name}'; it takes {}",
                truncate(&input.name, 64),
                names.join(", ")
            )));
        };
        if slots[k].is_some() {
            return Err(ServeError::invalid(format!("input '{}' given twice for model '{name}'", input.name)));
        }
        slots[k] = Some(input);
    }
    let missing: Vec<&str> = schema
        .inputs
        .iter()
        .zip(&slots)
        .filter(|(s, i)| !s.optional && i.is_none())
        .map(|(s, _)| s.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(ServeError::invalid(format!(
            "expected {} inputs for model '{name}', missing required input(s) {}",
            schema.inputs.iter().filter(|s| !s.optional).count(),
            missing.join(", ")
        )));
    }
    // Outputs asked for must exist.
    let mut wanted: Vec<Option<Option<bool>>> = vec![None; schema.outputs.len()];
    let mut shm = ShmUse { inputs: Vec::new(), outputs: vec![None; schema.outputs.len()] };
    match request.outputs {
        None => wanted.iter_mut().for_each(|w| *w = Some(None)),
        Some(outputs) => {
            for out in outputs {
                let Some(k) = schema.outputs.iter().position(|o| *o == out.name) else {
                    return Err(ServeError::invalid(format!(
                        "unexpected inference output '{}' for model '{name}'; it has {}",
                        truncate(&out.name, 64),
                        schema.outputs.join(", ")
                    )));
                };
                wanted[k] = Some(out.binary);
                shm.outputs[k] = out.shm;
            }
        }
    }

    // Every input checked, and the call planned, before anything is allocated: a session's
    // quota is then checked against the whole request's need.
    let mut checked = Vec::with_capacity(slots.len());
    let mut metas = Vec::with_capacity(slots.len());
    for (spec, slot) in schema.inputs.iter().zip(slots) {
        let Some(input) = slot else {
            checked.push(None);
            metas.push(None);
            shm.inputs.push(None);
            continue;
        };
        let dtype = accepted_dtype(model, spec, &input.name, &input.datatype)?;
        let shape: Vec<usize> =
            input.shape.iter().map(|&d| usize::try_from(d)).collect::<std::result::Result<_, _>>().map_err(|_| {
                ServeError::invalid(format!("input '{}': negative dimension in shape {:?}", input.name, input.shape))
            })?;
        let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let bytes = count.and_then(|n| n.checked_mul(dtype.size()));
        let Some(bytes) = bytes.filter(|&b| b <= isize::MAX as usize) else {
            return Err(ServeError::invalid(format!("input '{}': shape {:?} overflows", input.name, input.shape)));
        };
        // Shared memory is the client's: no request size limit applies, its region bounds it.
        if bytes > max_input_bytes && !matches!(input.data, InputData::Shm(_)) {
            return Err(ServeError::new(
                Code::TooLarge,
                format!(
                    "input '{}' of {bytes} bytes exceeds the maximum allowed input size of {max_input_bytes} bytes; use \
                     --http-max-input-size / --grpc-max-message-size to increase the limit",
                    input.name
                ),
            ));
        }
        match &input.data {
            InputData::Raw(raw) if raw.len() != bytes => {
                return Err(ServeError::invalid(format!(
                    "input byte size mismatch for input '{}' for model '{name}'. Expected {bytes}, got {}",
                    input.name,
                    raw.len()
                )));
            }
            InputData::Numbers(numbers) if numbers.len() != count.unwrap_or(0) => {
                return Err(ServeError::invalid(format!(
                    "unexpected number of elements for input '{}' of model '{name}': shape {:?} holds {}, got {}",
                    input.name,
                    input.shape,
                    count.unwrap_or(0),
                    numbers.len()
                )));
            }
            InputData::Shm(slice) if slice.size != bytes => {
                return Err(ServeError::invalid(format!(
                    "input '{}': shared_memory_byte_size {} does not match the input's {bytes} bytes",
                    input.name, slice.size
                )));
            }
            _ => {}
        }
        let (bytes, slice) = match input.data {
            InputData::Raw(raw) => (raw, None),
            InputData::Numbers(numbers) => (Bytes::from(encode_numbers(&input.name, &numbers, dtype)?), None),
            InputData::Shm(slice) => (Bytes::new(), Some(slice)),
        };
        shm.inputs.push(slice);
        metas.push(Some(Meta::new(dtype, &shape)));
        checked.push(Some(CheckedInput { dtype, shape, bytes }));
    }
    let plan = dispatch::plan(&model.entry, &metas, &attrs)?;
    let shm = shm.check(&plan)?;
    if let Some(lease) = session {
        // Saturating: an output shape too large to count is simply over any quota.
        let bytes = |meta: &Meta| meta.shape.iter().fold(meta.dtype.size(), |n, &d| n.saturating_mul(d));
        let block = |meta: &Meta| lease.pool.parent().block_size(bytes(meta));
        // Tensors in shared memory are the client's memory, not the session's (an unaligned
        // one's pooled copy is counted anyway, when allocated).
        let none = ShmUse::default();
        let used = shm.as_ref().unwrap_or(&none);
        let placed = |slices: &[Option<ShmSlice>], k: usize| slices.get(k).is_some_and(Option::is_some);
        let inputs =
            metas.iter().enumerate().filter(|(k, _)| !placed(&used.inputs, *k)).filter_map(|(_, m)| m.as_ref());
        let outputs = plan.outputs.iter().enumerate().filter(|(k, _)| !placed(&used.outputs, *k)).map(|(_, m)| m);
        let need = inputs.chain(outputs).map(block).fold(0usize, usize::saturating_add);
        lease.check_need(need)?;
    }
    Ok(Checked { attrs, inputs: checked, wanted, plan, shm, started })
}

/// Writes a checked call's inputs into memory from `alloc` (on an accelerator: copied up on
/// `stream`, ahead of the call's kernel on the same stream).
pub fn load(checked: &Checked, alloc: &dyn Allocate, stream: &opbridge_runtime::Stream) -> Result<Loaded> {
    let mut inputs = Vec::with_capacity(checked.inputs.len());
    for input in &checked.inputs {
        let Some(input) = input else {
            inputs.push(None);
            continue;
        };
        inputs.push(Some(Arc::new(tensor_from_bytes(alloc, &input.shape, input.dtype, &input.bytes, stream)?)));
    }
    Ok(inputs)
}

/// A tensor from `alloc` holding `bytes` (row-major). Host memory (the CPU device) is written in
/// place; an accelerator's tensor is filled by a host-to-device copy on `stream` from a block
/// of its pinned pool (the bytes are staged before this returns; the copy is not waited for:
/// the call's kernel on `stream` runs after it).
pub(crate) fn tensor_from_bytes(
    alloc: &dyn Allocate,
    shape: &[usize],
    dtype: DType,
    bytes: &[u8],
    stream: &opbridge_runtime::Stream,
) -> Result<Tensor> {
    if host_memory(alloc)? {
        let mut tensor = Tensor::empty_in(alloc, shape, dtype, StreamId::HOST)?;
        tensor.write_from_host(bytes)?;
        return Ok(tensor);
    }
    let tensor = Tensor::empty_in(alloc, shape, dtype, stream.id())?;
    tensor.upload_async(stream, bytes)?;
    Ok(tensor)
}

/// A result's bytes on the host: read in place from host memory, or copied back from an
/// accelerator on `stream` into a pinned block (waited for, with the stream's errors).
pub(crate) fn host_bytes(tensor: Tensor, stream: &opbridge_runtime::Stream) -> Result<HostBytes> {
    let host = tensor.into_host_bytes().or_else(|failed| {
        let (tensor, error) = *failed;
        if DeviceContext::get(tensor.device())?.device().host_accessible() {
            return Err(ServeError::from(error));
        }
        let copied = tensor.download_async(stream)?.wait()?;
        copied.into_host_bytes().map_err(|failed| ServeError::from(failed.1))
    })?;
    Ok(host)
}

/// Whether `alloc` hands out host memory (the CPU device's pools).
pub(crate) fn host_memory(alloc: &dyn Allocate) -> Result<bool> {
    Ok(DeviceContext::get(alloc.device())?.device().host_accessible())
}

/// The opbridge dtype of an input's datatype, if the model's input takes it; else the error
/// naming what it takes.
pub fn accepted_dtype(model: &ModelVersion, spec: &InputSpec, input: &str, datatype: &str) -> Result<DType> {
    let schema = model.entry.schema();
    let name = &model.model;
    let accepted = spec.dtypes(&schema.dtypes);
    let takes = || accepted.iter().map(|d| Datatype::of(*d).name()).collect::<Vec<_>>().join(", ");
    let parsed = Datatype::parse(datatype).ok_or_else(|| {
        ServeError::invalid(format!(
            "input '{input}': unknown datatype '{}'; model '{name}' takes {}",
            truncate(datatype, 16),
            takes()
        ))
    })?;
    parsed.dtype().filter(|d| accepted.contains(d)).ok_or_else(|| {
        ServeError::invalid(format!(
            "input '{input}' of model '{name}': datatype {} is not supported; it takes {}",
            parsed.name(),
            takes()
        ))
    })
}

/// Numbers as little-endian bytes of `dtype`, each checked to be representable.
fn encode_numbers(input: &str, numbers: &Numbers, dtype: DType) -> Result<Vec<u8>> {
    let bad = |v: String| ServeError::invalid(format!("input '{input}': value {v} is not a valid {dtype}"));
    let mut out = Vec::with_capacity(numbers.len() * dtype.size());
    let as_f64: Vec<f64> = match numbers {
        Numbers::F64(v) => v.clone(),
        Numbers::I64(v) if dtype.is_float() => v.iter().map(|&x| x as f64).collect(),
        Numbers::U64(v) if dtype.is_float() => v.iter().map(|&x| x as f64).collect(),
        Numbers::Bool(_) => return Err(bad("true/false".into())),
        _ => Vec::new(),
    };
    match dtype {
        DType::F16 => as_f64.iter().for_each(|&x| out.extend(crate::datatype::f16_from_f64(x).to_le_bytes())),
        DType::F32 => as_f64.iter().for_each(|&x| out.extend((x as f32).to_le_bytes())),
        DType::F64 => as_f64.iter().for_each(|&x| out.extend(x.to_le_bytes())),
        DType::I32 | DType::I64 => {
            let ints: Vec<i64> = match numbers {
                Numbers::I64(v) => v.clone(),
                Numbers::U64(v) => {
                    v.iter().map(|&x| i64::try_from(x).map_err(|_| bad(x.to_string()))).collect::<Result<_>>()?
                }
                Numbers::F64(v) => v
                    .iter()
                    .map(|&x| if x.fract() == 0.0 && x.abs() < 9.2e18 { Ok(x as i64) } else { Err(bad(x.to_string())) })
                    .collect::<Result<_>>()?,
                Numbers::Bool(_) => unreachable!("refused above"),
            };
            for x in ints {
                if dtype == DType::I32 {
                    let x = i32::try_from(x).map_err(|_| bad(x.to_string()))?;
                    out.extend(x.to_le_bytes());
                } else {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    Ok(out)
}

/// Runs a planned call on a compute worker's stream (or right on the worker: see
/// [`runs_inline`]); the outputs are new tensors from `alloc`, their work done.
pub(crate) fn compute(
    model: &ModelVersion,
    attrs: &Attrs,
    plan: &Plan,
    inputs: &Loaded,
    stream: &opbridge_runtime::Stream,
    alloc: &dyn Allocate,
) -> Result<Vec<Tensor>> {
    if runs_inline(model, plan, inputs) {
        return run_inline(model, attrs, plan, inputs, alloc);
    }
    let results = dispatch::launch(&model.entry, attrs, inputs, None, stream, alloc)?;
    stream.synchronize()?;
    results
        .into_iter()
        .map(|tensor| {
            Arc::try_unwrap(tensor).map_err(|_| ServeError::internal("an output tensor is still shared after the call"))
        })
        .collect()
}

/// The outputs the client asked for, as host bytes owned by their tensors (an accelerator's
/// copied back on `stream`).
pub(crate) fn outputs(
    model: &ModelVersion,
    results: Vec<Tensor>,
    wanted: &[Option<Option<bool>>],
    stream: &opbridge_runtime::Stream,
) -> Result<Vec<Output>> {
    let mut outputs = Vec::new();
    for (k, tensor) in results.into_iter().enumerate() {
        if let Some(binary) = wanted[k] {
            outputs.push(output(model, k, host_bytes(tensor, stream)?, binary));
        }
    }
    Ok(outputs)
}

/// Output `k` of `model`, from its bytes on the host.
pub(crate) fn output(model: &ModelVersion, k: usize, data: HostBytes, binary: Option<bool>) -> Output {
    Output {
        name: model.entry.schema().outputs[k].clone(),
        datatype: Datatype::of(data.tensor().dtype()),
        shape: data.tensor().shape().to_vec(),
        data: Some(data),
        shm: None,
        binary,
    }
}

/// The allocator of a request's tensors: its session's pool, or the model's device pool.
pub(crate) fn allocator<'a>(ctx: &'a DeviceContext, session: Option<&'a Lease>) -> &'a dyn Allocate {
    match session {
        Some(lease) => &lease.pool,
        None => ctx.pool(),
    }
}

/// Runs one checked request as an execution of its own, and records it: `queue_ns` it waited
/// in the queue, `inferences` it counts for (its batch size on a batching model, else 1).
pub(crate) fn run_alone(
    model: &ModelVersion,
    checked: Checked,
    stream: &opbridge_runtime::Stream,
    session: Option<&Lease>,
    queue_ns: u64,
    inferences: u64,
) -> Result<Vec<Output>> {
    let outcome = run_alone_on(model, checked, stream, session, queue_ns, inferences);
    if outcome.is_err() {
        settle(stream);
    }
    outcome
}

/// After a failed call: waits for what it left queued on the worker's stream and takes the
/// stream's errors, which belong to that call (already answered), not to the next request.
pub(crate) fn settle(stream: &opbridge_runtime::Stream) {
    if let Err(error) = stream.synchronize() {
        tracing::debug!("after a failed call, its stream reported: {error}");
    }
}

fn run_alone_on(
    model: &ModelVersion,
    checked: Checked,
    stream: &opbridge_runtime::Stream,
    session: Option<&Lease>,
    queue_ns: u64,
    inferences: u64,
) -> Result<Vec<Output>> {
    let mut checked = checked;
    if let Some(shm) = checked.shm.take() {
        return crate::shm::run_alone(model, checked, shm, stream, session, queue_ns, inferences);
    }
    let ctx = DeviceContext::get(model.device)?;
    let alloc = allocator(ctx, session);
    let route = if model.auto { auto_route(model, &checked) } else { model.path() };
    if let Route::Device(_) = route {
        // What the host kernel checks from the values (embedding_bag's indices), checked here on
        // the request's bytes: a device kernel would only meet them while it runs (a device
        // fault, not the client's 400).
        let values: Vec<Option<(&[u8], opbridge_ops::Meta)>> =
            checked.inputs.iter().map(|i| i.as_ref().map(|i| (&i.bytes[..], i.meta()))).collect();
        model.entry.op.check_host_values(&values, &checked.attrs)?;
    }
    let (results, input_ns, infer_ns) = match route {
        Route::Device(device) if model.auto => {
            let input_ns = checked.started.elapsed().as_nanos() as u64;
            let started = Instant::now();
            let results = run_staged(model, &checked, device, alloc)?;
            (results, input_ns, started.elapsed().as_nanos() as u64)
        }
        _ => {
            let inputs = load(&checked, alloc, stream)?;
            let input_ns = checked.started.elapsed().as_nanos() as u64;
            let started = Instant::now();
            let results = compute(model, &checked.attrs, &checked.plan, &inputs, stream, alloc)?;
            (results, input_ns, started.elapsed().as_nanos() as u64)
        }
    };
    if let Some(lease) = session {
        lease.observe_peak();
    }
    let encoding = Instant::now();
    let outputs = outputs(model, results, &checked.wanted, stream)?;
    let output_ns = encoding.elapsed().as_nanos() as u64;
    let times = Times { queue_ns, input_ns, infer_ns, output_ns };
    model.stats.request(&times, inferences);
    model.stats.execution(&times, inferences as usize, route);
    Ok(outputs)
}

/// Where a `device = "auto"` model's request runs: through the device whose calibrated
/// crossover its size reaches, else on the host (the model's own path). Only a call the staged
/// path takes as it is can go: every input present, of one shape and one dtype that the
/// operator's lane serves without conversion.
fn auto_route(model: &ModelVersion, checked: &Checked) -> Route {
    let Some(lane) = model.entry.op.lane() else { return Route::Host };
    let mut present = checked.inputs.iter();
    let Some(Some(first)) = present.next() else { return Route::Host };
    let same = present.all(|i| i.as_ref().is_some_and(|i| i.dtype == first.dtype && i.shape == first.shape));
    let unconverted = checked.plan.inputs.iter().all(|d| *d == Some(first.dtype));
    let one_output = checked.plan.outputs.len() == 1 && checked.plan.outputs[0].shape[..] == first.shape[..];
    if !(same && unconverted && one_output && (lane.accepts)(first.dtype)) {
        return Route::Host;
    }
    match hybrid::route(&model.entry.schema().name, first.dtype, first.shape.iter().product()) {
        // A crossovers file may name a dtype the device's kernel does not take.
        Route::Device(d) if !model.entry.runs_on(d.kind, first.dtype) => Route::Host,
        route => route,
    }
}

/// A request staged through `device` in chunks, copies overlapping the kernel
/// (`opbridge_ops::device::run_staged`); its output lands in a host tensor from `alloc`.
fn run_staged(model: &ModelVersion, checked: &Checked, device: DeviceId, alloc: &dyn Allocate) -> Result<Vec<Tensor>> {
    let ctx = DeviceContext::get(device)?;
    let meta = &checked.plan.outputs[0];
    let inputs: Vec<(&[u8], DType)> = checked.inputs.iter().flatten().map(|i| (&i.bytes[..], i.dtype)).collect();
    let len: usize = meta.shape.iter().product();
    let mut bytes = vec![0u8; len * meta.dtype.size()];
    opbridge_ops::device::run_staged(&model.entry, ctx, &checked.attrs, &inputs, (&mut bytes, meta.dtype), len)?;
    let mut output = Tensor::empty_in(alloc, &meta.shape, meta.dtype, StreamId::HOST)?;
    output.write_from_host(&bytes)?;
    Ok(vec![output])
}

/// A request on its way to a compute worker.
#[derive(Debug)]
pub struct Call {
    pub model: Arc<ModelVersion>,
    pub request: Job,
    pub max_input_bytes: usize,
    pub reply: Reply,
}

/// What a queued call carries: the request as it arrived, for the worker to check, or one the
/// front end checked already (a small call it meant to run itself, see [`infer`], that proved
/// larger than it looked).
#[derive(Debug)]
pub enum Job {
    Arrived(InferRequest),
    Checked(Box<Checked>),
}

impl Job {
    /// The checked call of a job queued at `queued_at`: [`check`]ed now, or as it was checked
    /// before, its compute-input clock moved on by its wait in the queue (queue time, counted
    /// apart), so that it counts its checks only.
    pub(crate) fn check(
        self,
        model: &ModelVersion,
        max_input_bytes: usize,
        session: Option<&Lease>,
        queued_at: Instant,
    ) -> Result<Checked> {
        match self {
            Job::Arrived(request) => check(model, request, max_input_bytes, session),
            Job::Checked(mut checked) => {
                checked.started += queued_at.elapsed();
                Ok(*checked)
            }
        }
    }
}

/// Where a request's answer goes, with the session it runs in.
#[derive(Debug)]
pub struct Reply {
    pub session: Option<Lease>,
    sender: tokio::sync::oneshot::Sender<Result<Vec<Output>>>,
}

impl Reply {
    /// Answers the request (a session's quota refusal explained with its numbers).
    pub fn answer(self, outcome: Result<Vec<Output>>) {
        let outcome = explained(outcome, self.session.as_ref());
        // The client may have gone: nobody to tell.
        let _ = self.sender.send(outcome);
    }
}

/// A request's outcome as its client gets it: a session's quota refusal explained with its
/// numbers.
fn explained(outcome: Result<Vec<Output>>, session: Option<&Lease>) -> Result<Vec<Output>> {
    match (outcome, session) {
        (Err(error), Some(lease)) => Err(lease.explain(error)),
        (outcome, _) => outcome,
    }
}

/// A compute worker of a model without batching: one request at a time.
pub fn work(stream: &opbridge_runtime::Stream, jobs: &Jobs<Call>) -> bool {
    let Some(Queued { item: call, at }) = jobs.next_to_run() else { return false };
    let queue_ns = at.elapsed().as_nanos() as u64;
    let _running = jobs.running();
    let Call { model, request, max_input_bytes, reply } = call;
    let session = reply.session.as_ref();
    let outcome = request
        .check(&model, max_input_bytes, session, at)
        .and_then(|checked| run_alone(&model, checked, stream, session, queue_ns, 1));
    reply.answer(outcome);
    true
}

/// A request to a loaded model version, from the front end's side: finished once, as a success
/// or a failure, in the version's statistics and in the log (with the request's `id`). Dropped
/// unfinished (the client went away and the handler's future with it), it counts as a failure
/// with Triton's reason CANCELED.
#[derive(Debug)]
pub struct Pending {
    model: Arc<ModelVersion>,
    started: Instant,
    protocol: &'static str,
    /// The request's `id`, once parsed ("" when it has none).
    id: String,
    finished: bool,
}

impl Pending {
    pub fn new(model: Arc<ModelVersion>, started: Instant, protocol: &'static str) -> Pending {
        Pending { model, started, protocol, id: String::new(), finished: false }
    }

    /// The request's `id`, for the log.
    pub fn identify(&mut self, id: &str) {
        self.id = truncate(id, 128);
    }

    /// Records the request's end in the version's statistics and the log.
    pub fn finish(mut self, outcome: std::result::Result<(), &ServeError>) {
        self.finished = true;
        let stats = &self.model.stats;
        let ns = self.started.elapsed().as_nanos() as u64;
        stats.request_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        let (model, version, id, protocol, duration_us) =
            (&self.model.model, self.model.version, &self.id, self.protocol, ns / 1000);
        match outcome {
            Ok(()) => {
                stats.success.add(ns);
                tracing::debug!(model, version, id, protocol, duration_us, "inference done");
            }
            Err(error) => {
                stats.fail.add(ns);
                stats.failures.count(error);
                let (code, error) = (error.label(), &error.message);
                if code == "500" {
                    tracing::error!(model, version, id, protocol, duration_us, code, error, "inference failed");
                } else {
                    tracing::info!(model, version, id, protocol, duration_us, code, error, "inference refused");
                }
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let stats = &self.model.stats;
            let ns = self.started.elapsed().as_nanos() as u64;
            stats.request_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
            stats.fail.add(ns);
            stats.failures.canceled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (model, version, id, protocol) = (&self.model.model, self.model.version, &self.id, self.protocol);
            tracing::info!(model, version, id, protocol, "inference canceled: the client went away");
        }
    }
}

/// Whether the call runs on the calling compute worker itself: a CPU model of an operator with a
/// CPU kernel, whose inputs already have the kernel's dtypes. Otherwise it goes through the
/// worker's stream (conversions, other devices, and the launch's typed "no CPU kernel" error).
fn runs_inline(model: &ModelVersion, plan: &Plan, inputs: &Loaded) -> bool {
    model.runs_on_worker && unconverted(plan, inputs.iter().map(|t| t.as_ref().map(|t| t.dtype())))
}

/// Whether inputs of these dtypes (`None`: an optional one not given) are the kernel's own, as
/// `plan` has them: nothing to convert first.
fn unconverted(plan: &Plan, dtypes: impl Iterator<Item = Option<DType>>) -> bool {
    dtypes.zip(&plan.inputs).all(|(dtype, planned)| dtype == *planned)
}

/// Runs a CPU call right here, on the compute worker (`dispatch::run_host`: the same kernel a
/// stream launch would run, so the same bits), instead of handing it to the stream's thread and
/// waiting: two thread hand-offs less per request. The outputs are new tensors from `alloc`.
fn run_inline(
    model: &ModelVersion,
    attrs: &Attrs,
    plan: &Plan,
    inputs: &Loaded,
    alloc: &dyn Allocate,
) -> Result<Vec<Tensor>> {
    let outputs = plan
        .outputs
        .iter()
        .map(|meta| Tensor::empty_in(alloc, &meta.shape, meta.dtype, StreamId::HOST))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let inputs: Vec<Option<TensorView>> = inputs.iter().map(|t| t.as_deref().map(TensorView::of_tensor)).collect();
    let views: Vec<TensorView> = outputs.iter().map(TensorView::of_tensor).collect();
    dispatch::run_host(&model.entry, attrs, plan, &inputs, HostOutputs::New(&views), alloc)?;
    Ok(outputs)
}

/// Runs `request` on `model`; the awaitable result. With a `session`, every tensor of the call
/// comes from the session's pool, within its quota.
///
/// A call is queued for the model's compute workers (which check it, load its inputs into
/// pooled memory and run it: no kernel-sized work on the async runtime's threads), except a
/// small one that `may_run_here` with nobody queued ahead: that one runs right here, on the
/// connection's thread, as a worker would run it (the same checks, kernel, memory and
/// statistics). Handing a call of a few microseconds to a worker and its answer back costs
/// more than the call: two thread wake-ups, the most of a small request's server time.
pub async fn infer(
    model: Arc<ModelVersion>,
    request: InferRequest,
    max_input_bytes: usize,
    session: Option<Lease>,
) -> Result<Vec<Output>> {
    let slot = if may_run_here(&model, &request) { model.executor.slot_here() } else { None };
    let request = match slot {
        Some(_running) => match run_here(&model, request, max_input_bytes, session.as_ref()) {
            Ok(outcome) => return explained(outcome, session.as_ref()),
            Err(checked) => Job::Checked(checked),
        },
        None => Job::Arrived(request),
    };
    let (sender, result) = tokio::sync::oneshot::channel();
    let call = Call { model: Arc::clone(&model), request, max_input_bytes, reply: Reply { session, sender } };
    model.executor.submit(call)?;
    result.await.map_err(|_| ServeError::internal("the compute worker stopped before answering"))?
}

/// The most bytes a call that runs on a connection's thread reads (inputs as they arrived) and
/// writes (outputs): with work linear in its bytes, a few microseconds of kernel at most, never
/// a stall of the connections that share the thread.
const HERE_MAX_BYTES: usize = 64 << 10;

/// Whether `request` may run on the calling (connection) thread: a small call of a built-in
/// operator (its code is the process's and takes any thread) whose work is linear in its bytes
/// (elementwise, the row-wise operators that declare batching: not `matmul` or
/// `embedding_bag`, whose work a few bytes do not bound), on a CPU model without batching,
/// nothing in shared memory. The model's queue decides the rest (`Executor::slot_here`).
fn may_run_here(model: &ModelVersion, request: &InferRequest) -> bool {
    let input_bytes = request.inputs.iter().try_fold(0usize, |sum, input| match &input.data {
        InputData::Raw(bytes) => Some(sum + bytes.len()),
        InputData::Numbers(numbers) => Some(sum + numbers.len() * 8),
        InputData::Shm(_) => None,
    });
    input_bytes.is_some_and(|bytes| bytes <= HERE_MAX_BYTES)
        && model.runs_on_worker
        && !model.auto
        && model.batching.is_none()
        && model.entry.source == opbridge_ops::registry::Source::Builtin
        && linear_work(model)
        && request.outputs.as_ref().is_none_or(|outputs| outputs.iter().all(|o| o.shm.is_none()))
}

/// Whether the model's operator does work in proportion to its bytes: it has the elementwise
/// lane or declares row-wise batching (softmax, the norms). A view lane says nothing of the
/// kind (`matmul` has one).
fn linear_work(model: &ModelVersion) -> bool {
    let op = &model.entry.op;
    op.lane().is_some() || op.batching().is_some()
}

/// Checks and runs a call that [`may_run_here`] on this thread; its outcome, or the checked call
/// back when it needs more than this thread should give it (outputs over [`HERE_MAX_BYTES`],
/// or inputs to convert, which the kernel's stream does): the workers run it then.
fn run_here(
    model: &ModelVersion,
    request: InferRequest,
    max_input_bytes: usize,
    session: Option<&Lease>,
) -> std::result::Result<Result<Vec<Output>>, Box<Checked>> {
    let checked = match check(model, request, max_input_bytes, session) {
        Ok(checked) => checked,
        Err(error) => return Ok(Err(error)),
    };
    let output_bytes = checked.plan.outputs.iter().try_fold(0usize, |sum, meta| {
        meta.shape.iter().try_fold(meta.dtype.size(), |n, &d| n.checked_mul(d)).and_then(|n| sum.checked_add(n))
    });
    let unconverted = unconverted(&checked.plan, checked.inputs.iter().map(|i| i.as_ref().map(|i| i.dtype)));
    if !(unconverted && output_bytes.is_some_and(|bytes| bytes <= HERE_MAX_BYTES)) {
        return Err(Box::new(checked));
    }
    // Host memory, inputs of the kernel's dtypes, a CPU kernel: `run_alone` loads, computes and
    // answers in place (`runs_inline`), so this thread's stream only settles a failed call.
    Ok(HERE.with(|stream| match stream {
        Ok(stream) => run_alone(model, checked, stream, session, 0, 1),
        Err(error) => Err(ServeError::internal(format!("no CPU stream on this thread: {error}"))),
    }))
}

thread_local! {
    /// The stream of calls run on this (connection) thread: the CPU device's.
    static HERE: std::result::Result<opbridge_runtime::Stream, String> =
        DeviceContext::get(DeviceId::CPU).and_then(|ctx| opbridge_runtime::Stream::new(ctx)).map_err(|e| e.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_attributes_from_json_arrays_and_grpc_strings() {
        let axes =
            AttrSpec { name: "axes".into(), default: Some(AttrValue::None), doc: String::new(), takes_float: false };
        assert_eq!(attr_value("m", &axes, &Param::Ints(vec![1, 0])), Ok(AttrValue::Ints(vec![1, 0])));
        assert_eq!(attr_value("m", &axes, &Param::Str(" [1, 0] ".into())), Ok(AttrValue::Ints(vec![1, 0])));
        assert_eq!(attr_value("m", &axes, &Param::Str("[]".into())), Ok(AttrValue::Ints(vec![])));
        let axis = AttrSpec { default: Some(AttrValue::Int(-1)), ..axes };
        let error = attr_value("m", &axis, &Param::Ints(vec![1, 2])).expect_err("a list for an int");
        assert!(error.message.ends_with("got [1, 2]"), "{}", error.message);
        let error = attr_value("m", &axis, &Param::Str("x".into())).expect_err("a string for an int");
        assert!(error.message.ends_with("got \"x\""), "{}", error.message);
    }
}
