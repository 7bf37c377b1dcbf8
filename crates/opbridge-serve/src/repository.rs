//! Model repositories: folders holding one folder per model, each with a `config.toml` and
//! numbered version folders.
//!
//! - A *plugin model*'s version folder `N/` holds exactly one operator library (`lib*.so`, built
//!   against `plugin.h`) that exports an op of the model's name with version `N`.
//! - An *alias model* (`[alias]` in its config) is a registered op with fixed attributes; it has
//!   version 1 and needs no version folder (an empty `1/` is allowed).
//!
//! Nothing here may leave the repository: model and version folders, config files and
//! libraries are resolved (symlinks followed) and refused when they land outside its root.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Result, ServeError};
use crate::models::check_name;

/// The config file of a model folder.
pub const CONFIG_FILE: &str = "config.toml";

/// Which version folders a plugin model loads (Triton's `version_policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionPolicy {
    All,
    /// The `n` highest version numbers.
    Latest(usize),
    Specific(Vec<u32>),
}

impl VersionPolicy {
    /// The versions of `available` (sorted ascending) this policy selects.
    pub fn select(&self, available: &[u32]) -> Vec<u32> {
        match self {
            VersionPolicy::All => available.to_vec(),
            VersionPolicy::Latest(n) => available[available.len().saturating_sub(*n)..].to_vec(),
            VersionPolicy::Specific(wanted) => available.iter().copied().filter(|v| wanted.contains(v)).collect(),
        }
    }

    /// As Triton's model configuration writes it.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            VersionPolicy::All => serde_json::json!({"all": {}}),
            VersionPolicy::Latest(n) => serde_json::json!({"latest": {"num_versions": n}}),
            VersionPolicy::Specific(v) => serde_json::json!({"specific": {"versions": v}}),
        }
    }
}

/// An alias model: a registered op with attributes the model fixes.
#[derive(Debug, Clone, PartialEq)]
pub struct AliasConfig {
    pub op: String,
    pub version: Option<u32>,
    /// In file order; typed against the op's schema when the model loads.
    pub attributes: Vec<(String, toml::Value)>,
}

/// `[ab]`: how unversioned requests are shared between the loaded versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbConfig {
    /// Version → weight, at least one positive; a loaded version not listed weighs 0.
    pub weights: BTreeMap<u32, u32>,
}

/// `[dynamic_batching]` (Triton's names): small requests queued for the model are merged along
/// axis 0 into one call. A request's batch size is its axis-0 length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicBatching {
    /// How long the first request of a batch may wait for others (0: batch only what is
    /// already queued).
    pub max_queue_delay_us: u64,
    /// Batch sizes at which to stop waiting (sorted, at most `max_batch_size`).
    pub preferred_batch_size: Vec<usize>,
    /// The largest batch; a larger request runs alone.
    pub max_batch_size: usize,
}

impl DynamicBatching {
    /// `max_batch_size` when the config does not say.
    pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;
}

/// A model folder's `config.toml`. Every key is optional; unknown keys are an error.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub version_policy: VersionPolicy,
    pub device: Option<String>,
    pub max_queue_size: Option<usize>,
    pub max_request_bytes: Option<usize>,
    /// The byte quota of each session's pool for this model (else `--session-quota`).
    pub session_quota: Option<usize>,
    pub alias: Option<AliasConfig>,
    pub ab: Option<AbConfig>,
    pub dynamic_batching: Option<DynamicBatching>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            version_policy: VersionPolicy::Latest(1),
            device: None,
            max_queue_size: None,
            max_request_bytes: None,
            session_quota: None,
            alias: None,
            ab: None,
            dynamic_batching: None,
        }
    }
}

const TOP_KEYS: &[&str] = &[
    "version_policy",
    "device",
    "max_queue_size",
    "max_request_bytes",
    "session_quota",
    "alias",
    "ab",
    "dynamic_batching",
];
const ALIAS_KEYS: &[&str] = &["op", "version", "attributes"];
const AB_KEYS: &[&str] = &["weights"];
const BATCHING_KEYS: &[&str] = &["max_queue_delay_us", "preferred_batch_size", "max_batch_size"];

