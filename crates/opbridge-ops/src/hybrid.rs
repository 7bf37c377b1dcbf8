//! Hybrid dispatch (the seed's `HybridOperator`, measured instead of `if n < 1024`): a numpy
//! call with `device="auto"` runs on the host kernel, or on an accelerator with its copies, by
//! a crossover size measured per operator and dtype on this machine (`ob.calibrate()`).
//!
//! The table is filled by the caller (the Python package loads the saved measurements; a test
//! may force a crossover). Each entry remembers the device it was measured on (its chip and
//! driver library, [`identity`]): an entry whose device has changed since is not used, and
//! [`explain`] says so. With no usable entry a call stays on the host, which never needs the
//! driver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock};

use opbridge_runtime::backend::DeviceReport;
use opbridge_runtime::{DType, DeviceId};

/// One measured crossover: from `elems` elements on, the device (copies included) beat the
/// host; `None` when it never did in the measured range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossover {
    pub device: DeviceId,
    pub dtype: DType,
    pub elems: Option<usize>,
    /// The device the measurement was made on, as [`identity`] gives it.
    pub identity: String,
}

/// Where a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Host,
    Device(DeviceId),
}

impl Route {
    /// `host`, or the device's name (`ascend:0`): the profiler's and metrics' `path` label.
    pub fn label(&self) -> String {
        match self {
            Route::Host => "host".into(),
            Route::Device(id) => id.to_string(),
        }
    }

    /// [`Route::label`] without an allocation for the common ones (`host`, `ascend:0`,
    /// `cuda:0`); other devices' names are made.
    pub fn label_str(&self) -> std::borrow::Cow<'static, str> {
        use opbridge_runtime::DeviceKind;
        match self {
            Route::Host => "host".into(),
            Route::Device(DeviceId { kind: DeviceKind::Ascend, index: 0 }) => "ascend:0".into(),
            Route::Device(DeviceId { kind: DeviceKind::Cuda, index: 0 }) => "cuda:0".into(),
            Route::Device(id) => id.to_string().into(),
        }
    }
}

#[derive(Default)]
struct Table {
    /// Crossovers by operator name.
    by_op: HashMap<String, Vec<Crossover>>,
}

/// Per dtype (in `DType::ALL`'s order), the smallest crossover of any operator: a call below it
/// goes to the host after one atomic load, without the table's lock or a hash of the op's name
/// (what keeps `device="auto"` as cheap as the host path on small calls). `usize::MAX`: none.
static FLOOR: [AtomicUsize; 5] = [const { AtomicUsize::new(usize::MAX) }; 5];

fn floor_slot(dtype: DType) -> &'static AtomicUsize {
    let at = DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0);
    &FLOOR[at]
}

/// Recomputes [`FLOOR`] from the table (under its write lock, so floors never lag an entry).
fn refresh_floors(table: &Table) {
    for dtype in DType::ALL {
        let min = table.by_op.values().flatten().filter(|c| c.dtype == dtype).filter_map(|c| c.elems).min();
        floor_slot(dtype).store(min.unwrap_or(usize::MAX), Ordering::Release);
    }
}

fn table() -> &'static RwLock<Table> {
    static TABLE: OnceLock<RwLock<Table>> = OnceLock::new();
    TABLE.get_or_init(RwLock::default)
}

/// What identifies a device for its measurements: its chip, the driver library loaded and its
/// version (`Ascend910B1 via /usr/local/Ascend/.../libascendcl.so (runtime 1.0.0)`); `None` for an
/// unavailable device.
pub fn identity_of(report: &DeviceReport) -> Option<String> {
    if !report.available {
        return None;
    }
    // The library's real path: a folder reached through a symbolic link (CANN's `latest`) or
    // spelled with `./` is the same library.
    let library = report
        .library
        .as_deref()
        .map(|l| std::fs::canonicalize(l).map_or_else(|_| l.to_string(), |p| p.display().to_string()));
    Some(format!(
        "{} via {} (runtime {})",
        report.soc.as_deref().unwrap_or("unknown chip"),
        library.as_deref().unwrap_or("unknown library"),
        report.driver_version.as_deref().unwrap_or("unknown")
    ))
}

