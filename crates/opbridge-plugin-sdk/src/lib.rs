//! Write opbridge operator libraries in safe Rust.
//!
//! An operator is a type implementing [`Op`]: constants describe it (name, version, inputs,
//! attributes, dtypes), `infer` is its shape function and `run` its CPU kernel over typed,
//! bounds-checked views. [`export_plugin!`] generates the library's C entry point,
//! `opbridge_plugin_init`, with every callback wrapped so that errors become status codes and
//! messages (and panics never cross the C boundary). Build the crate as a `cdylib` and load it
//! with `opbridge.load_library(path)`.
//!
//! ```
//! use opbridge_plugin_sdk::{export_plugin, Attr, Attrs, DType, Inputs, Meta, Op, Result, Tensor, TensorMut};
//!
//! /// out = x * factor
//! struct Scale;
//!
//! impl Op for Scale {
//!     const NAME: &'static str = "scale";
//!     const VERSION: u32 = 1;
//!     const DOC: &'static str = "Multiplies every element by `factor`.";
//!     const INPUTS: &'static [&'static str] = &["x"];
//!     const ATTRS: &'static [Attr] = &[Attr::float("factor", 1.0)];
//!     const DTYPES: &'static [DType] = &[DType::F32];
//!
//!     fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
//!         Ok(vec![inputs[0].clone()])
//!     }
//!
//!     fn run(inputs: &Inputs<'_, Tensor<'_>>, outputs: &mut [TensorMut<'_>], attrs: &Attrs<'_>, _ws: &mut [u8]) -> Result<()> {
//!         let factor = attrs.float("factor")? as f32;
//!         let out = outputs[0].as_mut_slice::<f32>()?;
//!         for (o, x) in out.iter_mut().zip(inputs[0].values::<f32>()?) {
//!             *o = x * factor;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! export_plugin!("example": Scale);
//! ```
//!
//! opbridge's own built-in operators implement this same [`Op`] trait; the host registers them
//! in-process, through the same descriptor validation a loaded library goes through.
//!
//! The crate has no third-party dependencies and knows nothing of opbridge's runtime: it speaks
//! only the C ABI, which it declares itself in [`sys`] (the DLPack part and [`DType`] come from
//! `opbridge-dtype`, a crate without dependencies).

mod attrs;
mod device;
pub mod sys;
mod tensor;

#[doc(hidden)]
pub mod __private;

use std::fmt;

pub use attrs::{AttrLookup, AttrValue, Attrs};
pub use device::{Device, DeviceLaunch, DeviceTensor};
/// The element type: `opbridge-dtype`'s, shared with opbridge's runtime (built-in operators and
/// plugins speak one vocabulary).
pub use opbridge_dtype::DType;
pub use tensor::{Element, Tensor, TensorMut, Values};

#[doc(hidden)]
pub use __private::{describe, Described};

/// The plugin ABI version this crate speaks.
pub const ABI_VERSION: u32 = sys::OPBRIDGE_PLUGIN_ABI_VERSION;

/// What an error becomes in Python (the `OpbStatus` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// `opbridge.ArgumentError` (a `ValueError`).
    InvalidArgument,
    /// `opbridge.ShapeError` (a `ValueError`).
    Shape,
    /// `opbridge.DTypeError` (a `TypeError`).
    DType,
    /// Any other failure (raised like built-in kernels' errors: `opbridge.ArgumentError` today).
    Failed,
}

impl Status {
    pub const fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::OPB_ERR_INVALID_ARGUMENT,
            Status::Shape => sys::OPB_ERR_SHAPE,
            Status::DType => sys::OPB_ERR_DTYPE,
            Status::Failed => sys::OPB_ERR_FAILED,
        }
    }
}

/// An error of a shape function or kernel: a status and a message for the Python exception.
///
/// An operator compiled into the host (`opbridge_ops::native`) may attach the host's own error
/// as the cause; the host then raises exactly that error. Across the C ABI only the status and
/// the message travel.
#[derive(Debug)]
pub struct Error {
    pub status: Status,
    pub message: String,
    cause: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into(), cause: None }
    }

    /// An error that carries the error it stands for (see the type's documentation).
    pub fn with_cause(
        status: Status,
        message: impl Into<String>,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Error {
        Error { status, message: message.into(), cause: Some(cause.into()) }
    }

    /// The attached cause, taken out of the error.
    pub fn into_cause(self) -> Option<Box<dyn std::error::Error + Send + Sync>> {
        self.cause
    }

    pub fn shape(message: impl Into<String>) -> Error {
        Error::new(Status::Shape, message)
    }

    pub fn dtype(message: impl Into<String>) -> Error {
        Error::new(Status::DType, message)
    }

    pub fn invalid_argument(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }

    pub fn failed(message: impl Into<String>) -> Error {
        Error::new(Status::Failed, message)
    }
}

