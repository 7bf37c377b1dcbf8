//! Sessions: isolated memory with a byte quota per client session (the seed's 资源隔离).
//!
//! A request names its session with the parameter `session_id` or the header / gRPC metadata
//! `opbridge-session`. Every tensor of that request (inputs decoded, outputs, workspaces) then
//! comes from the session's child pool for the model: a child of the model's device pool,
//! limited to the model's `session_quota` (config.toml) or `--session-quota`.
//!
//! Isolation: a session pool keeps no private cache. A block a session frees goes straight back
//! to the device pool, so no block passes from one session to another without having gone back
//! through the parent; and no stale byte is ever sent, because inputs are written whole before
//! the kernel runs and every kernel writes its outputs whole (the padding up to a block's size
//! is never encoded).
//!
//! A session idle for `--session-idle-secs` (and with no request in flight) is released with
//! its pools; `--max-sessions` bounds how many exist at once (then 503 / UNAVAILABLE).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opbridge_runtime::{ChildPool, DeviceContext};
use serde_json::{json, Value};

use crate::error::{Code, Result, ServeError};
use crate::models::{truncate, ModelVersion};

/// The header (HTTP) and metadata key (gRPC) naming a request's session.
pub const SESSION_HEADER: &str = "opbridge-session";
/// The request parameter naming a request's session.
pub const SESSION_PARAM: &str = "session_id";
/// The label of the series that aggregates the sessions beyond the metric cap: not a valid
/// session name, so it never collides with one.
pub const OTHER_SESSIONS: &str = "(other)";

/// The longest session name.
const MAX_NAME: usize = 128;

/// The session flags.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// A session pool's quota, unless the model's config sets `session_quota`.
    pub quota: usize,
    pub max_sessions: usize,
    pub idle: Duration,
    /// Sessions with series of their own in the metrics; the others are summed into one.
    pub metric_sessions: usize,
}

impl Default for SessionLimits {
    /// `--session-quota` 1 GiB, `--max-sessions` 1024, `--session-idle-secs` 300, 64 sessions
    /// with series of their own.
    fn default() -> Self {
        SessionLimits { quota: 1 << 30, max_sessions: 1024, idle: Duration::from_secs(300), metric_sessions: 64 }
    }
}

/// Checks a session name: 1 to 128 characters from `A-Z a-z 0-9 . _ - : @ + ~` (what UUIDs,
/// user names and e-mail addresses need, and safe in a URL path and a metric label).
pub fn check_name(name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-:@+~".contains(c);
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(allowed) {
        return Err(ServeError::invalid(format!(
            "invalid session name {}: use 1 to {MAX_NAME} characters from A-Z a-z 0-9 . _ - : @ + ~",
            Value::String(truncate(name, 64))
        )));
    }
    Ok(())
}

