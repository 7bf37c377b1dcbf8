//! Prometheus metrics with Triton's names and labels, so existing dashboards work.
//!
//! Per-model series are rendered from the loaded versions' own statistics at scrape time, so
//! only loaded model/version pairs have series and no label ever comes from an unvalidated
//! name. Front-end rejections count in `opbridge_requests_rejected_total` by protocol,
//! endpoint and status code. The text format is written here: Triton's counters have no
//! `_total` suffix, which OpenMetrics-oriented crates add to every counter.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Code, ServeError};
use crate::models::{ModelVersion, Models};

/// Triton's failure reasons (`nv_inference_request_failure{reason}`).
#[derive(Debug, Default)]
pub struct Failures {
    pub rejected: AtomicU64,
    pub canceled: AtomicU64,
    pub backend: AtomicU64,
    pub other: AtomicU64,
}

impl Failures {
    /// Counts a failed request to a loaded version under Triton's reason for `error`.
    pub fn count(&self, error: &ServeError) {
        let reason = match error.code {
            Code::InvalidArgument | Code::TooLarge | Code::Unavailable | Code::QuotaExceeded => &self.rejected,
            Code::Internal | Code::OutOfMemory => &self.backend,
            _ => &self.other,
        };
        reason.fetch_add(1, Ordering::Relaxed);
    }
}

/// Server-wide counters (per-model ones live in each version's statistics).
#[derive(Debug, Default)]
pub struct Metrics {
    rejected: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
}

impl Metrics {
    /// A request rejected by the front end (parse errors, unknown models, auth, limits...).
    pub fn reject(&self, protocol: &'static str, endpoint: &'static str, error: &ServeError) {
        *self
            .rejected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((protocol, endpoint, error.label()))
            .or_default() += 1;
    }

