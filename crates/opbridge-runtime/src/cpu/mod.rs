//! The CPU device: the embedded default and a real device, not a mock. Each stream is an
//! ordered work queue served by its own worker thread; events are completion points in those
//! queues; memory is 64-byte-aligned host memory handed to the caching pool.

mod event;
mod memory;
mod stream;

use std::sync::Arc;

use crate::device::{Device, EventBackend, StreamBackend};
use crate::error::Result;
use crate::ids::{DeviceId, DevicePtr};

pub use event::CpuEvent;
pub(crate) use stream::on_worker;
pub use stream::CpuStream;

/// The CPU device. Stateless: streams own their workers, the pool owns the memory.
#[derive(Debug, Default)]
pub struct CpuDevice;

impl Device for CpuDevice {
    fn id(&self) -> DeviceId {
        DeviceId::CPU
    }

    fn host_accessible(&self) -> bool {
        true
    }

    fn allocate_raw(&self, bytes: usize) -> Result<DevicePtr> {
        memory::allocate(bytes)
    }

    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        memory::free(ptr, bytes);
        Ok(())
    }

    fn allocate_pinned(&self, bytes: usize) -> Result<DevicePtr> {
        memory::allocate(bytes)
    }

    fn free_pinned(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        memory::free(ptr, bytes);
        Ok(())
    }

    fn create_stream(&self) -> Result<Arc<dyn StreamBackend>> {
        Ok(Arc::new(CpuStream::spawn()?))
    }

    fn create_event(&self) -> Result<Arc<dyn EventBackend>> {
        Ok(Arc::new(CpuEvent::default()))
    }
}
