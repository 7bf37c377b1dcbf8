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
//! use opbridge_plugin_sdk::{export_plugin, Attr, Attrs, DType, Error, Meta, Op, Result, Tensor, TensorMut};
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
//!     fn infer(inputs: &[Meta], _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
//!         Ok(vec![inputs[0].clone()])
//!     }
//!
//!     fn run(inputs: &[Tensor<'_>], outputs: &mut [TensorMut<'_>], attrs: &Attrs<'_>, _ws: &mut [u8]) -> Result<()> {
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
//! The crate has no dependencies and knows nothing of opbridge's runtime: it speaks only the C
//! ABI, which it declares itself in [`sys`].

pub mod sys;
mod tensor;

#[doc(hidden)]
pub mod __private;

use std::ffi::{c_char, CStr};
use std::fmt;

pub use tensor::{Element, Tensor, TensorMut, Values};

/// The plugin ABI version this crate speaks.
pub const ABI_VERSION: u32 = sys::OPBRIDGE_PLUGIN_ABI_VERSION;

/// Element types opbridge passes to plugins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    F32,
    F64,
    I32,
    I64,
}

impl DType {
    /// numpy's name (`"float32"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub const fn to_dl(self) -> sys::DLDataType {
        let (code, bits) = match self {
            DType::F16 => (sys::kDLFloat, 16),
            DType::F32 => (sys::kDLFloat, 32),
            DType::F64 => (sys::kDLFloat, 64),
            DType::I32 => (sys::kDLInt, 32),
            DType::I64 => (sys::kDLInt, 64),
        };
        sys::DLDataType { code, bits, lanes: 1 }
    }

    pub fn from_dl(t: sys::DLDataType) -> Option<DType> {
        [DType::F16, DType::F32, DType::F64, DType::I32, DType::I64].into_iter().find(|d| d.to_dl() == t)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
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

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

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

/// The kinds of attribute the ABI passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrKind {
    Int,
    Float,
    Bool,
}

/// An attribute declaration: `Attr::float("alpha", 1.0)`, `Attr::int("axis", 0).required()`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attr {
    pub name: &'static str,
    pub kind: AttrKind,
    pub required: bool,
    pub default_int: i64,
    pub default_float: f64,
    pub doc: &'static str,
}

impl Attr {
    pub const fn int(name: &'static str, default: i64) -> Attr {
        Attr { name, kind: AttrKind::Int, required: false, default_int: default, default_float: 0.0, doc: "" }
    }

    pub const fn float(name: &'static str, default: f64) -> Attr {
        Attr { name, kind: AttrKind::Float, required: false, default_int: 0, default_float: default, doc: "" }
    }

    pub const fn bool(name: &'static str, default: bool) -> Attr {
        Attr { name, kind: AttrKind::Bool, required: false, default_int: default as i64, default_float: 0.0, doc: "" }
    }

    /// No default: callers must pass the attribute.
    pub const fn required(mut self) -> Attr {
        self.required = true;
        self
    }

    /// One line of documentation.
    pub const fn doc(mut self, doc: &'static str) -> Attr {
        self.doc = doc;
        self
    }
}

/// An attribute's value in a call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrValue {
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// A call's attributes (every declared one, defaults filled in by opbridge).
#[derive(Debug, Clone, Copy)]
pub struct Attrs<'a> {
    values: &'a [sys::OpbAttrValue],
    names: &'a [*const c_char],
}