fn unknown_key(key: &str, table: &str, known: &[&str]) -> String {
    format!("unknown key '{key}' in {table} (known keys: {})", known.join(", "))
}

fn positive(value: &toml::Value, key: &str) -> std::result::Result<u64, String> {
    match value.as_integer() {
        Some(n) if n > 0 => Ok(n as u64),
        _ => Err(format!("'{key}' must be a positive integer, got {value}")),
    }
}

fn version_number(value: &toml::Value, key: &str) -> std::result::Result<u32, String> {
    u32::try_from(positive(value, key)?).map_err(|_| format!("'{key}' is out of range: {value}"))
}

impl ModelConfig {
    /// Parses the text of a `config.toml`; the error names the offending key.
    pub fn parse(text: &str) -> std::result::Result<ModelConfig, String> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.message().to_string())?;
        ModelConfig::from_table(&table)
    }

    /// Parses the repository load API's `config` parameter: a JSON object with the keys of
    /// `config.toml` (`{"version_policy": "all", "ab": {"weights": {"1": 90, "2": 10}}}`).
    pub fn parse_json(text: &str) -> std::result::Result<ModelConfig, String> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        match json_to_toml(&value)? {
            toml::Value::Table(table) => ModelConfig::from_table(&table),
            _ => Err(format!("must be a JSON object, got {}", crate::models::truncate(&value.to_string(), 32))),
        }
    }

    fn from_table(table: &toml::Table) -> std::result::Result<ModelConfig, String> {
        let mut config = ModelConfig::default();
        for (key, value) in table {
            match key.as_str() {
                "version_policy" => config.version_policy = parse_policy(value)?,
                "device" => {
                    config.device =
                        Some(value.as_str().ok_or_else(|| format!("'device' must be a string, got {value}"))?.into())
                }
                "max_queue_size" => config.max_queue_size = Some(positive(value, key)? as usize),
                "max_request_bytes" => config.max_request_bytes = Some(positive(value, key)? as usize),
                "session_quota" => config.session_quota = Some(positive(value, key)? as usize),
                "alias" => config.alias = Some(parse_alias(value)?),
                "ab" => config.ab = Some(parse_ab(value)?),
                "dynamic_batching" => config.dynamic_batching = Some(parse_batching(value)?),
                other => return Err(unknown_key(other, "the config", TOP_KEYS)),
            }
        }
        // Weights of versions this load does not serve are judged at load (Models::load).
        Ok(config)
    }
}

/// A JSON value as the TOML value it stands for (the load API's config has TOML's keys).
fn json_to_toml(value: &serde_json::Value) -> std::result::Result<toml::Value, String> {
    use serde_json::Value as J;
    Ok(match value {
        J::Bool(b) => toml::Value::Boolean(*b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => toml::Value::Integer(i),
            (None, Some(x)) if n.is_f64() => toml::Value::Float(x),
            _ => return Err(format!("number {n} is out of range")),
        },
        J::String(s) => toml::Value::String(s.clone()),
        J::Array(items) => toml::Value::Array(items.iter().map(json_to_toml).collect::<std::result::Result<_, _>>()?),
        J::Object(map) => toml::Value::Table(
            map.iter().map(|(k, v)| Ok((k.clone(), json_to_toml(v)?))).collect::<std::result::Result<_, String>>()?,
        ),
        J::Null => return Err("null is not a config value (leave the key out)".into()),
    })
}

