//! A CPU event: a generation counter completed by the recording stream's worker.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::device::EventBackend;
use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct State {
    /// Bumped by each `record`; the point callers wait for.
    recorded: u64,
    /// The last generation the worker reached.
    completed: u64,
    /// When `completed` was reached.
    at: Option<Instant>,
}

#[derive(Debug, Default)]
pub struct CpuEvent {
    state: Mutex<State>,
    reached: Condvar,
}

impl CpuEvent {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn begin_record(&self) -> u64 {
        let mut state = self.lock();
        state.recorded += 1;
        state.recorded
    }

    pub(super) fn recorded_generation(&self) -> u64 {
        self.lock().recorded
    }

    pub(super) fn complete(&self, generation: u64) {
        let mut state = self.lock();
        if generation > state.completed {
            state.completed = generation;
            state.at = Some(Instant::now());
        }
        drop(state);
        self.reached.notify_all();
    }

    pub(super) fn wait_for(&self, generation: u64) {
        let mut state = self.lock();
        while state.completed < generation {
            state = self.reached.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl EventBackend for CpuEvent {
    fn synchronize(&self) -> Result<()> {
        let target = self.recorded_generation();
        self.wait_for(target);
        Ok(())
    }

    fn query(&self) -> bool {
        let state = self.lock();
        state.completed >= state.recorded
    }

    fn elapsed_ms(&self, end: &dyn EventBackend) -> Result<f64> {
        let not_ready = |what: &str| Error::Device {
            device: "cpu:0".into(),
            message: format!("elapsed_time: the {what} event has not been recorded and completed"),
        };
        let end = end.as_any().downcast_ref::<CpuEvent>().ok_or_else(|| Error::Device {
            device: "cpu:0".into(),
            message: "elapsed_time: events belong to different devices".into(),
        })?;
        let start = self.lock();
        let start_at = start.at.filter(|_| start.completed >= start.recorded).ok_or_else(|| not_ready("start"))?;
        drop(start);
        let stop = end.lock();
        let end_at = stop.at.filter(|_| stop.completed >= stop.recorded).ok_or_else(|| not_ready("end"))?;
        // Signed like CUDA's cudaEventElapsedTime: negative when `end` completed first.
        Ok(if end_at >= start_at {
            end_at.duration_since(start_at).as_secs_f64() * 1e3
        } else {
            -(start_at.duration_since(end_at).as_secs_f64() * 1e3)
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
