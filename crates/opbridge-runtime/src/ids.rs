//! Plain identifiers of devices and device memory: [`DeviceKind`], [`DeviceId`] and
//! [`DevicePtr`]. No behaviour beyond naming, parsing and DLPack codes, so that errors, devices,
//! tensors (and, later, a server) can all name a device without depending on each other.

use std::fmt;

use opbridge_dtype::dlpack;

/// The family of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    Ascend,
}

impl DeviceKind {
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Ascend => "ascend",
        }
    }

    /// DLPack's `DLDeviceType` code for this kind: `kDLCPU` = 1, `kDLCUDA` = 2, `kDLAscend` = 21
    /// (DLPack's dedicated Ascend type; torch_npu still uses `kDLExtDev` = 12).
    pub const fn dlpack_code(self) -> i32 {
        match self {
            DeviceKind::Cpu => dlpack::kDLCPU,
            DeviceKind::Cuda => dlpack::kDLCUDA,
            DeviceKind::Ascend => dlpack::kDLAscend,
        }
    }
}

/// A device: kind plus ordinal, written `cpu:0`, `cuda:1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub kind: DeviceKind,
    pub index: usize,
}

impl DeviceId {
    pub const CPU: DeviceId = DeviceId { kind: DeviceKind::Cpu, index: 0 };

    /// Parses `"cpu"`, `"cpu:0"`, `"cuda:1"`.
    pub fn parse(text: &str) -> Option<DeviceId> {
        let (kind, index) = match text.split_once(':') {
            Some((k, i)) => (k, i.parse().ok()?),
            None => (text, 0),
        };
        let kind = match kind {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            "ascend" | "npu" => DeviceKind::Ascend,
            _ => return None,
        };
        Some(DeviceId { kind, index })
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind.name(), self.index)
    }
}

/// An address in a device's memory. Plain data: it is never dereferenced outside a kernel or
/// copy running on that device, so holding one is always safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub usize);

impl DevicePtr {
    pub const fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}
