//! The one-entry memo of operators' pure functions (shape functions, input-dtype rules): a
//! loop calls an operator with one signature over and over, and a repeat then skips the call
//! and the conversions around it (for plugins, a trip through the C ABI).

use std::sync::Mutex;

use smallvec::SmallVec;

use crate::error::Result;
use crate::schema::{Attrs, Meta};

/// One call of a pure function of the inputs' metas and the attributes, and its result.
#[derive(Debug)]
pub(crate) struct Memo<T> {
    inputs: SmallVec<[Option<Meta>; 4]>,
    attrs: Attrs,
    value: T,
}

impl<T: Clone> Memo<T> {
    /// The remembered result for these arguments, or `compute`'s (then remembered).
    /// `try_lock`: under contention, computing beats waiting.
    pub(crate) fn through(
        cell: &Mutex<Option<Memo<T>>>,
        inputs: &[Option<Meta>],
        attrs: &Attrs,
        compute: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if let Ok(memo) = cell.try_lock() {
            if let Some(memo) = memo.as_ref().filter(|m| m.inputs.as_slice() == inputs && m.attrs.same_as(attrs)) {
                return Ok(memo.value.clone());
            }
        }
        let value = compute()?;
        if let Ok(mut memo) = cell.try_lock() {
            *memo = Some(Memo { inputs: inputs.iter().cloned().collect(), attrs: attrs.clone(), value: value.clone() });
        }
        Ok(value)
    }
}