/// `[ab] weights = { "1" = 90, "2" = 10 }`: keys are version numbers, weights non-negative
/// integers (at most 2^32 - 1, so their sum cannot overflow), at least one positive.
fn parse_ab(value: &toml::Value) -> std::result::Result<AbConfig, String> {
    let table = value.as_table().ok_or_else(|| format!("[ab] must be a table, got {value}"))?;
    let mut weights = None;
    for (key, value) in table {
        match key.as_str() {
            "weights" => {
                let given = value
                    .as_table()
                    .ok_or_else(|| format!("'ab.weights' must be a table of version = weight, got {value}"))?;
                let mut parsed = BTreeMap::new();
                for (version, weight) in given {
                    let number = version_folder(version).ok_or_else(|| {
                        format!(
                            "'ab.weights' key {:?} is not a version number (a positive integer like \"1\")",
                            crate::models::truncate(version, 16)
                        )
                    })?;
                    let weight = weight.as_integer().and_then(|w| u32::try_from(w).ok()).ok_or_else(|| {
                        format!("'ab.weights.\"{version}\"' must be a non-negative integer below 2^32, got {weight}")
                    })?;
                    parsed.insert(number, weight);
                }
                if !parsed.values().any(|&w| w > 0) {
                    return Err("'ab.weights' needs at least one positive weight".into());
                }
                weights = Some(parsed);
            }
            other => return Err(unknown_key(other, "[ab]", AB_KEYS)),
        }
    }
    let weights = weights.ok_or("[ab] needs 'weights', a table of version = weight")?;
    Ok(AbConfig { weights })
}

/// `[dynamic_batching] max_queue_delay_us = 500, preferred_batch_size = [8, 16],
/// max_batch_size = 32`: every key optional (an empty table batches what is queued, up to the
/// default maximum).
fn parse_batching(value: &toml::Value) -> std::result::Result<DynamicBatching, String> {
    let table = value.as_table().ok_or_else(|| format!("[dynamic_batching] must be a table, got {value}"))?;
    let mut batching = DynamicBatching {
        max_queue_delay_us: 0,
        preferred_batch_size: Vec::new(),
        max_batch_size: DynamicBatching::DEFAULT_MAX_BATCH_SIZE,
    };
    let mut max_given = false;
    for (key, value) in table {
        let key_name = format!("dynamic_batching.{key}");
        match key.as_str() {
            "max_queue_delay_us" => {
                // At most a minute: a longer wait is a mistake, not a batching policy.
                batching.max_queue_delay_us = value
                    .as_integer()
                    .filter(|d| (0..=60_000_000).contains(d))
                    .ok_or_else(|| format!("'{key_name}' must be an integer from 0 to 60000000, got {value}"))?
                    as u64;
            }
            "max_batch_size" => {
                batching.max_batch_size = positive(value, &key_name)? as usize;
                max_given = true;
            }
            "preferred_batch_size" => {
                let sizes = value
                    .as_array()
                    .ok_or_else(|| format!("'{key_name}' must be a list of positive integers, got {value}"))?;
                batching.preferred_batch_size = sizes
                    .iter()
                    .map(|v| positive(v, &key_name).map(|n| n as usize))
                    .collect::<std::result::Result<_, _>>()?;
            }
            other => return Err(unknown_key(other, "[dynamic_batching]", BATCHING_KEYS)),
        }
    }
    batching.preferred_batch_size.sort_unstable();
    batching.preferred_batch_size.dedup();
    if let Some(&largest) = batching.preferred_batch_size.last() {
        if largest > batching.max_batch_size {
            if max_given {
                return Err(format!(
                    "'dynamic_batching.preferred_batch_size' {largest} exceeds 'dynamic_batching.max_batch_size' {}",
                    batching.max_batch_size
                ));
            }
            batching.max_batch_size = largest;
        }
    }
    Ok(batching)
}

