//! A call's attributes: read from the C arrays a plugin receives (`OpbAttrs`), or from the
//! host's own storage when an operator is compiled into it.
#![allow(unsafe_code)] // reads the C attribute arrays under `Attrs::from_c`'s contract

use std::ffi::{c_char, CStr};
use std::fmt;

use crate::{sys, Error, Result};

/// An attribute's value in a call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrValue<'a> {
    None,
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(&'a str),
    Ints(&'a [i64]),
}

/// Python's spelling (`None`, `True`, `2.0`, `"sum"`, `[1, 2]`), as in error messages.
impl fmt::Display for AttrValue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::None => f.write_str("None"),
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Float(x) => write!(f, "{x:?}"),
            AttrValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            AttrValue::Str(s) => write!(f, "{s:?}"),
            AttrValue::Ints(v) => write!(f, "{v:?}"),
        }
    }
}

/// Where a host keeps a call's attributes when it calls an operator compiled into it (no C
/// arrays in between). Not for plugin authors.
#[doc(hidden)]
pub trait AttrLookup: Sync {
    fn lookup(&self, name: &str) -> Option<AttrValue<'_>>;
}

/// A call's attributes (every declared one, defaults filled in by opbridge).
#[derive(Clone, Copy)]
pub struct Attrs<'a> {
    source: AttrSource<'a>,
}

#[derive(Clone, Copy)]
enum AttrSource<'a> {
    C { values: &'a [sys::OpbAttrValue], names: &'a [*const c_char] },
    Host(&'a dyn AttrLookup),
}

impl fmt::Debug for Attrs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            AttrSource::C { values, .. } => write!(f, "Attrs({} from C)", values.len()),
            AttrSource::Host(_) => f.write_str("Attrs(host)"),
        }
    }
}

impl<'a> Attrs<'a> {
    /// # Safety
    /// `attrs` is null or points at an `OpbAttrs` whose arrays hold `count` valid entries,
    /// NUL-terminated names, and string and list values valid as the header says, all alive
    /// for `'a`.
    pub(crate) unsafe fn from_c(attrs: *const sys::OpbAttrs) -> Attrs<'a> {
        // SAFETY: the caller's obligations.
        let source = match unsafe { attrs.as_ref() } {
            Some(a) if a.count > 0 && !a.values.is_null() && !a.names.is_null() => AttrSource::C {
                // SAFETY: the caller's obligations.
                values: unsafe { std::slice::from_raw_parts(a.values, a.count) },
                // SAFETY: the caller's obligations.
                names: unsafe { std::slice::from_raw_parts(a.names, a.count) },
            },
            _ => AttrSource::C { values: &[], names: &[] },
        };
        Attrs { source }
    }

    /// Attributes a host holds itself (see [`AttrLookup`]).
    #[doc(hidden)]
    pub fn from_host(lookup: &'a dyn AttrLookup) -> Attrs<'a> {
        Attrs { source: AttrSource::Host(lookup) }
    }

    /// The attribute `name`, if the operator declares it.
    pub fn get(&self, name: &str) -> Option<AttrValue<'a>> {
        let (values, names) = match self.source {
            AttrSource::Host(lookup) => return lookup.lookup(name),
            AttrSource::C { values, names } => (values, names),
        };
        let i = names.iter().position(|&p| {
            // SAFETY: `from_c`'s contract: every name is a valid C string for `'a`.
            !p.is_null() && unsafe { CStr::from_ptr(p) }.to_bytes() == name.as_bytes()
        })?;
        let v = &values[i];
        if v.is_none != 0 {
            return Some(AttrValue::None);
        }
        Some(match v.kind {
            sys::OPB_ATTR_FLOAT => AttrValue::Float(v.f),
            sys::OPB_ATTR_BOOL => AttrValue::Bool(v.i != 0),
            sys::OPB_ATTR_STR if v.s.is_null() => AttrValue::Str(""),
            sys::OPB_ATTR_STR => {
                // SAFETY: `from_c`'s contract: a NUL-terminated string alive for `'a`.
                let bytes = unsafe { CStr::from_ptr(v.s) }.to_bytes();
                AttrValue::Str(std::str::from_utf8(bytes).ok()?)
            }
            sys::OPB_ATTR_INTS => match usize::try_from(v.n_ints) {
                Ok(n) if n > 0 && !v.ints.is_null() => {
                    // SAFETY: `from_c`'s contract: `n_ints` entries alive for `'a`.
                    AttrValue::Ints(unsafe { std::slice::from_raw_parts(v.ints, n) })
                }
                _ => AttrValue::Ints(&[]),
            },
            _ => AttrValue::Int(v.i),
        })
    }

    fn wrong(&self, name: &str, kind: &str) -> Error {
        match self.get(name) {
            None => Error::invalid_argument(format!("the operator declares no attribute {name:?}")),
            Some(value) => Error::invalid_argument(format!("expected {name} to be {kind}, got {value}")),
        }
    }

    /// Whether the attribute is `None`.
    pub fn is_none(&self, name: &str) -> bool {
        matches!(self.get(name), Some(AttrValue::None))
    }

    pub fn int(&self, name: &str) -> Result<i64> {
        match self.get(name) {
            Some(AttrValue::Int(i)) => Ok(i),
            Some(AttrValue::Bool(b)) => Ok(b as i64),
            _ => Err(self.wrong(name, "an int")),
        }
    }

    /// A float (an int attribute reads as one too).
    pub fn float(&self, name: &str) -> Result<f64> {
        match self.get(name) {
            Some(AttrValue::Float(f)) => Ok(f),
            Some(AttrValue::Int(i)) => Ok(i as f64),
            _ => Err(self.wrong(name, "a float")),
        }
    }

    pub fn bool(&self, name: &str) -> Result<bool> {
        match self.get(name) {
            Some(AttrValue::Bool(b)) => Ok(b),
            _ => Err(self.wrong(name, "a bool")),
        }
    }

    pub fn str(&self, name: &str) -> Result<&'a str> {
        match self.get(name) {
            Some(AttrValue::Str(s)) => Ok(s),
            _ => Err(self.wrong(name, "a string")),
        }
    }

    pub fn ints(&self, name: &str) -> Result<&'a [i64]> {
        match self.get(name) {
            Some(AttrValue::Ints(v)) => Ok(v),
            _ => Err(self.wrong(name, "a list of ints")),
        }
    }

    /// An int that may be `None` (`axis=None`).
    pub fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        if self.is_none(name) {
            return Ok(None);
        }
        self.int(name).map(Some)
    }

    pub fn opt_float(&self, name: &str) -> Result<Option<f64>> {
        if self.is_none(name) {
            return Ok(None);
        }
        self.float(name).map(Some)
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>> {
        if self.is_none(name) {
            return Ok(None);
        }
        self.str(name).map(Some)
    }

    pub fn opt_ints(&self, name: &str) -> Result<Option<&'a [i64]>> {
        if self.is_none(name) {
            return Ok(None);
        }
        self.ints(name).map(Some)
    }
}
