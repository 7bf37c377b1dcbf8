//! Weighted A/B routing of a model's unversioned requests between its loaded versions
//! (`[ab] weights` in its config).
//!
//! - A request with a key (parameter `ab_key`, else parameter `session_id`, else the
//!   `opbridge-session` header / metadata) goes where its key hashes to: the same version for
//!   as long as the weights and the loaded versions stay the same.
//! - A request without one goes to a weighted random version.
//! - Only loaded versions take part, in ascending order: when a weighted version goes, its
//!   share is spread over the others by their weights; when none is loaded, the latest
//!   loaded version serves.
//! - A request naming a version is never routed (a version weighing 0 still serves it).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::infer::Param;
use crate::models::ModelVersion;

/// The request parameters that key the routing, strongest first (then the session header,
/// [`crate::sessions::SESSION_HEADER`]).
pub const KEY_PARAMS: [&str; 2] = ["ab_key", crate::sessions::SESSION_PARAM];

/// FNV-1a 64 of `bytes`, then murmur3's 64-bit finalizer. Both are fixed functions, so a key
/// keeps its version across restarts and builds (std's hashers promise neither). The
/// finalizer is there because FNV-1a's high bits hardly move with a key's last byte
/// ("user-1", "user-2", ...), and the weights must split such keys too.
pub fn key_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

thread_local! {
    // Seeded from std's per-process random hash keys: no dependency, no system call per request.
    static RANDOM: Cell<u64> = Cell::new({
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(std::thread::current().id())
    });
}

/// A uniform random u64 (wyrand on a thread-local state): cheap, and good enough to split traffic.
fn random_u64() -> u64 {
    RANDOM.with(|state| {
        let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(s);
        let t = u128::from(s).wrapping_mul(u128::from(s ^ 0xe703_7ed1_a0b4_28db));
        ((t >> 64) ^ t) as u64
    })
}