fn parse_policy(value: &toml::Value) -> std::result::Result<VersionPolicy, String> {
    let wrong =
        || format!("'version_policy' must be \"all\", {{ latest = N }} or {{ specific = [versions] }}, got {value}");
    match value {
        toml::Value::String(s) if s == "all" => Ok(VersionPolicy::All),
        toml::Value::Table(t) if t.len() == 1 => {
            let (key, inner) = t.iter().next().ok_or_else(wrong)?;
            match key.as_str() {
                "latest" => Ok(VersionPolicy::Latest(positive(inner, "version_policy.latest")? as usize)),
                "specific" => {
                    let list = inner.as_array().filter(|a| !a.is_empty()).ok_or_else(wrong)?;
                    let versions = list
                        .iter()
                        .map(|v| version_number(v, "version_policy.specific"))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    Ok(VersionPolicy::Specific(versions))
                }
                other => Err(unknown_key(other, "version_policy", &["latest", "specific"])),
            }
        }
        _ => Err(wrong()),
    }
}

fn parse_alias(value: &toml::Value) -> std::result::Result<AliasConfig, String> {
    let table = value.as_table().ok_or_else(|| format!("[alias] must be a table, got {value}"))?;
    let mut op = None;
    let mut version = None;
    let mut attributes = Vec::new();
    for (key, value) in table {
        match key.as_str() {
            "op" => op = Some(value.as_str().ok_or_else(|| format!("'alias.op' must be a string, got {value}"))?),
            "version" => version = Some(version_number(value, "alias.version")?),
            "attributes" => {
                let attrs =
                    value.as_table().ok_or_else(|| format!("[alias.attributes] must be a table, got {value}"))?;
                attributes = attrs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            }
            other => return Err(unknown_key(other, "[alias]", ALIAS_KEYS)),
        }
    }
    let op = op.ok_or("[alias] needs 'op', the registered operator it serves")?;
    check_name(op).map_err(|e| format!("'alias.op': {}", e.message))?;
    Ok(AliasConfig { op: op.to_string(), version, attributes })
}

/// One repository folder, resolved once at start.
#[derive(Debug, Clone)]
pub struct Repository {
    /// As given on the command line (what logs and the index show).
    pub given: PathBuf,
    /// Canonical (symlinks resolved): every path used must stay under it.
    pub root: PathBuf,
}

impl Repository {
    pub fn open(path: &Path) -> std::result::Result<Repository, String> {
        let root = fs::canonicalize(path).map_err(|e| format!("--repository {}: {e}", path.display()))?;
        if !root.is_dir() {
            return Err(format!("--repository {}: not a folder", path.display()));
        }
        Ok(Repository { given: path.to_path_buf(), root })
    }