/// The session a request names: its `session_id` parameter or the `opbridge-session` header;
/// both may be given only when they agree.
pub fn requested(param: Option<&str>, header: Option<&[u8]>) -> Result<Option<String>> {
    let header = match header {
        None => None,
        Some(raw) => Some(std::str::from_utf8(raw).map_err(|_| {
            ServeError::invalid(format!("invalid session name in the {SESSION_HEADER} header: not UTF-8"))
        })?),
    };
    let name = match (param, header) {
        (None, None) => return Ok(None),
        (Some(a), Some(b)) if a != b => {
            return Err(ServeError::invalid(format!(
                "the request names two sessions: parameter {SESSION_PARAM} {} and header {SESSION_HEADER} {}",
                Value::String(truncate(a, 64)),
                Value::String(truncate(b, 64))
            )))
        }
        (Some(name), _) | (None, Some(name)) => name,
    };
    check_name(name)?;
    Ok(Some(name.to_string()))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One session's pool for one model.
#[derive(Debug)]
struct ModelPool {
    pool: ChildPool,
    device: String,
}

/// One client session.
#[derive(Debug)]
pub struct Session {
    id: String,
    /// When it was created, for the metric cap (the oldest keep their series).
    order: u64,
    created_ms: u64,
    last_seen: Mutex<Instant>,
    last_seen_ms: AtomicU64,
    requests: AtomicU64,
    in_flight: AtomicUsize,
    /// The largest total in use, seen at the end of each request's compute.
    peak: AtomicUsize,
    /// Its pools, by model name.
    pools: Mutex<BTreeMap<String, ModelPool>>,
}

impl Session {
    fn pools(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, ModelPool>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes in use now, over all its pools (block sizes).
    pub fn used(&self) -> usize {
        self.pools().values().map(|p| p.pool.usage().0).sum()
    }

    /// Σ of its pools' quotas: the most it may hold at once over the models it called.
    pub fn quota(&self) -> usize {
        self.pools().values().map(|p| p.pool.quota()).sum()
    }

    fn idle_for(&self) -> Duration {
        self.last_seen.lock().unwrap_or_else(|p| p.into_inner()).elapsed()
    }

    fn json(&self) -> Value {
        let pool_peak = self.pools().values().map(|p| p.pool.usage().1).max().unwrap_or(0);
        let pools: Vec<Value> = self
            .pools()
            .iter()
            .map(|(model, p)| {
                let (used, peak) = p.pool.usage();
                json!({"model": model, "device": p.device, "used_bytes": used, "peak_bytes": peak,
                       "quota_bytes": p.pool.quota()})
            })
            .collect();
        json!({
            "id": self.id,
            "requests": self.requests.load(Ordering::Relaxed),
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "created_ms": self.created_ms,
            "last_seen_ms": self.last_seen_ms.load(Ordering::Relaxed),
            "idle_ms": self.idle_for().as_millis() as u64,
            "used_bytes": self.used(),
            // At least any one pool's own peak: the samples taken after requests miss what a
            // request freed before its end (its inputs, say).
            "peak_bytes": self.peak.load(Ordering::Relaxed).max(pool_peak),
            "quota_bytes": self.quota(),
            "pools": pools,
        })
    }
}

/// A request's hold on its session: the pool its tensors come from. While a lease lives the
/// session is not released.
#[derive(Debug)]
pub struct Lease {
    session: Arc<Session>,
    model: String,
    pub pool: ChildPool,
    refusals_before: u64,
}

impl Lease {
    /// Whether `other` allocates from the same pool (the same session, on the same model).
    pub fn same_pool(&self, other: &Lease) -> bool {
        Arc::ptr_eq(&self.session, &other.session) && self.model == other.model
    }

    /// Refuses a request that needs `need` more bytes than the pool has left: before anything
    /// is allocated, with every number the client needs to understand why.
    pub fn check_need(&self, need: usize) -> Result<()> {
        let (used, _) = self.pool.usage();
        if used.checked_add(need).is_some_and(|total| total <= self.pool.quota()) {
            return Ok(());
        }
        Err(self.over_quota(used, &format!("this request needs {need} bytes")))
    }

    fn over_quota(&self, used: usize, need: &str) -> ServeError {
        ServeError::new(
            Code::QuotaExceeded,
            format!(
                "session '{}' is over its memory quota for model '{}': quota {} bytes, {used} bytes in use, {need} \
                 (--session-quota, or session_quota in the model's config.toml)",
                self.session.id,
                self.model,
                self.pool.quota()
            ),
        )
    }

    /// An error of the request's run, with an out-of-memory that came from the quota (the pool
    /// refused an allocation during the call: a workspace, or a concurrent request of the same
    /// session took the room) said as such.
    pub fn explain(&self, error: ServeError) -> ServeError {
        if error.code == Code::OutOfMemory && self.pool.refusals() > self.refusals_before {
            let detail = format!("an allocation failed: {}", error.message);
            return self.over_quota(self.pool.usage().0, &detail);
        }
        error
    }

    /// Records the session's total in use while the request's tensors are alive.
    pub fn observe_peak(&self) {
        self.session.peak.fetch_max(self.session.used(), Ordering::Relaxed);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        *self.session.last_seen.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.session.last_seen_ms.store(now_ms(), Ordering::Relaxed);
        self.session.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every live session.
#[derive(Debug)]
pub struct Sessions {
    limits: SessionLimits,
    table: Mutex<HashMap<String, Arc<Session>>>,
    created: AtomicU64,
}

impl Sessions {
    pub fn new(limits: SessionLimits) -> Sessions {
        Sessions { limits, table: Mutex::new(HashMap::new()), created: AtomicU64::new(0) }
    }

    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease of session `name` (created on first use) for a request to `model`.
    pub fn enter(&self, name: &str, model: &ModelVersion) -> Result<Lease> {
        let quota = model.config.session_quota.unwrap_or(self.limits.quota);
        let parent = DeviceContext::get(model.device)?.pool();
        let session = {
            let mut table = self.table();
            if !table.contains_key(name) && table.len() >= self.limits.max_sessions {
                Self::expire_locked(&mut table, self.limits.idle);
            }
            let session = match table.get(name) {
                Some(session) => Arc::clone(session),
                None if table.len() >= self.limits.max_sessions => {
                    return Err(ServeError::unavailable(format!(
                        "too many sessions: {} are active (--max-sessions {}); a session is released after \
                         {} s without requests (--session-idle-secs)",
                        table.len(),
                        self.limits.max_sessions,
                        self.limits.idle.as_secs()
                    )))
                }
                None => {
                    let session = Arc::new(Session {
                        id: name.to_string(),
                        order: self.created.fetch_add(1, Ordering::Relaxed),
                        created_ms: now_ms(),
                        last_seen: Mutex::new(Instant::now()),
                        last_seen_ms: AtomicU64::new(now_ms()),
                        requests: AtomicU64::new(0),
                        in_flight: AtomicUsize::new(0),
                        peak: AtomicUsize::new(0),
                        pools: Mutex::new(BTreeMap::new()),
                    });
                    table.insert(name.to_string(), Arc::clone(&session));
                    tracing::debug!(session = name, "session created");
                    session
                }
            };
            // In flight before the table's lock is let go: expiry, which holds it, never
            // releases a session a request is entering.
            session.in_flight.fetch_add(1, Ordering::Relaxed);
            session
        };
        session.requests.fetch_add(1, Ordering::Relaxed);
        let pool = {
            let mut pools = session.pools();
            match pools.get(&model.model) {
                // A reload may have changed the quota or the device: later requests use a new
                // pool (the old one's tensors count against the old quota until they drop).
                Some(p) if p.pool.quota() == quota && Arc::ptr_eq(p.pool.parent(), parent) => p.pool.clone(),
                _ => {
                    let pool = parent.child(quota);
                    let entry = ModelPool { pool: pool.clone(), device: model.device.to_string() };
                    pools.insert(model.model.clone(), entry);
                    pool
                }
            }
        };
        Ok(Lease { model: model.model.clone(), refusals_before: pool.refusals(), pool, session })
    }

    /// Releases the sessions idle for the idle time with no request in flight; how many.
    pub fn expire(&self) -> usize {
        Self::expire_locked(&mut self.table(), self.limits.idle)
    }

    fn expire_locked(table: &mut HashMap<String, Arc<Session>>, idle: Duration) -> usize {
        let before = table.len();
        table.retain(|name, session| {
            let keep = session.in_flight.load(Ordering::Relaxed) > 0 || session.idle_for() < idle;
            if !keep {
                tracing::debug!(session = name.as_str(), "session released after being idle");
            }
            keep
        });
        before - table.len()
    }

    fn sorted(&self) -> Vec<Arc<Session>> {
        let mut sessions: Vec<Arc<Session>> = self.table().values().cloned().collect();
        sessions.sort_by_key(|s| s.order);
        sessions
    }

    /// `GET /v2/sessions`.
    pub fn list_json(&self) -> Value {
        let sessions: Vec<Value> = self.sorted().iter().map(|s| s.json()).collect();
        json!({
            "max_sessions": self.limits.max_sessions,
            "session_quota_bytes": self.limits.quota,
            "idle_secs": self.limits.idle.as_secs_f64(),
            "sessions": sessions,
        })
    }

    /// `GET /v2/sessions/{id}`.
    pub fn session_json(&self, name: &str) -> Result<Value> {
        check_name(name)?;
        let session = self.table().get(name).cloned();
        session
            .map(|s| s.json())
            .ok_or_else(|| ServeError::not_found(format!("no session '{name}' (never seen, or released after idling)")))
    }

    /// The metric series: (label, used, quota) for the oldest `metric_sessions` sessions, the
    /// others summed under [`OTHER_SESSIONS`] (a bounded label set, whatever the traffic).
    pub fn metric_rows(&self) -> Vec<(String, usize, usize)> {
        let sessions = self.sorted();
        let cap = self.limits.metric_sessions;
        let mut rows: Vec<(String, usize, usize)> =
            sessions.iter().take(cap).map(|s| (s.id.clone(), s.used(), s.quota())).collect();
        if sessions.len() > cap {
            let rest = &sessions[cap..];
            rows.push((
                OTHER_SESSIONS.to_string(),
                rest.iter().map(|s| s.used()).sum(),
                rest.iter().map(|s| s.quota()).sum(),
            ));
        }
        rows
    }

    pub fn count(&self) -> usize {
        self.table().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_the_two_sources_must_agree() {
        assert_eq!(requested(None, None), Ok(None));
        assert_eq!(requested(Some("user-1"), None), Ok(Some("user-1".into())));
        assert_eq!(requested(None, Some(b"a.b@c:d")), Ok(Some("a.b@c:d".into())));
        assert_eq!(requested(Some("x"), Some(b"x")), Ok(Some("x".into())));
        assert!(requested(Some("x"), Some(b"y")).unwrap_err().message.contains("two sessions"));
        for bad in ["", "has space", "slash/", "(other)", &"a".repeat(129)] {
            assert_eq!(requested(Some(bad), None).unwrap_err().code, Code::InvalidArgument, "{bad:?}");
        }
        assert!(requested(None, Some(&[0xff])).is_err());
    }
}
