//! Element types the runtime knows, their sizes, and numpy's promotion rules for `a + b`
//! (tested beside the definition, in `opbridge-dtype`).
//!
//! The type is `opbridge_dtype::DType` (a crate without dependencies, which the plugin SDK
//! re-exports): the runtime, the built-in operators and plugins share one definition.

pub use opbridge_dtype::DType;