/// A clone keeps the status and the message, not the cause.
impl Clone for Error {
    fn clone(&self) -> Error {
        Error::new(self.status, self.message.clone())
    }
}

/// Errors are equal when their status and message are.
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.status == other.status && self.message == other.message
    }
}

impl Eq for Error {}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_deref().map(|c| c as &(dyn std::error::Error + 'static))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// dtype and shape of a tensor, without data: what shape functions take and return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Meta {
    pub fn new(dtype: DType, shape: &[usize]) -> Meta {
        Meta { dtype, shape: shape.to_vec() }
    }
}

/// An optional input the caller left out is `None`; required inputs are always there.
///
/// `inputs[i]` gives input `i` and panics if it is absent, which only an input declared in
/// [`Op::OPTIONAL_INPUTS`] can be: read those with [`Inputs::opt`].
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a, T> {
    items: &'a [Option<T>],
}

impl<'a, T> Inputs<'a, T> {
    pub fn new(items: &'a [Option<T>]) -> Inputs<'a, T> {
        Inputs { items }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Input `i`, or `None` if the caller left it out (or there is no input `i`).
    pub fn opt(&self, i: usize) -> Option<&'a T> {
        self.items.get(i).and_then(Option::as_ref)
    }

    /// Input `i`, or an error saying it is absent.
    pub fn get(&self, i: usize) -> Result<&'a T> {
        self.opt(i).ok_or_else(|| Error::invalid_argument(format!("input {i} was not passed")))
    }

    /// Every input in order, `None` for those left out.
    pub fn iter(&self) -> impl Iterator<Item = Option<&'a T>> + 'a {
        self.items.iter().map(Option::as_ref)
    }

    pub fn as_slice(&self) -> &'a [Option<T>] {
        self.items
    }
}

impl<T> std::ops::Index<usize> for Inputs<'_, T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        match self.items.get(i) {
            Some(Some(input)) => input,
            Some(None) => panic!("input {i} was not passed (it is optional: read it with Inputs::opt)"),
            None => panic!("input {i} out of range: the operator has {} inputs", self.items.len()),
        }
    }
}

/// The kinds of attribute the ABI passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrKind {
    Int,
    Float,
    Bool,
    /// A string (a numpy dtype passed from Python arrives as its name).
    Str,
    /// A list of ints (a Python tuple or list).
    Ints,
}

/// An attribute declaration: `Attr::float("alpha", 1.0)`, `Attr::int("axis", 0).required()`,
/// `Attr::int("axis", 0).default_none()` (`axis=None`), `Attr::str("mode", "sum")`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attr {
    pub name: &'static str,
    pub kind: AttrKind,
    pub required: bool,
    /// `None` is a value the caller may pass.
    pub nullable: bool,
    /// The default is `None` (then `nullable` too).
    pub default_none: bool,
    pub default_int: i64,
    pub default_float: f64,
    pub default_str: &'static str,
    pub default_ints: &'static [i64],
    pub doc: &'static str,
}

impl Attr {
    const fn of(name: &'static str, kind: AttrKind) -> Attr {
        Attr {
            name,
            kind,
            required: false,
            nullable: false,
            default_none: false,
            default_int: 0,
            default_float: 0.0,
            default_str: "",
            default_ints: &[],
            doc: "",
        }
    }

    pub const fn int(name: &'static str, default: i64) -> Attr {
        Attr { default_int: default, ..Attr::of(name, AttrKind::Int) }
    }

    pub const fn float(name: &'static str, default: f64) -> Attr {
        Attr { default_float: default, ..Attr::of(name, AttrKind::Float) }
    }

    pub const fn bool(name: &'static str, default: bool) -> Attr {
        Attr { default_int: default as i64, ..Attr::of(name, AttrKind::Bool) }
    }

    pub const fn str(name: &'static str, default: &'static str) -> Attr {
        Attr { default_str: default, ..Attr::of(name, AttrKind::Str) }
    }

    pub const fn ints(name: &'static str, default: &'static [i64]) -> Attr {
        Attr { default_ints: default, ..Attr::of(name, AttrKind::Ints) }
    }

