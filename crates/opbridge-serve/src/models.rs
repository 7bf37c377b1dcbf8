//! Models: every registered operator is a model of the same name, its versions the operator's
//! versions. The table says which are loaded; each loaded version has its own executor and
//! statistics. Reloads build the new versions first and swap them in, so a reload never drops
//! availability; unloads let requests in flight finish.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use opbridge_ops::{AttrValue, Entry, Registry};
use opbridge_runtime::{DeviceContext, DeviceId};

use crate::error::{Result, ServeError};
use crate::executor::Executor;

/// How loaded versions execute.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// Compute workers per model version.
    pub workers: usize,
    /// Requests queued per model version before 503.
    pub queue: usize,
}

/// Cumulative statistics of one model version (Triton's statistics extension).
#[derive(Debug, Default)]
pub struct Stats {
    pub success: Duration,
    pub fail: Duration,
    pub queue: Duration,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
    pub inference_count: AtomicU64,
    pub execution_count: AtomicU64,
    /// Milliseconds since the epoch of the last inference (0: none yet).
    pub last_inference_ms: AtomicU64,
    /// End-to-end time of every request (successful or not), for the request duration counter.
    pub request_ns: AtomicU64,
    pub failures: crate::metrics::Failures,
}

/// A `{count, ns}` statistic.
#[derive(Debug, Default)]
pub struct Duration {
    pub count: AtomicU64,
    pub ns: AtomicU64,
}

impl Duration {
    pub fn add(&self, ns: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn get(&self) -> (u64, u64) {
        (self.count.load(Ordering::Relaxed), self.ns.load(Ordering::Relaxed))
    }
}

/// One loaded version of a model.
#[derive(Debug)]
pub struct ModelVersion {
    pub model: String,
    pub version: u32,
    pub entry: Arc<Entry>,
    /// Attributes the model fixes (an alias model); requests may not set them.
    pub fixed: Vec<(String, AttrValue)>,
    pub device: DeviceId,
    pub executor: Executor,
    pub stats: Stats,
    pub load_seconds: f64,
}

/// A model name the server knows: its loaded versions (none while unloaded) and why.
#[derive(Debug, Default)]
struct Model {
    versions: BTreeMap<u32, Arc<ModelVersion>>,
    reason: String,
}

/// What the repository index reports for one model version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub name: String,
    pub version: Option<u32>,
    pub state: &'static str,
    pub reason: String,
}

/// The model table.
#[derive(Debug)]
pub struct Models {
    registry: Arc<Registry>,
    table: RwLock<BTreeMap<String, Model>>,
    exec: ExecOptions,
}

/// Refuses names that are empty or could name a path (Triton's model name checks).
pub fn check_name(name: &str) -> Result<()> {
    if name.trim().is_empty() {
        return Err(ServeError::invalid("model name cannot be empty or whitespace"));
    }
    if name.contains(['/', '\\', '\0']) || name.contains("..") || name.chars().any(char::is_control) {
        return Err(ServeError::invalid(format!(
            "model name must not contain path traversal characters: {:?}",
            truncate(name, 64)
        )));
    }
    Ok(())
}

/// `text` cut to `max` characters for an error message.
pub fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

