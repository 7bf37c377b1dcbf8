//! The binding's foreign interfaces: numpy's C API and DLPack. All `unsafe` of the bindings
//! lives here, behind safe functions.
#![allow(unsafe_code)]

pub mod dlpack;
pub mod numpy;