    /// The name the repository API uses for this folder (its last path component).
    pub fn name(&self) -> String {
        self.root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// `path` resolved, refused when it lands outside the repository.
    pub fn contain(&self, path: &Path) -> Result<PathBuf> {
        let real = fs::canonicalize(path).map_err(|e| ServeError::invalid(format!("{}: {e}", self.shown(path))))?;
        if !real.starts_with(&self.root) {
            return Err(ServeError::invalid(format!(
                "{} resolves outside the model repository {}: refused",
                self.shown(path),
                self.given.display()
            )));
        }
        Ok(real)
    }

    /// `path` as the repository's user wrote it (relative to the repository).
    fn shown(&self, path: &Path) -> String {
        match path.strip_prefix(&self.root) {
            Ok(rel) => format!("{}/{}", self.given.display(), rel.display()),
            Err(_) => path.display().to_string(),
        }
    }

    /// The model folders it holds now (names that could be paths are skipped, with a warning).
    pub fn model_names(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.root) else { return Vec::new() };
        let mut names = Vec::new();
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else { continue };
            if name.starts_with('.') || !entry.path().is_dir() {
                continue;
            }
            match check_name(&name) {
                Ok(()) => names.push(name),
                Err(e) => tracing::warn!(repository = %self.given.display(), "skipping folder {name:?}: {}", e.message),
            }
        }
        names.sort();
        names
    }

    /// The model folder `name`, resolved and contained, with its config parsed.
    pub fn model(&self, name: &str) -> Result<ModelFolder> {
        self.model_with_config(name, None)
    }

    /// The same, with `config` (the load API's override) in place of the folder's
    /// `config.toml`, which is then not read.
    pub fn model_with_config(&self, name: &str, config: Option<ModelConfig>) -> Result<ModelFolder> {
        check_name(name)?;
        let dir = self.contain(&self.root.join(name))?;
        if dir.parent() != Some(self.root.as_path()) {
            // A symlinked model folder pointing deeper into the repository would let one
            // folder serve under two names: refuse.
            return Err(ServeError::invalid(format!("model folder '{name}' is a link to another folder: refused")));
        }
        let config_path = dir.join(CONFIG_FILE);
        let config = if let Some(config) = config {
            config
        } else if config_path.exists() {
            let real = self.contain(&config_path)?;
            let text = fs::read_to_string(&real)
                .map_err(|e| ServeError::invalid(format!("{}: {e}", self.shown(&config_path))))?;
            ModelConfig::parse(&text).map_err(|e| ServeError::invalid(format!("{}: {e}", self.shown(&config_path))))?
        } else {
            ModelConfig::default()
        };
        let mut versions = BTreeMap::new();
        for entry in fs::read_dir(&dir).map_err(|e| ServeError::invalid(format!("{}: {e}", self.shown(&dir))))? {
            let Ok(entry) = entry else { continue };
            let Some(version) = entry.file_name().to_str().and_then(version_folder) else { continue };
            let path = self.contain(&entry.path())?;
            if path.is_dir() {
                versions.insert(version, path);
            }
        }
        Ok(ModelFolder { name: name.to_string(), dir, config, versions })
    }

    /// The plugin library of a version folder: exactly one `lib*.so`, inside the repository.
    pub fn library(&self, folder: &ModelFolder, version: u32) -> Result<PathBuf> {
        let dir = &folder.versions[&version];
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| ServeError::invalid(format!("{}: {e}", self.shown(dir))))? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("lib") && name.ends_with(".so") {
                found.push(entry.path());
            }
        }
        match found.len() {
            1 => {
                let path = self.contain(&found[0])?;
                if !path.is_file() {
                    return Err(ServeError::invalid(format!("{} is not a file", self.shown(&found[0]))));
                }
                Ok(path)
            }
            0 => Err(ServeError::invalid(format!(
                "model '{}' version {version}: no plugin library (lib*.so) in {}",
                folder.name,
                self.shown(dir)
            ))),
            n => Err(ServeError::invalid(format!(
                "model '{}' version {version}: {n} plugin libraries in {}; a version folder holds exactly one",
                folder.name,
                self.shown(dir)
            ))),
        }
    }

    /// What poll mode compares between two scans of a model folder: every file of the config
    /// and the version folders (one level down), with size and modification time.
    pub fn fingerprint(&self, name: &str) -> Option<Vec<(PathBuf, u64, Option<SystemTime>)>> {
        let dir = self.root.join(name);
        let mut out = Vec::new();
        for top in fs::read_dir(&dir).ok()?.flatten().map(|e| e.path()) {
            if top.is_dir() {
                out.extend(fs::read_dir(&top).into_iter().flatten().flatten().map(|e| stamp(&dir, &e.path())));
            }
            out.push(stamp(&dir, &top));
        }
        out.sort();
        Some(out)
    }
}

/// A file's path (relative to `dir`), size and modification time.
fn stamp(dir: &Path, path: &Path) -> (PathBuf, u64, Option<SystemTime>) {
    let meta = fs::metadata(path).ok();
    let (len, modified) = meta.as_ref().map_or((0, None), |m| (m.len(), m.modified().ok()));
    (path.strip_prefix(dir).unwrap_or(path).to_path_buf(), len, modified)
}

/// A version folder name: a positive number without leading zeros (others are ignored, as in
/// Triton).
fn version_folder(name: &str) -> Option<u32> {
    if name.starts_with('0') || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok().filter(|&v| v > 0)
}

