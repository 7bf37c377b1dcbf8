//! Operator schemas: what an operator takes (inputs, attributes with defaults), what it gives,
//! and which dtypes it accepts. The registry, the Python binding and the plugin ABI all read
//! the same description.

use std::fmt;
use std::sync::{Arc, OnceLock};

use opbridge_runtime::DType;
use smallvec::SmallVec;

use crate::error::{OpError, Result};

/// A value of an attribute (a non-tensor argument).
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Ints(Vec<i64>),
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::None => f.write_str("None"),
            AttrValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Float(x) => write!(f, "{x:?}"),
            AttrValue::Str(s) => write!(f, "{s:?}"),
            AttrValue::Ints(v) => write!(f, "{v:?}"),
        }
    }
}

/// An attribute: name, default (`None` = required) and a line of documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct AttrSpec {
    pub name: String,
    pub default: Option<AttrValue>,
    pub doc: String,
    /// A float attribute: a front end converts an integer given for it (of any size) to a
    /// float, as Python's `float()` does.
    pub takes_float: bool,
}

/// A tensor input; optional ones may be passed as `None` (e.g. layer_norm's weight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    pub name: String,
    pub optional: bool,
    /// The dtypes this input takes when fewer than the schema's `dtypes` (empty: those);
    /// documentation, the operator's shape function checks them.
    pub dtypes: Vec<DType>,
}

impl InputSpec {
    /// The dtypes this input takes, given the operator's.
    pub fn dtypes<'a>(&'a self, schema_dtypes: &'a [DType]) -> &'a [DType] {
        if self.dtypes.is_empty() {
            schema_dtypes
        } else {
            &self.dtypes
        }
    }
}

/// The full description of one version of an operator.
#[derive(Debug, Clone, PartialEq)]
pub struct Schema {
    pub name: String,
    pub version: u32,
    pub doc: String,
    pub inputs: Vec<InputSpec>,
    pub outputs: Vec<String>,
    pub attrs: Vec<AttrSpec>,
    /// dtypes the inputs may have.
    pub dtypes: Vec<DType>,
    /// The operator and attribute names every call's [`Attrs`] share, made on the first call
    /// (so a call copies no strings). Schemas are not changed once registered.
    pub(crate) shared: SharedNames,
}

/// Names shared between a schema and its calls' [`Attrs`]; a cache, so equal by definition.
#[derive(Debug, Clone, Default)]
pub(crate) struct SharedNames(OnceLock<(Arc<str>, Arc<[String]>)>);

impl PartialEq for SharedNames {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Schema {
    /// `name(a, b, /, *, axis=-1, out=None)`: the Python signature.
    pub fn signature(&self) -> String {
        let mut parts: Vec<String> =
            self.inputs.iter().map(|i| if i.optional { format!("{}=None", i.name) } else { i.name.clone() }).collect();
        parts.push("*".into());
        for attr in &self.attrs {
            parts.push(match &attr.default {
                Some(default) => format!("{}={default}", attr.name),
                None => attr.name.clone(),
            });
        }
        parts.push("out=None".into());
        format!("{}({})", self.name, parts.join(", "))
    }