impl Models {
    pub fn new(registry: Arc<Registry>, exec: ExecOptions) -> Models {
        Models { registry, table: RwLock::default(), exec }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Model>> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Model>> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Every model the registry has, loaded (control mode `none`), or only known (`explicit`).
    pub fn discover(&self, load: bool) -> Result<()> {
        let names: Vec<String> = self.registry.list().into_iter().map(|op| op.name).collect();
        for name in names {
            if load {
                self.load(&name)?;
            } else {
                self.write().entry(name).or_default().reason = "not loaded".into();
            }
        }
        Ok(())
    }

    /// The loaded version `version` of `name` (or its latest loaded version).
    pub fn resolve(&self, name: &str, version: Option<u32>) -> Result<Arc<ModelVersion>> {
        check_name(name)?;
        let table = self.read();
        let Some(model) = table.get(name) else {
            return Err(ServeError::not_found(format!(
                "Request for unknown model: '{}' is not found",
                truncate(name, 64)
            )));
        };
        let found = match version {
            Some(v) => model.versions.get(&v),
            None => model.versions.values().next_back(),
        };
        if let Some(found) = found {
            return Ok(Arc::clone(found));
        }
        let known_version = version.is_none_or(|v| self.registry.get(name, Some(v)).is_ok());
        Err(match (version, known_version) {
            (Some(v), true) => ServeError::unavailable(format!("model '{name}' version {v} is unloading / not loaded")),
            (Some(v), false) => {
                ServeError::not_found(format!("Request for unknown model: '{name}' version {v} is not found"))
            }
            (None, _) => ServeError::unavailable(format!("model '{name}' is unloading / not loaded")),
        })
    }

    /// Loads (or reloads) every version of the operator `name`: the new versions are made
    /// first, then swapped in; the old ones finish their requests in flight.
    pub fn load(&self, name: &str) -> Result<()> {
        check_name(name)?;
        let info = self
            .registry
            .list()
            .into_iter()
            .find(|op| op.name == name)
            .ok_or_else(|| ServeError::not_found(format!("failed to load '{name}': no operator of that name")))?;
        let ctx = DeviceContext::get(DeviceId::CPU)?;
        let mut versions = BTreeMap::new();
        for (version, ..) in info.versions {
            let started = Instant::now();
            let entry = self.registry.get(name, Some(version))?;
            let label = format!("model '{name}' version {version}");
            let executor = Executor::start(&label, ctx, self.exec.workers, self.exec.queue)?;
            versions.insert(
                version,
                Arc::new(ModelVersion {
                    model: name.to_string(),
                    version,
                    entry,
                    fixed: Vec::new(),
                    device: DeviceId::CPU,
                    executor,
                    stats: Stats::default(),
                    load_seconds: started.elapsed().as_secs_f64(),
                }),
            );
        }
        let old = {
            let mut table = self.write();
            let model = table.entry(name.to_string()).or_default();
            model.reason.clear();
            std::mem::replace(&mut model.versions, versions)
        };
        drop(old); // their queues close; workers finish what was queued
        tracing::info!(model = name, "loaded");
        Ok(())
    }

    /// Unloads every version of `name`: new requests get 503 at once, requests in flight
    /// finish (this waits for them: call it off the async runtime). Reports host RSS and the
    /// CPU pool's bytes before and after, in the log and in the index's reason.
    pub fn unload(&self, name: &str) -> Result<()> {
        check_name(name)?;
        let before = MemoryReport::now();
        let old = {
            let mut table = self.write();
            let Some(model) = table.get_mut(name) else {
                return Err(ServeError::not_found(format!("failed to unload '{name}': no such model")));
            };
            std::mem::take(&mut model.versions)
        };
        for version in old.values() {
            version.executor.drain();
        }
        drop(old);
        let after = MemoryReport::now();
        let reason = format!("unloaded: {}", before.change_to(&after));
        tracing::info!(model = name, %reason, "unloaded");
        if let Some(model) = self.write().get_mut(name) {
            if model.versions.is_empty() {
                model.reason = reason;
            }
        }
        Ok(())
    }

    /// Every known model version and its state (the repository index).
    pub fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let table = self.read();
        let mut out = Vec::new();
        for (name, model) in table.iter() {
            if model.versions.is_empty() {
                if !ready_only {
                    out.push(IndexEntry {
                        name: name.clone(),
                        version: None,
                        state: "UNAVAILABLE",
                        reason: model.reason.clone(),
                    });
                }
                continue;
            }
            for version in model.versions.keys() {
                out.push(IndexEntry {
                    name: name.clone(),
                    version: Some(*version),
                    state: "READY",
                    reason: String::new(),
                });
            }
        }
        out
    }

    /// Every loaded model version.
    pub fn loaded(&self) -> Vec<Arc<ModelVersion>> {
        self.read().values().flat_map(|m| m.versions.values().cloned()).collect()
    }

    /// The loaded versions of `name` (empty when unloaded); an error for unknown names.
    pub fn versions_of(&self, name: &str) -> Result<Vec<Arc<ModelVersion>>> {
        check_name(name)?;
        let table = self.read();
        let model = table
            .get(name)
            .ok_or_else(|| ServeError::not_found(format!("Request for unknown model: '{name}' is not found")))?;
        Ok(model.versions.values().cloned().collect())
    }

    /// Unloads everything (shutdown), waiting for requests in flight.
    pub fn unload_all(&self) {
        let names: Vec<String> = self.read().keys().cloned().collect();
        for name in names {
            let _ = self.unload(&name);
        }
    }
}

/// Host RSS and the CPU pool's bytes at one moment (what an unload reports).
#[derive(Debug, Clone, Copy)]
pub struct MemoryReport {
    pub rss_bytes: u64,
    pub pool_allocated: usize,
    pub pool_reserved: usize,
}

impl MemoryReport {
    pub fn now() -> MemoryReport {
        let stats = DeviceContext::cpu().pool().stats();
        MemoryReport {
            rss_bytes: rss_bytes().unwrap_or(0),
            pool_allocated: stats.allocated_bytes_current,
            pool_reserved: stats.reserved_bytes_current,
        }
    }

    pub fn change_to(&self, after: &MemoryReport) -> String {
        format!(
            "host RSS {} -> {} bytes, pool allocated {} -> {} bytes, reserved {} -> {} bytes",
            self.rss_bytes,
            after.rss_bytes,
            self.pool_allocated,
            after.pool_allocated,
            self.pool_reserved,
            after.pool_reserved
        )
    }
}

/// The process's resident set size, from `/proc/self/statm` (Linux).
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