/// A model folder as scanned.
#[derive(Debug, Clone)]
pub struct ModelFolder {
    pub name: String,
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// Version number → its folder (resolved), ascending.
    pub versions: BTreeMap<u32, PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_documented_key() {
        let config = ModelConfig::parse(
            r#"
            version_policy = { specific = [1, 3] }
            device = "cpu:0"
            max_queue_size = 16
            max_request_bytes = 1024
            session_quota = 4096
            [alias]
            op = "softmax"
            version = 1
            [alias.attributes]
            axis = -1
            "#,
        )
        .unwrap();
        assert_eq!(config.version_policy, VersionPolicy::Specific(vec![1, 3]));
        assert_eq!(config.device.as_deref(), Some("cpu:0"));
        assert_eq!((config.max_queue_size, config.max_request_bytes), (Some(16), Some(1024)));
        assert_eq!(config.session_quota, Some(4096));
        let alias = config.alias.unwrap();
        assert_eq!((alias.op.as_str(), alias.version), ("softmax", Some(1)));
        assert_eq!(alias.attributes, vec![("axis".to_string(), toml::Value::Integer(-1))]);
    }

    #[test]
    fn policies_and_defaults() {
        assert_eq!(ModelConfig::parse("").unwrap(), ModelConfig::default());
        assert_eq!(ModelConfig::parse("version_policy = \"all\"").unwrap().version_policy, VersionPolicy::All);
        let latest = ModelConfig::parse("version_policy = { latest = 2 }").unwrap().version_policy;
        assert_eq!(latest, VersionPolicy::Latest(2));
        assert_eq!(latest.select(&[1, 2, 3]), vec![2, 3]);
        assert_eq!(VersionPolicy::Latest(1).select(&[]), Vec::<u32>::new());
        assert_eq!(VersionPolicy::Specific(vec![1, 3]).select(&[1, 2]), vec![1]);
    }