/// The identity of `device` now (asks its backend only, which starts the driver on first use).
pub fn identity(device: DeviceId) -> Option<String> {
    let backend = opbridge_runtime::backend::find(device.kind)?;
    backend.devices().iter().find(|r| r.index == Some(device.index)).and_then(identity_of)
}

/// Identities already asked for, per device and fork generation (a fork's child asks again:
/// the parent's driver is not its own); forgotten whenever the table changes.
fn seen() -> &'static RwLock<Identities> {
    static SEEN: OnceLock<RwLock<Identities>> = OnceLock::new();
    SEEN.get_or_init(RwLock::default)
}

/// A device's identity (`None`: unavailable) by device and fork generation.
type Identities = HashMap<(DeviceId, u64), Option<String>>;

/// The identity of an entry's device now, asked once per device (see [`seen`]).
fn current_identity(device: DeviceId) -> Option<String> {
    let key = (device, opbridge_runtime::fork::generation());
    if let Some(known) = seen().read().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return known.clone();
    }
    let now = identity(device);
    seen().write().unwrap_or_else(|p| p.into_inner()).insert(key, now.clone());
    now
}

/// Sets (or, with `elems` `None`, records "the device never wins") the crossover of `op` in
/// `dtype` on `device`, measured on the device `identity` names. Replaces an earlier entry.
pub fn set(op: &str, crossover: Crossover) {
    let mut table = table().write().unwrap_or_else(|p| p.into_inner());
    let entries = table.by_op.entry(op.to_string()).or_default();
    entries.retain(|c| !(c.device == crossover.device && c.dtype == crossover.dtype));
    entries.push(crossover);
    refresh_floors(&table);
    drop(table);
    seen().write().unwrap_or_else(|p| p.into_inner()).clear();
}

