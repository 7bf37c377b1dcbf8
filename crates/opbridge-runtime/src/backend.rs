//! Accelerator backends plug in here. The runtime cannot depend on them (they depend on it, to
//! implement [`Device`]), so each backend crate registers itself once at start-up (the Python
//! module and the server do it) and [`crate::DeviceContext::get`] opens its devices on first use.

use std::sync::{Arc, Mutex};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ids::{DeviceId, DeviceKind};

/// What `opbridge.devices()` and `opbridge doctor` show of one device, or of a whole backend
/// that cannot serve (then `index` is `None` and `reason` says why).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    pub kind: DeviceKind,
    pub index: Option<usize>,
    pub available: bool,
    /// Why the backend or device cannot serve, with what was tried.
    pub reason: Option<String>,
    /// The chip's name as the driver gives it (`Ascend910B1`).
    pub soc: Option<String>,
    /// Total device memory, as the driver reports it.
    pub memory_bytes: Option<u64>,
    /// The driver library that was loaded.
    pub library: Option<String>,
    /// The driver's version as it reports it (ACL's `aclrtGetVersion`: `1.0.0`), if it does.
    pub driver_version: Option<String>,
}

impl DeviceReport {
    /// `ascend:0`, or `ascend` for a backend-wide report.
    pub fn name(&self) -> String {
        match self.index {
            Some(index) => DeviceId { kind: self.kind, index }.to_string(),
            None => self.kind.name().to_string(),
        }
    }
}

/// An accelerator backend: finds its devices and opens them.
pub trait Backend: Send + Sync + 'static {
    fn kind(&self) -> DeviceKind;

    /// The devices this machine has, or one unavailable report saying why there are none.
    /// Loads the driver on first call; never fails.
    fn devices(&self) -> Vec<DeviceReport>;

    /// Opens device `index` (called once per device for the life of the process).
    fn open(&self, index: usize) -> Result<Arc<dyn Device>>;
}

static BACKENDS: Mutex<Vec<&'static dyn Backend>> = Mutex::new(Vec::new());

/// Registers `backend` (a second registration of the same kind is ignored).
pub fn register(backend: &'static dyn Backend) {
    let mut backends = BACKENDS.lock().unwrap_or_else(|p| p.into_inner());
    if !backends.iter().any(|b| b.kind() == backend.kind()) {
        backends.push(backend);
    }
}

/// The registered backend of `kind`.
pub fn find(kind: DeviceKind) -> Option<&'static dyn Backend> {
    BACKENDS.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().find(|b| b.kind() == kind)
}

/// Every device: `cpu:0` first, then each registered backend's reports.
pub fn reports() -> Vec<DeviceReport> {
    let cpu = DeviceReport {
        kind: DeviceKind::Cpu,
        index: Some(0),
        available: true,
        reason: None,
        soc: None,
        memory_bytes: None,
        library: None,
        driver_version: None,
    };
    let backends: Vec<&'static dyn Backend> = BACKENDS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    std::iter::once(cpu).chain(backends.iter().flat_map(|b| b.devices())).collect()
}

/// Opens `id` through its backend, or says why it cannot be.
pub(crate) fn open(id: DeviceId) -> Result<Arc<dyn Device>> {
    let Some(backend) = find(id.kind) else {
        return Err(Error::Unavailable { device: id, reason: format!("this build has no {} backend", id.kind.name()) });
    };
    backend.open(id.index)
}