    #[test]
    fn errors_name_the_key() {
        let unknown = ModelConfig::parse("max_queue = 3").unwrap_err();
        assert!(unknown.contains("unknown key 'max_queue'"), "{unknown}");
        let nested = ModelConfig::parse("[alias]\nop = \"add\"\nattrs = 1").unwrap_err();
        assert!(nested.contains("unknown key 'attrs' in [alias]"), "{nested}");
        for bad in [
            "version_policy = \"newest\"",
            "version_policy = { latest = 0 }",
            "version_policy = { oldest = 1 }",
            "version_policy = { specific = [] }",
            "max_queue_size = -1",
            "device = 3",
            "[alias]\nversion = 1",
            "[alias]\nop = \"../x\"",
            "not toml at all [",
        ] {
            assert!(ModelConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn version_folders_are_plain_positive_numbers() {
        assert_eq!(version_folder("1"), Some(1));
        assert_eq!(version_folder("12"), Some(12));
        for bad in ["0", "01", "-1", "1a", "", "+1", "99999999999"] {
            assert_eq!(version_folder(bad), None, "{bad}");
        }
    }

    #[test]
    fn ab_weights_parse_and_bad_ones_name_the_key() {
        let config =
            ModelConfig::parse("version_policy = \"all\"\n[ab]\nweights = { \"1\" = 90, \"2\" = 10 }").unwrap();
        let weights = config.ab.unwrap().weights;
        assert_eq!(weights.into_iter().collect::<Vec<_>>(), vec![(1, 90), (2, 10)]);
        let zero_allowed = ModelConfig::parse("[ab]\nweights = { \"1\" = 0, \"2\" = 1 }").unwrap();
        assert_eq!(zero_allowed.ab.unwrap().weights[&1], 0);
        for (bad, names) in [
            ("[ab]\nweights = { \"1\" = -1 }", "ab.weights.\"1\""),
            ("[ab]\nweights = { \"1\" = 1.5 }", "ab.weights.\"1\""),
            ("[ab]\nweights = { \"1\" = 4294967296 }", "ab.weights.\"1\""),
            ("[ab]\nweights = { \"v1\" = 1 }", "'ab.weights' key \"v1\""),
            ("[ab]\nweights = { \"01\" = 1 }", "'ab.weights' key \"01\""),
            ("[ab]\nweights = { \"0\" = 1 }", "'ab.weights' key \"0\""),
            ("[ab]\nweights = { \"1\" = 0, \"2\" = 0 }", "at least one positive"),
            ("[ab]\nweights = {}", "at least one positive"),
            ("[ab]\nweights = 3", "'ab.weights' must be a table"),
            ("[ab]\nweight = { \"1\" = 1 }", "unknown key 'weight' in [ab]"),
            ("[ab]", "[ab] needs 'weights'"),
            ("ab = 1", "[ab] must be a table"),
        ] {
            let error = ModelConfig::parse(bad).unwrap_err();
            assert!(error.contains(names), "{bad}: {error}");
        }
    }

    #[test]
    fn dynamic_batching_parses_with_defaults_and_bad_keys_are_named() {
        let config = ModelConfig::parse(
            "[dynamic_batching]\nmax_queue_delay_us = 500\npreferred_batch_size = [16, 8, 16]\nmax_batch_size = 32",
        )
        .unwrap();
        let batching = config.dynamic_batching.unwrap();
        assert_eq!(
            (batching.max_queue_delay_us, batching.preferred_batch_size, batching.max_batch_size),
            (500, vec![8, 16], 32)
        );
        let empty = ModelConfig::parse("[dynamic_batching]").unwrap().dynamic_batching.unwrap();
        assert_eq!((empty.max_queue_delay_us, empty.max_batch_size), (0, DynamicBatching::DEFAULT_MAX_BATCH_SIZE));
        let raised = ModelConfig::parse("[dynamic_batching]\npreferred_batch_size = [128]").unwrap();
        assert_eq!(raised.dynamic_batching.unwrap().max_batch_size, 128, "a preferred size raises the default");
        for (bad, names) in [
            ("[dynamic_batching]\nmax_queue_delay_us = -1", "'dynamic_batching.max_queue_delay_us'"),
            ("[dynamic_batching]\nmax_queue_delay_us = 60000001", "'dynamic_batching.max_queue_delay_us'"),
            ("[dynamic_batching]\nmax_batch_size = 0", "'dynamic_batching.max_batch_size'"),
            ("[dynamic_batching]\npreferred_batch_size = [0]", "'dynamic_batching.preferred_batch_size'"),
            ("[dynamic_batching]\npreferred_batch_size = 8", "'dynamic_batching.preferred_batch_size' must be a list"),
            ("[dynamic_batching]\npreferred_batch_size = [64]\nmax_batch_size = 32", "exceeds"),
            ("[dynamic_batching]\nmax_delay = 1", "unknown key 'max_delay' in [dynamic_batching]"),
            ("dynamic_batching = true", "[dynamic_batching] must be a table"),
        ] {
            let error = ModelConfig::parse(bad).unwrap_err();
            assert!(error.contains(names), "{bad}: {error}");
        }
    }

    #[test]
    fn the_load_apis_json_config_has_the_toml_keys() {
        let json = r#"{"version_policy": "all", "max_queue_size": 8, "ab": {"weights": {"1": 90, "2": 10}}}"#;
        let from_json = ModelConfig::parse_json(json).unwrap();
        let from_toml = ModelConfig::parse(
            "version_policy = \"all\"\nmax_queue_size = 8\n[ab]\nweights = { \"1\" = 90, \"2\" = 10 }",
        )
        .unwrap();
        assert_eq!(from_json, from_toml);
        let specific = ModelConfig::parse_json(r#"{"version_policy": {"specific": [2]}}"#).unwrap();
        assert_eq!(specific.version_policy, VersionPolicy::Specific(vec![2]));
        for (bad, says) in [
            ("[1]", "must be a JSON object"),
            ("{", "not JSON"),
            (r#"{"ab": {"weights": {"1": -5}}}"#, "ab.weights.\"1\""),
            (r#"{"ab": null}"#, "null"),
            (r#"{"weights": {}}"#, "unknown key 'weights'"),
        ] {
            let error = ModelConfig::parse_json(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }
}