    /// No default: callers must pass the attribute.
    pub const fn required(mut self) -> Attr {
        self.required = true;
        self
    }

    /// Callers may pass `None`.
    pub const fn nullable(mut self) -> Attr {
        self.nullable = true;
        self
    }

    /// The default is `None` (callers may pass `None` too).
    pub const fn default_none(mut self) -> Attr {
        self.nullable = true;
        self.default_none = true;
        self
    }

    /// One line of documentation.
    pub const fn doc(mut self, doc: &'static str) -> Attr {
        self.doc = doc;
        self
    }
}

/// Computes an operator's workspace size from its inputs and attributes (see [`Op::WORKSPACE`]).
/// Pure, like [`Op::infer`].
pub type WorkspaceFn = fn(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> usize;

/// Chooses the dtype each input is converted to before [`Op::run`] (see [`Op::INPUT_DTYPES`]):
/// one entry per input, `None` for absent ones.
pub type InputDtypesFn = fn(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> Result<Vec<Option<DType>>>;

/// The opt-in to in-place calls ([`Op::IN_PLACE`]):
/// `const IN_PLACE: Option<InPlace> = Some(unsafe { InPlace::new() });`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InPlace(());

impl InPlace {
    /// # Safety
    /// With it, `run` may receive an output whose memory is exactly an input's. `run` must then
    /// never hold a reference into that input (a slice from [`Tensor::as_slice`], or a
    /// [`Tensor::values`] iterator) while a reference into the output
    /// ([`TensorMut::as_mut_slice`]) is alive, or write the output through anything but
    /// the raw pointers ([`Tensor::as_ptr`], [`TensorMut::as_mut_ptr`]) while reading the input.
    /// Reading the whole input into a buffer first, or working on raw pointers, is fine.
    #[allow(unsafe_code)] // an `unsafe fn` only to make the caller accept the contract above
    pub const unsafe fn new() -> InPlace {
        InPlace(())
    }
}

/// One operator version. Implement it on a unit struct and list the type in
/// [`export_plugin!`] (a plugin), or register it in a host with `opbridge_ops::native`
/// (opbridge's built-in operators are written this way).
pub trait Op: 'static {
    /// `[A-Za-z_][A-Za-z0-9_]*`.
    const NAME: &'static str;
    /// Starts at 1; several versions of one name may live in one library.
    const VERSION: u32;
    /// The docstring Python's `help()` shows.
    const DOC: &'static str = "";
    /// Input names, in call order.
    const INPUTS: &'static [&'static str];
    /// Inputs (named in `INPUTS`) the caller may leave out or pass as `None`; they reach `infer`
    /// and `run` as absent (see [`Inputs::opt`]).
    const OPTIONAL_INPUTS: &'static [&'static str] = &[];
    const OUTPUTS: &'static [&'static str] = &["out"];
    const ATTRS: &'static [Attr] = &[];
    /// dtypes the inputs may have; opbridge rejects others before calling `infer`.
    const DTYPES: &'static [DType];
    /// Inputs (by name) that take fewer dtypes than `DTYPES` (an index input of an integer
    /// dtype only, say), for the operator's documentation: `infer` still checks them. Read by a
    /// host that registers the operator in-process; the C ABI does not carry it.
    const INPUT_DTYPE_SETS: &'static [(&'static str, &'static [DType])] = &[];
    /// The dtypes inputs are converted to before `run` (numpy's promotion, for instance);
    /// `None` (the default): inputs keep their dtypes. `infer` sees the caller's dtypes. Pure,
    /// like `infer`.
    const INPUT_DTYPES: Option<InputDtypesFn> = None;
    /// Whether an output may be exactly an input of the same dtype and shape (`out=x` in
    /// Python, for elementwise operators); `None` (the default): outputs never overlap inputs.
    /// Opting in is `unsafe` (see [`InPlace::new`]): the input and output views then cover the
    /// same memory, which safe slices of both would alias.
    const IN_PLACE: Option<InPlace> = None;

    /// The shape function: checks the inputs and returns one `Meta` per output. A pure
    /// function of its arguments: opbridge may reuse an earlier result for equal arguments.
    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> Result<Vec<Meta>>;

    /// Bytes of scratch memory `run` needs for these inputs (given as `workspace`, 64-byte
    /// aligned); `None` (the default): no workspace. Pure, like `infer`: the host allocates what it
    /// returns for a call, and `run` receives exactly those bytes (in a plugin, none if it panicked).
    const WORKSPACE: Option<WorkspaceFn> = None;

    /// The CPU kernel. Inputs may have any strides; outputs are contiguous, of the metas `infer`
    /// returned, and never overlap the inputs (but see [`Op::IN_PLACE`]).
    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        workspace: &mut [u8],
    ) -> Result<()>;

    /// Accelerators this operator has a kernel on ([`Op::run_device`]); empty (the default):
    /// the CPU only.
    const DEVICES: &'static [Device] = &[];

    /// Whether [`Op::run`] is a kernel. `false` for an operator of `DEVICES` only: its `run` is
    /// never called, and a call on the CPU is a device error that names the devices it has.
    const CPU: bool = true;

    /// The kernel on a device of [`Op::DEVICES`]: the same contract as [`Op::run`] (inputs in
    /// the dtypes of `INPUT_DTYPES`, any strides; outputs contiguous, of the inferred metas),
    /// over device memory. It enqueues the work on `launch.stream()` through the vendor's API
    /// and returns without waiting; opbridge keeps the tensors and the workspace alive until the
    /// work has run. An error returned here fails the call; a failure of the enqueued work is
    /// the stream's, raised by its next synchronize.
    fn run_device(
        inputs: &Inputs<'_, DeviceTensor>,
        outputs: &[DeviceTensor],
        attrs: &Attrs<'_>,
        launch: &DeviceLaunch,
    ) -> Result<()> {
        let _ = (inputs, outputs, attrs);
        Err(Error::failed(format!("{} declares no kernel on {}", Self::NAME, launch.device().name())))
    }
}