/// The key a parameter's value gives (its text; numbers in decimal).
pub fn key_text(param: &Param) -> String {
    match param {
        Param::Str(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The loaded versions with a positive weight, ascending, each with the running total of the
/// weights up to and including it.
pub fn cumulative(weights: &BTreeMap<u32, u32>, loaded: impl IntoIterator<Item = u32>) -> Vec<(u32, u64)> {
    let mut total = 0u64;
    let mut out = Vec::new();
    for version in loaded {
        let weight = weights.get(&version).copied().unwrap_or(0);
        if weight > 0 {
            total += u64::from(weight);
            out.push((version, total));
        }
    }
    out.sort_unstable();
    out
}

/// The index in `cumulative` (running totals, ascending, last = total > 0) that `point` lands
/// on: `point mod total` falls in exactly one version's span.
pub fn choose(cumulative: &[u64], point: u64) -> usize {
    let total = cumulative.last().copied().unwrap_or(1);
    let slot = point % total;
    cumulative.partition_point(|&end| end <= slot)
}

/// A weighted model's routing table, rebuilt whenever its loaded versions change. Requests
/// hold it (and so the versions in it) while their body is read, so a swap under them is safe.
#[derive(Debug)]
pub struct WeightedRoute {
    /// Running totals of the weighted loaded versions, ascending; empty: none is loaded.
    totals: Vec<u64>,
    weighted: Vec<Arc<ModelVersion>>,
    /// The latest loaded version, for when no weighted version is loaded.
    latest: Arc<ModelVersion>,
}

impl WeightedRoute {
    /// The route over `versions` (ascending), or `None` when none is loaded.
    pub fn new(weights: &BTreeMap<u32, u32>, versions: &BTreeMap<u32, Arc<ModelVersion>>) -> Option<WeightedRoute> {
        let latest = Arc::clone(versions.values().next_back()?);
        let spans = cumulative(weights, versions.keys().copied());
        Some(WeightedRoute {
            totals: spans.iter().map(|&(_, total)| total).collect(),
            weighted: spans.iter().map(|(v, _)| Arc::clone(&versions[v])).collect(),
            latest,
        })
    }

    /// The version for a request with `key` (or none: random), counted in its statistics.
    pub fn pick(&self, key: Option<&[u8]>) -> Arc<ModelVersion> {
        let chosen = if self.totals.is_empty() {
            &self.latest
        } else {
            let point = key.map_or_else(random_u64, key_hash);
            &self.weighted[choose(&self.totals, point)]
        };
        chosen.stats.ab_routed.fetch_add(1, Ordering::Relaxed);
        Arc::clone(chosen)
    }

    /// The largest request any version here takes (what a body is read with before routing).
    pub fn request_limit(&self, server_limit: usize) -> usize {
        self.weighted.iter().chain([&self.latest]).map(|v| v.request_limit(server_limit)).max().unwrap_or(server_limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(pairs: &[(u32, u32)]) -> BTreeMap<u32, u32> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn the_key_hash_is_fnv1a_then_a_fixed_finalizer() {
        // Pinned: a change that would move every sticky user to another version fails here.
        // The values come from an independent Python transcription of the same two steps.
        assert_eq!(key_hash(b""), 0xefd0_1f60_ba99_2926);
        assert_eq!(key_hash(b"a"), 0x82a2_a958_a9be_ce5b);
        assert_eq!(key_hash(b"user-1"), 0x41a2_fca5_c684_01c5);
    }

    #[test]
    fn cumulative_weights_skip_zero_and_unlisted_versions() {
        let w = weights(&[(1, 90), (2, 10), (3, 0)]);
        assert_eq!(cumulative(&w, [1, 2, 3, 4]), vec![(1, 90), (2, 100)]);
        assert_eq!(cumulative(&w, [2, 3]), vec![(2, 10)], "version 1 unloaded: 2 takes everything");
        assert_eq!(cumulative(&w, [3, 4]), vec![], "no weighted version loaded");
    }

    #[test]
    fn points_land_in_their_span() {
        let totals = [90, 100];
        assert_eq!(choose(&totals, 0), 0);
        assert_eq!(choose(&totals, 89), 0);
        assert_eq!(choose(&totals, 90), 1);
        assert_eq!(choose(&totals, 99), 1);
        assert_eq!(choose(&totals, 100), 0, "wraps: mod total");
        assert_eq!(choose(&[5], u64::MAX), 0);
    }

    #[test]
    fn keys_split_by_weight_and_redistribute_when_a_version_goes() {
        let w = weights(&[(1, 90), (2, 10)]);
        let totals: Vec<u64> = cumulative(&w, [1, 2]).iter().map(|&(_, t)| t).collect();
        let keys: Vec<String> = (0..20_000).map(|i| format!("user-{i}")).collect();
        let to_v2 = keys.iter().filter(|k| choose(&totals, key_hash(k.as_bytes())) == 1).count();
        let share = to_v2 as f64 / keys.len() as f64;
        assert!((share - 0.10).abs() < 0.01, "keys to version 2: {share}");
        // Deterministic: the same key, the same version.
        for key in &keys[..100] {
            assert_eq!(choose(&totals, key_hash(key.as_bytes())), choose(&totals, key_hash(key.as_bytes())));
        }
        // Random points split by weight too.
        let random_v2 = (0..20_000).filter(|_| choose(&totals, random_u64()) == 1).count();
        assert!((random_v2 as f64 / 20_000.0 - 0.10).abs() < 0.01, "{random_v2}");
        // Version 2 unloaded: its share goes to the remaining weighted versions.
        let only_v1 = cumulative(&w, [1, 3]);
        assert_eq!(only_v1, vec![(1, 90)]);
        assert!(keys.iter().all(|k| choose(&[90], key_hash(k.as_bytes())) == 0));
        // Three versions, one gone: the other two keep their ratio.
        let three = weights(&[(1, 50), (2, 25), (3, 25)]);
        let left: Vec<u64> = cumulative(&three, [2, 3]).iter().map(|&(_, t)| t).collect();
        assert_eq!(left, vec![25, 50]);
        let to_v2 = keys.iter().filter(|k| choose(&left, key_hash(k.as_bytes())) == 0).count();
        assert!((to_v2 as f64 / keys.len() as f64 - 0.5).abs() < 0.02, "{to_v2}");
    }

    #[test]
    fn parameter_keys_are_their_text() {
        assert_eq!(key_text(&Param::Str("alice".into())), "alice");
        assert_eq!(key_text(&Param::Int(42)), "42");
        assert_eq!(key_text(&Param::Uint(7)), "7");
    }
}