    /// Completes `given` (name, value) pairs with defaults; unknown or missing names are errors
    /// that list what the operator takes.
    pub fn bind_attrs<K: AsRef<str>>(&self, given: impl IntoIterator<Item = (K, AttrValue)>) -> Result<Attrs> {
        let given: SmallVec<[(K, AttrValue); 4]> = given.into_iter().collect();
        for (name, _) in &given {
            if !self.attrs.iter().any(|a| a.name == name.as_ref()) {
                let known: Vec<&str> = self.attrs.iter().map(|a| a.name.as_str()).collect();
                return Err(OpError::UnknownAttribute {
                    op: self.name.clone(),
                    name: name.as_ref().to_string(),
                    known: known.join(", "),
                });
            }
        }
        let mut values = SmallVec::with_capacity(self.attrs.len());
        for spec in &self.attrs {
            let value = match given.iter().find(|(n, _)| n.as_ref() == spec.name) {
                Some((_, v)) => v.clone(),
                None => spec
                    .default
                    .clone()
                    .ok_or_else(|| OpError::MissingAttribute { op: self.name.clone(), name: spec.name.clone() })?,
            };
            values.push(value);
        }
        let (op, names) = self
            .shared
            .0
            .get_or_init(|| (Arc::from(self.name.as_str()), self.attrs.iter().map(|a| a.name.clone()).collect()));
        Ok(Attrs { op: Arc::clone(op), names: Arc::clone(names), values })
    }
}

/// An operator call's attribute values, complete (defaults filled in) and in schema order.
#[derive(Debug, Clone, PartialEq)]
pub struct Attrs {
    op: Arc<str>,
    /// The schema's attribute names (shared, not copied per call).
    names: Arc<[String]>,
    values: SmallVec<[AttrValue; 4]>,
}

impl Default for Attrs {
    fn default() -> Attrs {
        Attrs { op: Arc::from(""), names: Arc::from(Vec::new()), values: SmallVec::new() }
    }
}

impl Attrs {
    /// `(name, value)` pairs in schema order.
    pub fn values(&self) -> impl Iterator<Item = (&str, &AttrValue)> {
        self.names.iter().map(String::as_str).zip(&self.values)
    }

    /// Whether `other` holds the same values for the same names, floats compared by bits (to a
    /// pure function of the attributes `-0.0` is not `0.0`, and a NaN is itself). Attributes
    /// bound by one schema share its names, so the usual test is a pointer comparison.
    pub fn same_as(&self, other: &Attrs) -> bool {
        let same_value = |a: &AttrValue, b: &AttrValue| match (a, b) {
            (AttrValue::Float(x), AttrValue::Float(y)) => x.to_bits() == y.to_bits(),
            _ => a == b,
        };
        (Arc::ptr_eq(&self.names, &other.names) || self.names == other.names)
            && self.values.len() == other.values.len()
            && self.values.iter().zip(&other.values).all(|(a, b)| same_value(a, b))
    }

    pub fn get(&self, name: &str) -> Option<&AttrValue> {
        self.names.iter().position(|n| n == name).map(|i| &self.values[i])
    }

    fn wrong(&self, name: &str, expected: &str) -> OpError {
        OpError::InvalidAttribute {
            op: self.op.to_string(),
            message: format!(
                "expected {name} to be {expected}, got {}",
                self.get(name).map_or_else(|| "nothing".to_string(), AttrValue::to_string)
            ),
        }
    }

    pub fn int(&self, name: &str) -> Result<i64> {
        match self.get(name) {
            Some(AttrValue::Int(i)) => Ok(*i),
            Some(AttrValue::Bool(b)) => Ok(*b as i64),
            _ => Err(self.wrong(name, "an int")),
        }
    }

    /// An int that may be `None` (e.g. `axis=None` for "all axes").
    pub fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        match self.get(name) {
            Some(AttrValue::None) => Ok(None),
            _ => self.int(name).map(Some),
        }
    }

    pub fn float(&self, name: &str) -> Result<f64> {
        match self.get(name) {
            Some(AttrValue::Float(x)) => Ok(*x),
            Some(AttrValue::Int(i)) => Ok(*i as f64),
            _ => Err(self.wrong(name, "a float")),
        }
    }

    pub fn bool(&self, name: &str) -> Result<bool> {
        match self.get(name) {
            Some(AttrValue::Bool(b)) => Ok(*b),
            _ => Err(self.wrong(name, "a bool")),
        }
    }

    pub fn str(&self, name: &str) -> Result<&str> {
        match self.get(name) {
            Some(AttrValue::Str(s)) => Ok(s),
            _ => Err(self.wrong(name, "a string")),
        }
    }
}

/// dtype and shape of a tensor, without its data: what shape functions work on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub dtype: DType,
    pub shape: crate::view::Dims,
}

impl Meta {
    pub fn new(dtype: DType, shape: &[usize]) -> Meta {
        Meta { dtype, shape: shape.into() }
    }
}