/// Generates `opbridge_plugin_init` for a list of [`Op`] types:
/// `export_plugin!("my_ops": ScaleAddV1, ScaleAddV2);` (the library name is optional). With
/// `; release = my_release` after the list, `fn my_release()` runs once before the library is
/// closed, after the last call of its operators (device work included): free what the kernels
/// set up lazily there (loaded kernel binaries, device buffers). A panic in it is caught.
///
/// ```
/// # use opbridge_plugin_sdk::{export_plugin, Attrs, DType, Inputs, Meta, Op, Result, Tensor, TensorMut};
/// # struct Copy1;
/// # impl Op for Copy1 {
/// #     const NAME: &'static str = "copy1";
/// #     const VERSION: u32 = 1;
/// #     const INPUTS: &'static [&'static str] = &["x"];
/// #     const DTYPES: &'static [DType] = &[DType::F32];
/// #     fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> Result<Vec<Meta>> { Ok(vec![inputs[0].clone()]) }
/// #     fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> { Ok(()) }
/// # }
/// fn free_device_buffers() { /* aclrtFree what the kernels allocated */ }
///
/// export_plugin!("my_ops": Copy1; release = free_device_buffers);
/// ```
#[macro_export]
macro_rules! export_plugin {
    (@emit $name:expr, [$($release:path)?], $($op:ty),+) => {
        /// The opbridge plugin entry point (generated by `opbridge_plugin_sdk::export_plugin!`).
        ///
        /// # Safety
        /// Called by opbridge's loader with a valid host description and a zeroed info struct.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn opbridge_plugin_init(
            host: *const $crate::sys::OpbPluginHost,
            info: *mut $crate::sys::OpbPluginInfo,
        ) -> ::std::ffi::c_int {
            static PLUGIN: $crate::__private::PluginCell = $crate::__private::PluginCell::new();
            #[allow(unused_mut)]
            let mut release: ::std::option::Option<$crate::sys::OpbReleaseFn> = None;
            $(
                unsafe extern "C" fn __opbridge_release() {
                    // Nothing may unwind into the host.
                    let _ = ::std::panic::catch_unwind(|| $release());
                }
                release = Some(__opbridge_release);
            )?
            // SAFETY: forwarded from the loader, which passes valid pointers.
            unsafe {
                $crate::__private::init(host, info, &PLUGIN, $name, release, || {
                    ::std::vec![$($crate::__private::describe::<$op>()),+]
                })
            }
        }
    };
    ($name:literal : $($op:ty),+ ; release = $release:path $(,)?) => {
        $crate::export_plugin!(@emit $name, [$release], $($op),+);
    };
    ($name:literal : $($op:ty),+ $(,)?) => {
        $crate::export_plugin!(@emit $name, [], $($op),+);
    };
    ($($op:ty),+ $(,)?) => {
        $crate::export_plugin!(@emit ::std::env!("CARGO_PKG_NAME"), [], $($op),+);
    };
}
