//! opbridge operators: schemas and the registry, the one call path below every front end
//! ([`dispatch`]: plan, run on host memory, launch on a stream), the built-in operators and
//! their CPU kernels, and the plugin loader. No Python and no async runtime: the bindings and
//! the server both stand on this crate.

pub mod builtins;
pub mod cpu;
pub mod device;
pub mod dispatch;
pub mod error;
pub mod hybrid;
mod memo;
pub mod native;
pub mod plugin;
pub mod registry;
pub mod schema;
pub mod tuning;
pub mod view;
mod workspace;

pub use builtins::{global, register_builtins};
pub use cpu::thresholds::ELEMENTWISE_PARALLEL_MIN_ELEMS as PARALLEL_MIN_ELEMS;
pub use dispatch::Plan;
pub use error::{ErrorKind, OpError, Result};
pub use registry::{Entry, Operator, Registry, Source};
pub use schema::{AttrValue, Attrs, Meta, Schema};
pub use view::{overlap, Overlap, TensorView};
