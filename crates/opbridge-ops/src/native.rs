//! Operators compiled into the host, written against the plugin SDK's [`Op`](sdk::Op) trait:
//! the API plugin authors use. opbridge's built-in operators are all declared this way.
//!
//! [`op`] describes the type exactly as `export_plugin!` would for a library, and validates the
//! descriptor with the loader's own checks, so a built-in cannot declare what a plugin could not.
//! Calls then go straight to the trait's functions (no C trampolines): attributes are read from
//! the host's [`Attrs`] through [`sdk::AttrLookup`], and tensors are SDK views of the registry's
//! [`TensorView`]s. An error a built-in raises with a host [`OpError`] travels as the SDK
//! error's cause and comes back unchanged; a plain SDK error maps by status like a plugin's.
//!
//! Elementwise operators may add the host's fast lane ([`Native::with_lane`]); it is an
//! optimization of calls the trait's functions describe completely, and must agree with them.
#![allow(unsafe_code)] // SDK views over the registry's views; each site says why it holds.

use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use opbridge_plugin_sdk as sdk;
use opbridge_runtime::DType;
use smallvec::SmallVec;

use crate::error::{ErrorKind, OpError, Result};
use crate::memo::Memo;
use crate::plugin::result::{self, OpSpec};
use crate::registry::{Batching, Entry, Lane, Operator, Registry, Source, ViewLane};
use crate::schema::{AttrValue, Attrs, Meta, Schema};
use crate::view::TensorView;

/// An [`sdk::Op`] type as a registry [`Operator`].
pub struct Native<O: sdk::Op> {
    spec: OpSpec,
    lane: Option<Lane>,
    view_lane: Option<ViewLane>,
    batching: Option<Batching>,
    value_check: Option<crate::registry::HostValueCheck>,
    /// The last shape-function and input-dtype calls (the SDK requires both to be pure): a
    /// loop calls an operator with one signature over and over, and a repeat then skips the
    /// conversions to SDK metas (which allocate) and the call.
    infer_memo: Mutex<Option<Memo<Vec<Meta>>>>,
    dtypes_memo: Mutex<Option<Memo<Vec<Option<DType>>>>>,
    _op: PhantomData<fn() -> O>,
}

impl<O: sdk::Op> std::fmt::Debug for Native<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Native({} v{})", O::NAME, O::VERSION)
    }
}

/// Describes and validates `O` (see the module documentation).
pub fn op<O: sdk::Op>() -> Result<Native<O>> {
    let invalid = |message: String| OpError::InvalidOperator { name: O::NAME.to_string(), message };
    let described = catch_unwind(sdk::describe::<O>).map_err(|panic| invalid(panic_text(&*panic)))?;
    // SAFETY: every pointer of the descriptor points into `described` (or statics), alive and
    // unchanged for the call; `validate` copies what it keeps.
    let mut spec = unsafe { result::validate(described.desc(), sdk::ABI_VERSION) }.map_err(invalid)?;
    if spec.kernel.is_none() || !spec.device_kernels.is_empty() {
        // Built-ins' accelerator kernels are registered by backends (`crate::device`).
        return Err(invalid("an in-process operator has a CPU kernel and no device kernels".into()));
    }
    for &(input, dtypes) in O::INPUT_DTYPE_SETS {
        let Some(spec) = spec.schema.inputs.iter_mut().find(|i| i.name == input) else {
            return Err(invalid(format!("INPUT_DTYPE_SETS names {input:?}, which is not an input")));
        };
        if dtypes.is_empty() || dtypes.iter().any(|d| !O::DTYPES.contains(d)) {
            return Err(invalid(format!("INPUT_DTYPE_SETS for {input:?} must be a non-empty subset of DTYPES")));
        }
        spec.dtypes = dtypes.to_vec();
    }
    Ok(Native {
        spec,
        lane: None,
        view_lane: None,
        batching: None,
        value_check: None,
        infer_memo: Mutex::new(None),
        dtypes_memo: Mutex::new(None),
        _op: PhantomData,
    })
}

/// Registers `O` in `registry` (see [`op`]).
pub fn register<O: sdk::Op>(registry: &Registry, source: Source) -> Result<Arc<Entry>> {
    registry.register(Arc::new(op::<O>()?), source)
}

impl<O: sdk::Op> Native<O> {
    /// Adds the elementwise fast lane (see [`Lane`]).
    pub fn with_lane(
        mut self,
        accepts: impl Fn(DType) -> bool + Send + Sync + 'static,
        run: impl Fn(DType, &[usize], usize, usize) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.lane = Some(Lane { accepts: Box::new(accepts), promote: None, run: Box::new(run) });
        self
    }