/// [`set`] for many entries at once (a saved file): the floors are recomputed once.
pub fn set_all(entries: Vec<(String, Crossover)>) {
    let mut table = table().write().unwrap_or_else(|p| p.into_inner());
    for (op, crossover) in entries {
        let list = table.by_op.entry(op).or_default();
        list.retain(|c| !(c.device == crossover.device && c.dtype == crossover.dtype));
        list.push(crossover);
    }
    refresh_floors(&table);
    drop(table);
    seen().write().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Forgets every crossover (calls with `device="auto"` then stay on the host).
pub fn clear() {
    let mut table = table().write().unwrap_or_else(|p| p.into_inner());
    table.by_op.clear();
    refresh_floors(&table);
    drop(table);
    seen().write().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Every crossover, by operator name.
pub fn entries() -> Vec<(String, Crossover)> {
    let table = table().read().unwrap_or_else(|p| p.into_inner());
    let mut all: Vec<(String, Crossover)> =
        table.by_op.iter().flat_map(|(op, list)| list.iter().map(move |c| (op.clone(), c.clone()))).collect();
    all.sort_by(|a, b| (&a.0, a.1.dtype.name(), a.1.device).cmp(&(&b.0, b.1.dtype.name(), b.1.device)));
    all
}

/// Where a call of `op` on `elems` elements of `dtype` runs: the device whose measured
/// crossover is the lowest one at or below `elems`, else the host. Costs a table lookup on
/// the host path (no allocation); the device's identity is asked once per device.
pub fn route(op: &str, dtype: DType, elems: usize) -> Route {
    if elems < floor_slot(dtype).load(Ordering::Acquire) {
        return Route::Host; // below every crossover of this dtype (or none measured)
    }
    let reachable: smallvec::SmallVec<[Crossover; 2]> = {
        let table = table().read().unwrap_or_else(|p| p.into_inner());
        let Some(list) = table.by_op.get(op) else { return Route::Host };
        if !list.iter().any(|c| c.dtype == dtype && c.elems.is_some_and(|n| elems >= n)) {
            return Route::Host; // the common case: no allocation, no identity check
        }
        list.iter().filter(|c| c.dtype == dtype).cloned().collect()
    };
    // Identities are asked outside the table's lock (the first ask may start a driver).
    match pick(&reachable, dtype, elems) {
        Pick::Device(c) => Route::Device(c.device),
        _ => Route::Host,
    }
}

enum Pick<'a> {
    /// The lowest reachable crossover of a device that is still the one measured.
    Device(&'a Crossover),
    /// A reachable crossover whose device has changed since (its identity now).
    Changed(&'a Crossover, Option<String>),
    /// None reachable.
    None,
}

fn pick(list: &[Crossover], dtype: DType, elems: usize) -> Pick<'_> {
    let mut reachable: smallvec::SmallVec<[&Crossover; 4]> =
        list.iter().filter(|c| c.dtype == dtype && c.elems.is_some_and(|n| elems >= n)).collect();
    reachable.sort_by_key(|c| c.elems);
    let mut changed = Pick::None;
    for c in reachable {
        let now = current_identity(c.device);
        if now.as_deref() == Some(c.identity.as_str()) {
            return Pick::Device(c);
        }
        if matches!(changed, Pick::None) {
            changed = Pick::Changed(c, now);
        }
    }
    changed
}

/// [`route`], and why, in words (`ob.explain`).
pub fn explain(op: &str, dtype: DType, elems: usize) -> (Route, String) {
    let (route, why) = decide(op, dtype, elems);
    (route, why.describe(op, dtype, elems))
}

/// The reason behind a route, formatted only when asked for.
enum Why {
    Uncalibrated,
    Measured(Crossover),
    NeverFaster(Vec<Crossover>),
    Below(Vec<Crossover>),
    Changed(Crossover, Option<String>),
}

impl Why {
    fn describe(self, op: &str, dtype: DType, elems: usize) -> String {
        let what = format!("{op} on {elems} element(s) of {}", dtype.name());
        let list = |cs: &[Crossover]| -> String {
            cs.iter()
                .map(|c| match c.elems {
                    Some(n) => format!("{} from {n}", c.device),
                    None => format!("{} never (slower at every size measured)", c.device),
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Why::Uncalibrated => format!(
                "host: {what}; no crossover measured for {op} in {} on any device (run ob.calibrate())",
                dtype.name()
            ),
            Why::Measured(c) => format!(
                "{}: {what} is at or above the measured crossover of {} elements on {} ({})",
                c.device,
                c.elems.unwrap_or(0),
                c.device,
                c.identity
            ),
            Why::NeverFaster(cs) => format!("host: {what}; the device was never faster: {}", list(&cs)),
            Why::Below(cs) => format!("host: {what} is below the measured crossover: {}", list(&cs)),
            Why::Changed(c, now) => format!(
                "host: {what}; the crossover for {} was measured on {}, but the device is now {} (run ob.calibrate())",
                c.device,
                c.identity,
                now.as_deref().unwrap_or("unavailable")
            ),
        }
    }
}

fn decide(op: &str, dtype: DType, elems: usize) -> (Route, Why) {
    let candidates: Vec<Crossover> = {
        let table = table().read().unwrap_or_else(|p| p.into_inner());
        table.by_op.get(op).map(|list| list.iter().filter(|c| c.dtype == dtype).cloned().collect()).unwrap_or_default()
    };
    if candidates.is_empty() {
        return (Route::Host, Why::Uncalibrated);
    }
    match pick(&candidates, dtype, elems) {
        Pick::Device(c) => (Route::Device(c.device), Why::Measured(c.clone())),
        Pick::Changed(c, now) => (Route::Host, Why::Changed(c.clone(), now)),
        Pick::None if candidates.iter().all(|c| c.elems.is_none()) => (Route::Host, Why::NeverFaster(candidates)),
        Pick::None => (Route::Host, Why::Below(candidates)),
    }
}
