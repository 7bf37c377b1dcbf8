//! opbridge's device runtime: devices, streams, events, the caching memory pool and tensors.
//! It knows nothing of operators, Python or async runtimes (see DESIGN.md, "Layers").

pub mod backend;
pub mod cpu;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fork;
pub mod ids;
pub mod memory;
pub mod pipeline;
pub mod profiler;
pub mod stream;
pub mod tensor;
pub mod transfer;

use std::sync::{Arc, OnceLock};

pub use device::{CopyKind, Device, HostFn};
pub use dtype::DType;
pub use error::{AsyncError, Error, ErrorKind, Result};
pub use ids::{DeviceId, DeviceKind, DevicePtr};
pub use memory::{Allocate, Buffer, ChildPool, HostBytes, MemoryPool, PoolStats, SubBuffer, ALIGNMENT};
pub use stream::{
    current_stream, enter_stream, on_stream_worker, set_current_stream, CallSite, Event, Launch, Mark, Stream,
    StreamContext, StreamId, StreamUse,
};
pub use tensor::{Storage, Tensor};
pub use transfer::PendingDownload;

use memory::pool::Source;
use stream::StreamRegistry;

/// One device with its caching pools and the registry of its streams. One per device for the
/// life of the process.
#[derive(Debug)]
pub struct DeviceContext {
    device: Arc<dyn Device>,
    streams: Arc<StreamRegistry>,
    pool: Arc<MemoryPool>,
    pinned: Arc<MemoryPool>,
    /// H2D, compute and D2H streams of the staged numpy path, made on first use (and again in
    /// the child of a `fork()`, where the parent's have no workers).
    pipeline: std::sync::Mutex<Option<[Stream; 3]>>,
    /// Held by one staged call at a time: the three streams are shared, and a call learns of its
    /// own failures by synchronizing them (another call's would otherwise become its own).
    pub(crate) pipeline_turn: std::sync::Mutex<()>,
    /// The staged path's chunk size, measured on first use (`pipeline::chunk_bytes`).
    pub(crate) staged_chunk_bytes: OnceLock<usize>,
}

impl std::fmt::Debug for StreamRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamRegistry")
    }
}

impl DeviceContext {
    fn new(device: Arc<dyn Device>) -> DeviceContext {
        let streams = Arc::new(StreamRegistry::default());
        let pool = Arc::new(MemoryPool::new(Arc::clone(&device), Source::Device, Arc::clone(&streams)));
        let pinned = Arc::new(MemoryPool::new(Arc::clone(&device), Source::Pinned, Arc::clone(&streams)));
        streams.add_pool(&pool);
        streams.add_pool(&pinned);
        DeviceContext {
            device,
            streams,
            pool,
            pinned,
            pipeline: std::sync::Mutex::new(None),
            pipeline_turn: std::sync::Mutex::new(()),
            staged_chunk_bytes: OnceLock::new(),
        }
    }

    /// The context of a device. `cpu:0` always exists; accelerators are opened through the
    /// backend registered for their kind (see [`backend`]).
    pub fn get(id: DeviceId) -> Result<&'static Arc<DeviceContext>> {
        static CPU: OnceLock<Arc<DeviceContext>> = OnceLock::new();
        if id == DeviceId::CPU {
            return Ok(CPU.get_or_init(|| {
                fork::register();
                Arc::new(DeviceContext::new(Arc::new(cpu::CpuDevice)))
            }));
        }
        // Accelerators: opened through their backend on first use, then kept for the process
        // (as `cpu:0`). A device that fails to open is tried again on the next call: a driver
        // library that appears later (a test that points the loader at it) is then found.
        static OPENED: std::sync::Mutex<Vec<&'static Arc<DeviceContext>>> = std::sync::Mutex::new(Vec::new());
        let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = opened.iter().find(|ctx| ctx.id() == id) {
            return Ok(ctx);
        }
        let device = backend::open(id)?;
        let ctx: &'static Arc<DeviceContext> = Box::leak(Box::new(Arc::new(DeviceContext::new(device))));
        opened.push(ctx);
        Ok(ctx)
    }

    /// The embedded default device.
    pub fn cpu() -> &'static Arc<DeviceContext> {
        DeviceContext::get(DeviceId::CPU).expect("cpu:0 always exists")
    }

    pub fn id(&self) -> DeviceId {
        self.device.id()
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The caching pool of device memory.
    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// The caching pool of pinned host memory used for staging copies.
    pub fn pinned_pool(&self) -> &Arc<MemoryPool> {
        &self.pinned
    }

    /// The calling thread's current stream on this device.
    pub fn current_stream(&self) -> Result<Stream> {
        stream::current_stream(self)
    }

    /// The three streams of the staged (H2D / compute / D2H) pipeline.
    pub fn pipeline_streams(&self) -> Result<[Stream; 3]> {
        let mut pipeline = self.pipeline.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(streams) = pipeline.as_ref().filter(|s| !s.iter().any(Stream::orphaned)) {
            return Ok(streams.clone());
        }
        let made = [Stream::new(self)?, Stream::new(self)?, Stream::new(self)?];
        *pipeline = Some(made.clone());
        Ok(made)
    }

    /// Before the process ends (or a backend finalizes its driver): waits for the device's
    /// work, drops the streams the runtime itself holds (the pipeline's and the calling
    /// thread's current one) and returns all cached memory to the driver. What stays allocated
    /// after this is held by live tensors, which a driver's leak report then shows.
    pub fn release(&self) -> Result<()> {
        self.pipeline.lock().unwrap_or_else(|p| p.into_inner()).take();
        stream::replace_current_stream(self.id(), None);
        let drained = self.drain();
        self.pool.empty_cache()?;
        self.pinned.empty_cache()?;
        drained
    }

    /// Waits for all work on all streams of this device.
    pub fn synchronize(&self) -> Result<()> {
        self.streams.synchronize_all()
    }

    /// Waits for all work on all streams of this device, leaving asynchronous errors for the
    /// user's next synchronize (tools that wait for their own reasons must not eat them).
    pub fn drain(&self) -> Result<()> {
        self.streams.drain_all()
    }
}

/// Runs one test body on every device this build can reach, as candle's `test_device!` does:
/// `test_device!(name)` after `fn name(ctx: &'static Arc<DeviceContext>)` makes the module
/// `name` with one `#[test]` per device (`name::cpu` today). Accelerator devices add their arm
/// here (Ascend next), behind their cargo feature, skipping with a message where no driver loads,
/// so every test written this way runs on them with no change.
#[macro_export]
macro_rules! test_device {
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() {
                super::$body($crate::DeviceContext::get($crate::DeviceId::CPU).expect("cpu:0 always exists"));
            }
        }
    };
}