    /// Lets the elementwise lane take two inputs of different dtypes, converted first to
    /// `promote(a, b)`: only for operators whose input-dtype rule is exactly that.
    pub fn with_lane_promotion(mut self, promote: fn(DType, DType) -> DType) -> Self {
        if let Some(lane) = self.lane.as_mut() {
            lane.promote = Some(promote);
        }
        self
    }

    /// Adds the strided-view fast lane (see [`ViewLane`]).
    pub fn with_view_lane(mut self, lane: ViewLane) -> Self {
        self.view_lane = Some(lane);
        self
    }

    /// Declares how calls merge along axis 0 (see [`Batching`]): only for operators whose rows
    /// are computed independently, bit for bit (tested for every built-in that declares it).
    pub fn with_batching(mut self, batching: Batching) -> Self {
        self.batching = Some(batching);
        self
    }

    /// Adds the value checks a host makes before a device runs the call (see
    /// [`Operator::check_host_values`]).
    pub fn with_value_check(mut self, check: crate::registry::HostValueCheck) -> Self {
        self.value_check = Some(check);
        self
    }

    fn name(&self) -> &str {
        O::NAME
    }
}

impl<O: sdk::Op> Operator for Native<O> {
    fn schema(&self) -> &Schema {
        &self.spec.schema
    }