    /// The text exposition, taken now.
    pub fn render(&self, models: &Models, sessions: &crate::sessions::Sessions) -> String {
        let loaded = models.loaded();
        let mut out = String::new();
        let per_model = |out: &mut String,
                         name: &str,
                         kind: &str,
                         help: &str,
                         value: &dyn Fn(&ModelVersion) -> String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for v in &loaded {
                let _ =
                    writeln!(out, "{name}{{model=\"{}\",version=\"{}\"}} {}", escape(&v.model), v.version, value(v));
            }
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        let us = |d: &crate::models::Duration| (d.ns.load(Ordering::Relaxed) / 1000).to_string();
        per_model(
            &mut out,
            "nv_inference_request_success",
            "counter",
            "Number of successful inference requests, all batch sizes",
            &|v| v.stats.success.get().0.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes\n# TYPE nv_inference_request_failure counter"
        );
        for v in &loaded {
            let f = &v.stats.failures;
            for (reason, count) in
                [("REJECTED", &f.rejected), ("CANCELED", &f.canceled), ("BACKEND", &f.backend), ("OTHER", &f.other)]
            {
                let _ = writeln!(
                    out,
                    "nv_inference_request_failure{{model=\"{}\",reason=\"{reason}\",version=\"{}\"}} {}",
                    escape(&v.model),
                    v.version,
                    load(count)
                );
            }
        }
        per_model(
            &mut out,
            "nv_inference_count",
            "counter",
            "Number of inferences performed (does not include cached requests)",
            &|v| load(&v.stats.inference_count),
        );
        per_model(
            &mut out,
            "nv_inference_exec_count",
            "counter",
            "Number of model executions performed (does not include cached requests)",
            &|v| load(&v.stats.execution_count),
        );
        per_model(
            &mut out,
            "nv_inference_pending_request_count",
            "gauge",
            "Instantaneous number of pending requests awaiting execution per-model.",
            &|v| v.executor.pending().to_string(),
        );
        per_model(
            &mut out,
            "nv_inference_request_duration_us",
            "counter",
            "Cumulative inference request duration in microseconds (includes cached requests)",
            &|v| (v.stats.request_ns.load(Ordering::Relaxed) / 1000).to_string(),
        );
        per_model(
            &mut out,
            "nv_inference_queue_duration_us",
            "counter",
            "Cumulative inference queuing duration in microseconds (includes cached requests)",
            &|v| us(&v.stats.queue),
        );
        per_model(
            &mut out,
            "nv_inference_compute_input_duration_us",
            "counter",
            "Cumulative compute input duration in microseconds (does not include cached requests)",
            &|v| us(&v.stats.compute_input),
        );
        per_model(
            &mut out,
            "nv_inference_compute_infer_duration_us",
            "counter",
            "Cumulative compute inference duration in microseconds (does not include cached requests)",
            &|v| us(&v.stats.compute_infer),
        );
        per_model(
            &mut out,
            "nv_inference_compute_output_duration_us",
            "counter",
            "Cumulative inference compute output duration in microseconds (does not include cached requests)",
            &|v| us(&v.stats.compute_output),
        );
        per_model(&mut out, "nv_model_load_duration_secs", "gauge", "Model load time in seconds", &|v| {
            format!("{}", v.load_seconds)
        });
        let _ = writeln!(
            out,
            "# HELP opbridge_execution_path_total Executions by where they ran: host, or the device (a device = \"auto\" model's calibrated route)\n# TYPE opbridge_execution_path_total counter"
        );
        for v in &loaded {
            for (path, count) in v.stats.paths.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                let _ = writeln!(
                    out,
                    "opbridge_execution_path_total{{model=\"{}\",path=\"{path}\",version=\"{}\"}} {count}",
                    escape(&v.model),
                    v.version
                );
            }
        }
        // Only models with weights: the label set stays the loaded versions of those.
        let weighted: Vec<_> = loaded.iter().filter(|v| v.config.ab.is_some()).collect();
        if !weighted.is_empty() {
            let _ = writeln!(
                out,
                "# HELP opbridge_ab_routed_total Unversioned requests the model's [ab] weights routed to the version\n# TYPE opbridge_ab_routed_total counter"
            );
            for v in weighted {
                let _ = writeln!(
                    out,
                    "opbridge_ab_routed_total{{model=\"{}\",version=\"{}\"}} {}",
                    escape(&v.model),
                    v.version,
                    load(&v.stats.ab_routed)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP opbridge_requests_rejected_total Requests rejected by the front end, by protocol, endpoint and status code\n# TYPE opbridge_requests_rejected_total counter"
        );
        for ((protocol, endpoint, code), count) in self.rejected.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(
                out,
                "opbridge_requests_rejected_total{{code=\"{code}\",endpoint=\"{endpoint}\",protocol=\"{protocol}\"}} {count}"
            );
        }
        self.render_sessions(&mut out, sessions);
        // The host's pool, and each device a loaded model runs on (its pinned staging pool too).
        let mut devices = vec![opbridge_runtime::DeviceId::CPU];
        for v in &loaded {
            if !devices.contains(&v.device) {
                devices.push(v.device);
            }
        }
        let contexts: Vec<(String, &std::sync::Arc<opbridge_runtime::DeviceContext>)> = devices
            .iter()
            .filter_map(|&d| opbridge_runtime::DeviceContext::get(d).ok().map(|ctx| (d.to_string(), ctx)))
            .collect();
        let gauges: [PoolGauge; 4] = [
            ("opbridge_pool_allocated_bytes", "Bytes handed out by the device's caching pool", false, |s| {
                s.allocated_bytes_current as u64
            }),
            ("opbridge_pool_reserved_bytes", "Bytes the device's caching pool holds from the device", false, |s| {
                s.reserved_bytes_current as u64
            }),
            (
                "opbridge_pinned_pool_allocated_bytes",
                "Bytes handed out by an accelerator's pinned host staging pool",
                true,
                |s| s.allocated_bytes_current as u64,
            ),
            (
                "opbridge_pinned_pool_reserved_bytes",
                "Bytes an accelerator's pinned host staging pool holds from the driver",
                true,
                |s| s.reserved_bytes_current as u64,
            ),
        ];
        for (name, help, pinned, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (device, ctx) in &contexts {
                if pinned && device.starts_with("cpu") {
                    continue; // the host's staging pool is its own memory
                }
                let stats = if pinned { ctx.pinned_pool().stats() } else { ctx.pool().stats() };
                let _ = writeln!(out, "{name}{{device=\"{device}\"}} {}", value(&stats));
            }
        }
        out
    }
}

/// A pool gauge: its name, help text, whether it reads the pinned staging pool, and the value.
type PoolGauge = (&'static str, &'static str, bool, fn(&opbridge_runtime::PoolStats) -> u64);

/// A label value escaped for the text format.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    /// The session gauges: one series per session up to the metric cap, the rest summed under
    /// one label, so the label set stays bounded whatever the traffic.
    fn render_sessions(&self, out: &mut String, sessions: &crate::sessions::Sessions) {
        let rows = sessions.metric_rows();
        let _ = writeln!(
            out,
            "# HELP opbridge_sessions Sessions alive now\n# TYPE opbridge_sessions gauge\nopbridge_sessions {}",
            sessions.count()
        );
        let _ = writeln!(
            out,
            "# HELP opbridge_session_pool_bytes Bytes of a session's pools: used by its live tensors; cached is \
             always 0 (session pools keep no private cache: freed blocks return to the device pool)\n\
             # TYPE opbridge_session_pool_bytes gauge"
        );
        for (session, used, _) in &rows {
            let session = escape(session);
            let _ = writeln!(out, "opbridge_session_pool_bytes{{session=\"{session}\",state=\"used\"}} {used}");
            let _ = writeln!(out, "opbridge_session_pool_bytes{{session=\"{session}\",state=\"cached\"}} 0");
        }
        let _ = writeln!(
            out,
            "# HELP opbridge_session_quota_bytes Sum of the quotas of a session's pools (one per model it called)\n\
             # TYPE opbridge_session_quota_bytes gauge"
        );
        for (session, _, quota) in &rows {
            let _ = writeln!(out, "opbridge_session_quota_bytes{{session=\"{}\"}} {quota}", escape(session));
        }
    }
}