impl<'a> Attrs<'a> {
    /// # Safety
    /// `attrs` is null or points at an `OpbAttrs` whose arrays hold `count` valid entries and
    /// NUL-terminated names, all alive for `'a`.
    pub(crate) unsafe fn from_c(attrs: *const sys::OpbAttrs) -> Attrs<'a> {
        // SAFETY: the caller's obligations.
        match unsafe { attrs.as_ref() } {
            Some(a) if a.count > 0 && !a.values.is_null() && !a.names.is_null() => Attrs {
                // SAFETY: the caller's obligations.
                values: unsafe { std::slice::from_raw_parts(a.values, a.count) },
                // SAFETY: the caller's obligations.
                names: unsafe { std::slice::from_raw_parts(a.names, a.count) },
            },
            _ => Attrs { values: &[], names: &[] },
        }
    }

    /// The attribute `name`, if the operator declares it.
    pub fn get(&self, name: &str) -> Option<AttrValue> {
        let i = self.names.iter().position(|&p| {
            // SAFETY: `from_c`'s contract: every name is a valid C string for `'a`.
            !p.is_null() && unsafe { CStr::from_ptr(p) }.to_bytes() == name.as_bytes()
        })?;
        let v = &self.values[i];
        Some(match v.kind {
            sys::OPB_ATTR_FLOAT => AttrValue::Float(v.f),
            sys::OPB_ATTR_BOOL => AttrValue::Bool(v.i != 0),
            _ => AttrValue::Int(v.i),
        })
    }

    fn missing(name: &str, kind: &str) -> Error {
        Error::invalid_argument(format!("attribute {name:?} is not declared as {kind}"))
    }

    pub fn float(&self, name: &str) -> Result<f64> {
        match self.get(name) {
            Some(AttrValue::Float(f)) => Ok(f),
            _ => Err(Attrs::missing(name, "a float")),
        }
    }

    pub fn int(&self, name: &str) -> Result<i64> {
        match self.get(name) {
            Some(AttrValue::Int(i)) => Ok(i),
            _ => Err(Attrs::missing(name, "an int")),
        }
    }

    pub fn bool(&self, name: &str) -> Result<bool> {
        match self.get(name) {
            Some(AttrValue::Bool(b)) => Ok(b),
            _ => Err(Attrs::missing(name, "a bool")),
        }
    }
}

/// Computes an operator's workspace size from its inputs and attributes (see [`Op::WORKSPACE`]).
pub type WorkspaceFn = fn(inputs: &[Meta], attrs: &Attrs<'_>) -> usize;

/// One operator version of a plugin. Implement it on a unit struct and list the type in
/// [`export_plugin!`].
pub trait Op: 'static {
    /// `[A-Za-z_][A-Za-z0-9_]*`.
    const NAME: &'static str;
    /// Starts at 1; several versions of one name may live in one library.
    const VERSION: u32;
    /// The docstring Python's `help()` shows.
    const DOC: &'static str = "";
    /// Input names (all inputs are required).
    const INPUTS: &'static [&'static str];
    const OUTPUTS: &'static [&'static str] = &["out"];
    const ATTRS: &'static [Attr] = &[];
    /// dtypes the inputs may have; opbridge rejects others before calling `infer`.
    const DTYPES: &'static [DType];

    /// The shape function: checks the inputs and returns one `Meta` per output. A pure
    /// function of its arguments: opbridge may reuse an earlier result for equal arguments.
    fn infer(inputs: &[Meta], attrs: &Attrs<'_>) -> Result<Vec<Meta>>;

    /// Bytes of scratch memory `run` needs for these inputs (given as `workspace`, 64-byte
    /// aligned); `None` (the default): no workspace.
    const WORKSPACE: Option<WorkspaceFn> = None;

    /// The CPU kernel. Inputs may have any strides; outputs are contiguous, of the metas `infer`
    /// returned, and never overlap the inputs.
    fn run(inputs: &[Tensor<'_>], outputs: &mut [TensorMut<'_>], attrs: &Attrs<'_>, workspace: &mut [u8])
        -> Result<()>;
}

/// Generates `opbridge_plugin_init` for a list of [`Op`] types:
/// `export_plugin!("my_ops": ScaleAddV1, ScaleAddV2);` (the library name is optional).
#[macro_export]
macro_rules! export_plugin {
    (@emit $name:expr, $($op:ty),+) => {
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
            // SAFETY: forwarded from the loader, which passes valid pointers.
            unsafe {
                $crate::__private::init(host, info, &PLUGIN, $name, || {
                    ::std::vec![$($crate::__private::describe::<$op>()),+]
                })
            }
        }
    };
    ($name:literal : $($op:ty),+ $(,)?) => {
        $crate::export_plugin!(@emit $name, $($op),+);
    };
    ($($op:ty),+ $(,)?) => {
        $crate::export_plugin!(@emit ::std::env!("CARGO_PKG_NAME"), $($op),+);
    };
}