    fn input_dtypes(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Option<DType>>> {
        let Some(choose) = O::INPUT_DTYPES else {
            return Ok(inputs.iter().map(|m| m.as_ref().map(|m| m.dtype)).collect());
        };
        Memo::through(&self.dtypes_memo, inputs, attrs, || {
            self.spec.check_attrs(attrs)?;
            let metas = sdk_metas(inputs);
            let wanted = guarded(O::NAME, || {
                choose(&sdk::Inputs::new(&metas), &sdk::Attrs::from_host(attrs)).map_err(|e| host_error(O::NAME, e))
            })?;
            if wanted.len() != inputs.len() {
                return Err(OpError::Kernel {
                    op: self.name().into(),
                    message: format!("INPUT_DTYPES returned {} dtypes for {} inputs", wanted.len(), inputs.len()),
                });
            }
            // `None` for a present input keeps its dtype, as in the C ABI's prefilled array.
            let chosen: Vec<Option<DType>> = inputs
                .iter()
                .zip(wanted)
                .map(|(input, dtype)| input.as_ref().map(|m| dtype.unwrap_or(m.dtype)))
                .collect();
            self.spec.check_chosen_dtypes(inputs, &chosen)?;
            Ok(chosen)
        })
    }

    fn infer(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Vec<Meta>> {
        // A remembered call had equal attribute values, which passed the check then.
        Memo::through(&self.infer_memo, inputs, attrs, || {
            self.spec.check_attrs(attrs)?;
            let metas = sdk_metas(inputs);
            let outputs = guarded(O::NAME, || {
                O::infer(&sdk::Inputs::new(&metas), &sdk::Attrs::from_host(attrs)).map_err(|e| host_error(O::NAME, e))
            })?;
            let declared = self.spec.schema.outputs.len();
            if outputs.len() != declared {
                return Err(OpError::Kernel {
                    op: self.name().into(),
                    message: format!("infer returned {} outputs; the operator declares {declared}", outputs.len()),
                });
            }
            Ok(outputs.into_iter().map(|m| Meta { dtype: m.dtype, shape: m.shape.into() }).collect())
        })
    }

    fn needs_workspace(&self) -> bool {
        O::WORKSPACE.is_some()
    }

    fn workspace_size(&self, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<usize> {
        let Some(size) = O::WORKSPACE else { return Ok(0) };
        let metas = sdk_metas(inputs);
        let attrs = sdk::Attrs::from_host(attrs);
        guarded(O::NAME, || Ok(size(&sdk::Inputs::new(&metas), &attrs)))
    }

    fn run_cpu_in(
        &self,
        inputs: &[Option<TensorView>],
        outputs: &[TensorView],
        attrs: &Attrs,
        workspace: &mut [u8],
    ) -> Result<()> {
        let bad = |e: sdk::Error| host_error(O::NAME, e);
        let ins: SmallVec<[Option<sdk::Tensor<'_>>; 4]> = inputs
            .iter()
            .map(|v| {
                v.as_ref()
                    .map(|v| {
                        // SAFETY: the registry's contract: the view describes memory valid and
                        // unchanged for the kernel call, which outlives these SDK views.
                        unsafe { sdk::Tensor::from_raw_parts(v.data as *const u8, v.dtype, &v.shape, &v.strides) }
                    })
                    .transpose()
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(bad)?;
        let mut outs: SmallVec<[sdk::TensorMut<'_>; 2]> = outputs
            .iter()
            .map(|v| {
                // SAFETY: the registry's contract: outputs are contiguous, writable, and overlap
                // no input unless the operator allows exactly that (`Op::IN_PLACE`).
                unsafe { sdk::TensorMut::from_raw_parts(v.data as *mut u8, v.dtype, &v.shape, &v.strides) }
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(bad)?;
        let inputs = sdk::Inputs::new(&ins);
        let attrs = sdk::Attrs::from_host(attrs);
        guarded(O::NAME, || O::run(&inputs, &mut outs, &attrs, workspace).map_err(bad))
    }

    fn in_place_ok(&self) -> bool {
        O::IN_PLACE.is_some()
    }

    fn lane(&self) -> Option<&Lane> {
        self.lane.as_ref()
    }

    fn view_lane(&self) -> Option<&ViewLane> {
        self.view_lane.as_ref()
    }

    fn batching(&self) -> Option<Batching> {
        self.batching
    }

    fn check_host_values(&self, inputs: &[Option<(&[u8], Meta)>], attrs: &Attrs) -> Result<()> {
        match self.value_check {
            Some(check) => check(inputs, attrs),
            None => Ok(()),
        }
    }
}

/// Runs an operator's function, turning a panic (`inputs[i]` of an absent input, say) into
/// an error, as the plugin trampolines do: a kernel bug never unwinds through the runtime.
fn guarded<T>(op: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(OpError::Kernel { op: op.to_string().into(), message: format!("panicked: {}", panic_text(&*panic)) })
    })
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
    text.unwrap_or_else(|| "unknown panic".into())
}

fn sdk_metas(inputs: &[Option<Meta>]) -> SmallVec<[Option<sdk::Meta>; 4]> {
    inputs.iter().map(|m| m.as_ref().map(|m| sdk::Meta::new(m.dtype, &m.shape))).collect()
}

/// The host's attribute values, read by an in-process operator through [`sdk::Attrs`].
impl sdk::AttrLookup for Attrs {
    fn lookup(&self, name: &str) -> Option<sdk::AttrValue<'_>> {
        Some(match self.get(name)? {
            AttrValue::None => sdk::AttrValue::None,
            AttrValue::Bool(b) => sdk::AttrValue::Bool(*b),
            AttrValue::Int(i) => sdk::AttrValue::Int(*i),
            AttrValue::Float(x) => sdk::AttrValue::Float(*x),
            AttrValue::Str(s) => sdk::AttrValue::Str(s),
            AttrValue::Ints(v) => sdk::AttrValue::Ints(v),
        })
    }
}

/// A host error inside an SDK error: its status and text for the ABI, itself as the cause.
impl From<OpError> for sdk::Error {
    fn from(error: OpError) -> sdk::Error {
        let status = match error.kind() {
            ErrorKind::Shape => sdk::Status::Shape,
            ErrorKind::DType => sdk::Status::DType,
            // A kernel's refusal travels as `Failed`, as a plugin kernel's does.
            ErrorKind::Argument if !matches!(error, OpError::Kernel { .. } | OpError::CpuKernel { .. }) => {
                sdk::Status::InvalidArgument
            }
            _ => sdk::Status::Failed,
        };
        sdk::Error::with_cause(status, error.to_string(), error)
    }
}

/// The host error an SDK error stands for: its cause if it carries one, else by status (as a
/// plugin's error is mapped).
pub fn host_error(op: &str, error: sdk::Error) -> OpError {
    let (status, message) = (error.status, error.message.clone());
    match error.into_cause().map(|cause| cause.downcast::<OpError>()) {
        Some(Ok(host)) => *host,
        Some(Err(other)) => match other.downcast::<opbridge_runtime::Error>() {
            Ok(runtime) => OpError::Runtime(*runtime),
            Err(_) => result::status_error(op, status.code(), message),
        },
        None => result::status_error(op, status.code(), message),
    }
}

/// The registry's view of an SDK input (for built-in kernels, which work on [`TensorView`]s).
pub fn view(t: &sdk::Tensor<'_>) -> TensorView {
    TensorView { data: t.as_ptr() as usize, dtype: t.dtype(), shape: t.shape().into(), strides: t.strides().into() }
}

/// The registry's view of an SDK output.
pub fn view_mut(t: &mut sdk::TensorMut<'_>) -> TensorView {
    TensorView { data: t.as_mut_ptr() as usize, dtype: t.dtype(), shape: t.shape().into(), strides: t.strides().into() }
}
