//! Models: every built-in operator is a model of the same name, its versions the operator's
//! versions; the repositories add plugin models and alias models (see [`crate::repository`]). The table says which are loaded; each loaded version has its own executor and
//! statistics. Reloads build the new versions first and swap them in, so a reload never drops
//! availability; unloads let requests in flight finish.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use opbridge_ops::hybrid::Route;
use opbridge_ops::plugin::Library;
use opbridge_ops::{AttrValue, Entry, Registry};
use opbridge_runtime::{DeviceContext, DeviceId};

use crate::ab::WeightedRoute;
use crate::batch::BatchPolicy;
use crate::error::{Result, ServeError};
use crate::executor::Executor;
use crate::infer::{Call, Param};
use crate::repository::{AliasConfig, ModelConfig, Repository, VersionPolicy};

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
    /// Unversioned requests the model's `[ab]` weights sent here.
    pub ab_routed: AtomicU64,
    /// Executions by batch size (Triton's `batch_stats`).
    pub batches: Mutex<BTreeMap<usize, BatchStats>>,
    /// Executions by where they ran: `host`, or a device's name (`ascend:0`): the metrics'
    /// `path` label (a `device = "auto"` model's calibrated route).
    pub paths: Mutex<BTreeMap<String, u64>>,
}

/// How long one request, or one execution, spent in each phase.
#[derive(Debug, Clone, Copy, Default)]
pub struct Times {
    pub queue_ns: u64,
    pub input_ns: u64,
    pub infer_ns: u64,
    pub output_ns: u64,
}

/// Executions of one batch size: how many, and their compute phases' total times.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchStats {
    pub count: u64,
    pub input_ns: u64,
    pub infer_ns: u64,
    pub output_ns: u64,
}

impl Stats {
    /// A request that ran (alone or in a batch, whose compute times it shares), counting
    /// `inferences` (Triton's: its batch size).
    pub fn request(&self, times: &Times, inferences: u64) {
        self.queue.add(times.queue_ns);
        self.compute_input.add(times.input_ns);
        self.compute_infer.add(times.infer_ns);
        self.compute_output.add(times.output_ns);
        self.inference_count.fetch_add(inferences, Ordering::Relaxed);
        let now_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.last_inference_ms.store(now_ms, Ordering::Relaxed);
    }

    /// One execution of the model (one kernel launch) over a batch of `batch_size`, on `path`.
    pub fn execution(&self, times: &Times, batch_size: usize, path: Route) {
        self.execution_count.fetch_add(1, Ordering::Relaxed);
        {
            let mut batches = self.batches.lock().unwrap_or_else(|p| p.into_inner());
            let entry = batches.entry(batch_size).or_default();
            entry.count += 1;
            entry.input_ns += times.input_ns;
            entry.infer_ns += times.infer_ns;
            entry.output_ns += times.output_ns;
        }
        let mut paths = self.paths.lock().unwrap_or_else(|p| p.into_inner());
        match paths.get_mut(path.label_str().as_ref()) {
            Some(count) => *count += 1,
            None => {
                paths.insert(path.label(), 1);
            }
        }
    }
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
    /// Where the model's tensors live (the host for a `device = "auto"` model).
    pub device: DeviceId,
    /// `device = "auto"`: each request runs on the host or is staged through the device whose
    /// calibrated crossover its size reaches (`opbridge_ops::hybrid`).
    pub auto: bool,
    /// Whether requests run the op's CPU kernel on the compute worker itself (a CPU model of an
    /// op that has one): decided once here, not per request.
    pub runs_on_worker: bool,
    /// The model's config (defaults for a built-in operator served as itself).
    pub config: Arc<ModelConfig>,
    pub executor: Executor<Call>,
    /// How queued requests merge (the config's `[dynamic_batching]`).
    pub batching: Option<BatchPolicy>,
    pub stats: Stats,
    pub load_seconds: f64,
    /// The plugin library the version's op lives in (shared with aliases of it); closed when
    /// the last version using it goes.
    library: Option<Arc<PluginLibrary>>,
    /// The loaded model an alias serves (unloaded with it when `unload_dependents` is asked).
    pub alias_of: Option<String>,
}

impl ModelVersion {
    /// The largest request this version takes: its config's `max_request_bytes`, within the
    /// server-wide `limit`.
    pub fn request_limit(&self, limit: usize) -> usize {
        self.config.max_request_bytes.map_or(limit, |own| own.min(limit))
    }

    /// The dtypes input `spec` takes on this model's device: the operator's, less those its
    /// kernel there does not compute in (CANN's RmsNorm has no float64). What the model's
    /// configuration lists; a call with another is refused (400) before it runs.
    pub fn input_dtypes(&self, spec: &opbridge_ops::schema::InputSpec) -> Vec<opbridge_runtime::DType> {
        let schema = self.entry.schema();
        let all = spec.dtypes(&schema.dtypes);
        let kernel = match self.device.kind {
            opbridge_runtime::DeviceKind::Cpu => None,
            kind => self.entry.device_kernel(kind).and_then(|k| k.dtypes()),
        };
        all.iter().copied().filter(|d| kernel.is_none_or(|allowed| allowed.contains(d))).collect()
    }

    /// Where the model's calls run when no route is chosen per request.
    pub fn path(&self) -> Route {
        match self.device.kind {
            opbridge_runtime::DeviceKind::Cpu => Route::Host,
            _ => Route::Device(self.device),
        }
    }
}

/// A plugin library owned by one model version: unloaded (its operators unregistered, calls
/// in flight waited for, the file closed) when the version goes.
#[derive(Debug)]
struct PluginLibrary(Option<Library>);

impl Drop for PluginLibrary {
    fn drop(&mut self) {
        if let Some(library) = self.0.take() {
            let path = library.path().display().to_string();
            if let Err(e) = library.unload() {
                tracing::warn!(library = %path, "unloading the plugin library failed: {e}");
            }
        }
    }
}

/// What a model version runs: an op, the attributes it fixes, the library it lives in.
#[derive(Debug)]
struct ServedOp {
    entry: Arc<Entry>,
    fixed: Vec<(String, AttrValue)>,
    library: Option<Arc<PluginLibrary>>,
}

/// Where a model name comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A built-in operator served as a model of its name.
    Builtin,
    /// A folder of the repository with this index.
    Repository(usize),
}

/// A model name the server knows: its loaded versions (none while unloaded) and why.
#[derive(Debug)]
struct Model {
    versions: BTreeMap<u32, Arc<ModelVersion>>,
    reason: String,
    origin: Origin,
    /// Every version that was ever loaded (requests to these get 503, not 404, while unloaded).
    known_versions: BTreeSet<u32>,
    /// The folder as last loaded (poll mode reloads when it changes).
    fingerprint: Option<Fingerprint>,
    /// Where unversioned requests go when the config has `[ab]` weights (rebuilt with
    /// `versions`); `None`: the latest version.
    route: Option<Arc<WeightedRoute>>,
}

impl Model {
    fn new(origin: Origin) -> Model {
        Model {
            versions: BTreeMap::new(),
            reason: String::new(),
            origin,
            known_versions: BTreeSet::new(),
            fingerprint: None,
            route: None,
        }
    }

    /// Replaces the loaded versions (and the route over them); returns the old ones.
    fn swap_versions(&mut self, versions: BTreeMap<u32, Arc<ModelVersion>>) -> BTreeMap<u32, Arc<ModelVersion>> {
        // Every version of one load shares its config: any of them says the weights.
        let weights = versions.values().next().and_then(|v| v.config.ab.as_ref()).map(|ab| &ab.weights);
        self.route = weights.and_then(|w| WeightedRoute::new(w, &versions)).map(Arc::new);
        std::mem::replace(&mut self.versions, versions)
    }
}

/// Where an inference goes: a version, or a weighted model's route (picked once the request's
/// routing key is known).
#[derive(Debug)]
pub enum Target {
    Version(Arc<ModelVersion>),
    Weighted(Arc<WeightedRoute>),
}

type Fingerprint = Vec<(PathBuf, u64, Option<std::time::SystemTime>)>;

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
    /// The built-in operators: served as models unless `--no-builtins`, and what alias models
    /// name in any case.
    builtins: Arc<Registry>,
    serve_builtins: bool,
    repositories: Vec<Repository>,
    table: RwLock<BTreeMap<String, Model>>,
    exec: ExecOptions,
    /// One lock per model name: loads and unloads of one model run one at a time.
    control_locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
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

/// A TOML attribute value as the request parameter it stands for.
fn toml_param(value: &toml::Value) -> std::result::Result<Param, String> {
    Ok(match value {
        toml::Value::Boolean(b) => Param::Bool(*b),
        toml::Value::Integer(i) => Param::Int(*i),
        toml::Value::Float(x) => Param::Float(*x),
        toml::Value::String(s) => Param::Str(s.clone()),
        toml::Value::Array(items) => {
            let ints: Option<Vec<String>> = items.iter().map(|v| v.as_integer().map(|i| i.to_string())).collect();
            Param::Str(format!(
                "[{}]",
                ints.ok_or_else(|| format!("a list attribute holds integers only, got {value}"))?.join(", ")
            ))
        }
        other => return Err(format!("unsupported attribute value {other}")),
    })
}

fn load_error(name: &str, error: ServeError) -> ServeError {
    ServeError::new(error.code, format!("failed to load '{name}': {}", error.message))
}

impl Models {
    pub fn new(
        builtins: Arc<Registry>,
        serve_builtins: bool,
        repositories: Vec<Repository>,
        exec: ExecOptions,
    ) -> Models {
        Models {
            builtins,
            serve_builtins,
            repositories,
            table: RwLock::default(),
            exec,
            control_locks: Mutex::default(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Model>> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Model>> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    fn control_lock(&self, name: &str) -> Arc<Mutex<()>> {
        let mut locks = self.control_locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(name.to_string()).or_default())
    }

    /// Every model name the server can serve now: the repositories' folders, then the
    /// built-ins (a repository model shadows a built-in of the same name).
    fn available_names(&self) -> BTreeSet<String> {
        let mut names: BTreeSet<String> = self.repositories.iter().flat_map(Repository::model_names).collect();
        if self.serve_builtins {
            names.extend(self.builtins.list().into_iter().map(|op| op.name));
        }
        names
    }

    /// Where `name` is now: the one repository holding a folder of that name, else a built-in.
    fn locate(&self, name: &str) -> Result<Origin> {
        let holders: Vec<usize> =
            (0..self.repositories.len()).filter(|&i| self.repositories[i].root.join(name).is_dir()).collect();
        match holders.as_slice() {
            [i] => Ok(Origin::Repository(*i)),
            [] if self.serve_builtins && self.builtins.get(name, None).is_ok() => Ok(Origin::Builtin),
            [] => Err(ServeError::not_found(format!("no model '{}' in the model repository", truncate(name, 64)))),
            many => {
                let paths: Vec<String> =
                    many.iter().map(|&i| self.repositories[i].given.display().to_string()).collect();
                Err(ServeError::invalid(format!(
                    "model '{name}' is in more than one repository ({}): rename one",
                    paths.join(", ")
                )))
            }
        }
    }

    /// Enters every model the server can serve in the table: loaded (control modes `none` and
    /// `poll`; a model that fails to load stays unavailable with the reason in the index), or
    /// only known (`explicit`).
    pub fn discover(&self, load: bool) {
        let mut pending: Vec<String> = self.available_names().into_iter().collect();
        if !load {
            for name in pending {
                if let Ok(origin) = self.locate(&name) {
                    let mut table = self.write();
                    table.entry(name).or_insert_with(|| Model::new(origin)).reason = "not loaded".into();
                }
            }
            return;
        }
        // Rounds until nothing more loads: an alias loads after the model it serves, whatever
        // their names' order.
        loop {
            let before = pending.len();
            let mut failed = Vec::new();
            for name in pending {
                if let Err(e) = self.load(&name) {
                    failed.push((name, e));
                }
            }
            if failed.is_empty() || failed.len() == before {
                for (name, e) in &failed {
                    tracing::error!(model = %name, "{}", e.message);
                }
                return;
            }
            pending = failed.into_iter().map(|(name, _)| name).collect();
        }
    }

    /// Poll mode: loads new model folders, reloads changed ones, unloads removed ones.
    pub fn poll(&self) {
        let present: BTreeSet<String> = self.available_names();
        for name in &present {
            let Ok(Origin::Repository(i)) = self.locate(name) else {
                if !self.read().contains_key(name.as_str()) {
                    let _ = self.load(name);
                }
                continue;
            };
            let now = self.repositories[i].fingerprint(name);
            let changed = self
                .read()
                .get(name.as_str())
                .is_none_or(|m| m.fingerprint != now || m.origin != Origin::Repository(i));
            if changed {
                match self.load(name) {
                    Ok(()) => tracing::info!(model = %name, "poll: loaded the changed model folder"),
                    Err(e) => tracing::error!(model = %name, "poll: {}", e.message),
                }
            }
        }
        let gone: Vec<String> = self
            .read()
            .iter()
            .filter(|(name, m)| !present.contains(*name) && !m.versions.is_empty())
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            if self.unload(&name, false).is_ok() {
                if let Some(model) = self.write().get_mut(&name) {
                    model.reason = format!("removed from the repository; {}", model.reason);
                }
            }
        }
    }

    /// The loaded version `version` of `name` (or its latest loaded version).
    pub fn resolve(&self, name: &str, version: Option<u32>) -> Result<Arc<ModelVersion>> {
        check_name(name)?;
        self.resolve_in(self.read().get(name), name, version)
    }

    /// Where an inference to `name` goes: the version asked for, else the model's weighted
    /// route when its config has `[ab]` weights, else its latest version.
    pub fn target(&self, name: &str, version: Option<u32>) -> Result<Target> {
        check_name(name)?;
        let table = self.read();
        let model = table.get(name);
        if let (None, Some(route)) = (version, model.and_then(|m| m.route.as_ref())) {
            return Ok(Target::Weighted(Arc::clone(route)));
        }
        self.resolve_in(model, name, version).map(Target::Version)
    }

    /// The version of `model` (the table's entry for `name`, if any) a request asks for.
    fn resolve_in(&self, model: Option<&Model>, name: &str, version: Option<u32>) -> Result<Arc<ModelVersion>> {
        let Some(model) = model else {
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
        let known_version = match (version, model.origin) {
            (None, _) => true,
            (Some(v), _) if model.known_versions.contains(&v) => true,
            (Some(v), Origin::Builtin) => self.builtins.get(name, Some(v)).is_ok(),
            (Some(v), Origin::Repository(i)) => self.repositories[i].root.join(name).join(v.to_string()).is_dir(),
        };
        Err(match (version, known_version) {
            (Some(v), true) => ServeError::unavailable(format!("model '{name}' version {v} is unloading / not loaded")),
            (Some(v), false) => {
                ServeError::not_found(format!("Request for unknown model: '{name}' version {v} is not found"))
            }
            (None, _) => ServeError::unavailable(format!("model '{name}' is unloading / not loaded")),
        })
    }

    /// Loads (or reloads) the model `name` as its folder (or the built-in op) says now: the new
    /// versions are made first, then swapped in, so a reload never drops availability and a
    /// failed one leaves the old versions serving. Blocks (call it off the async runtime).
    pub fn load(&self, name: &str) -> Result<()> {
        self.load_with_config(name, None)
    }

    /// [`Models::load`] with `config` (the load API's `config` parameter) in place of the
    /// folder's `config.toml`, for this load only (Triton's rule): the next load without one
    /// reads the file again.
    pub fn load_with_config(&self, name: &str, config: Option<ModelConfig>) -> Result<()> {
        check_name(name)?;
        let lock = self.control_lock(name);
        let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
        let origin = self.locate(name).map_err(|e| load_error(name, e))?;
        let fingerprint = match origin {
            Origin::Repository(i) => self.repositories[i].fingerprint(name),
            Origin::Builtin => None,
        };
        let built = match (origin, config) {
            (Origin::Builtin, None) => self.build_builtin(name),
            (Origin::Builtin, Some(_)) => Err(ServeError::invalid(format!(
                "a config applies to repository models; '{}' is a built-in operator",
                truncate(name, 64)
            ))),
            (Origin::Repository(i), config) => self.build_from_folder(&self.repositories[i], name, config),
        };
        let built = built.and_then(|versions| self.check_weights(name, versions));
        let versions = match built {
            Ok(versions) => versions,
            Err(error) => {
                let error = load_error(name, error);
                let mut table = self.write();
                let model = table.entry(name.to_string()).or_insert_with(|| Model::new(origin));
                model.fingerprint = fingerprint;
                if model.versions.is_empty() {
                    model.reason = error.message.clone();
                }
                return Err(error);
            }
        };
        let old = {
            let mut table = self.write();
            let model = table.entry(name.to_string()).or_insert_with(|| Model::new(origin));
            model.reason.clear();
            model.origin = origin;
            model.fingerprint = fingerprint;
            model.known_versions.extend(versions.keys().copied());
            model.swap_versions(versions)
        };
        // Replaced versions are not drained: a request that resolved one just before the swap
        // still submits to it (a reload never answers 503). Each closes its queue, and unloads
        // its library, when the last request holding it lets go. Its batches stop waiting for
        // company now: no request reaches it any more, so one gathering there would sit out the
        // whole `max_queue_delay_us`.
        for version in old.values() {
            version.executor.hurry();
        }
        drop(old);
        tracing::info!(model = name, "loaded");
        Ok(())
    }

    fn version(
        &self,
        name: &str,
        version: u32,
        op: ServedOp,
        config: &Arc<ModelConfig>,
        started: Instant,
    ) -> Result<Arc<ModelVersion>> {
        let ServedOp { entry, fixed, library } = op;
        let (device, auto) = match config.device.as_deref() {
            None => (DeviceId::CPU, false),
            Some("auto") => (DeviceId::CPU, true),
            Some(text) => (
                DeviceId::parse(text).ok_or_else(|| {
                    ServeError::invalid(format!("device {text:?} is not a device name (like \"cpu:0\") or \"auto\""))
                })?,
                false,
            ),
        };
        let ctx = DeviceContext::get(device)
            .map_err(|e| ServeError::invalid(format!("device {device} is not available: {e}")))?;
        let schema = entry.schema();
        if !entry.devices().contains(&device.kind) {
            let has: Vec<&str> = entry.devices().iter().map(|d| d.name()).collect();
            return Err(ServeError::invalid(format!(
                "operator '{}' version {} has no kernel on {device}; it has kernels for: {}",
                schema.name,
                schema.version,
                has.join(", ")
            )));
        }
        if auto && (entry.op.lane().is_none() || config.dynamic_batching.is_some()) {
            return Err(ServeError::invalid(format!(
                "device = \"auto\" routes each request of an elementwise operator without [dynamic_batching] to \
                 the host or through a device by the calibrated crossover; '{}' {}: name a device instead",
                schema.name,
                if entry.op.lane().is_none() { "is not elementwise" } else { "batches" }
            )));
        }
        let label = format!("model '{name}' version {version}");
        let queue = config.max_queue_size.unwrap_or(self.exec.queue);
        let batching = match &config.dynamic_batching {
            None => None,
            Some(dynamic) => Some(BatchPolicy::new(
                entry.op.batching().ok_or_else(|| {
                    ServeError::invalid(format!(
                        "operator '{}' version {} does not declare how its calls merge along axis 0, so it \
                         cannot be batched; remove [dynamic_batching] from the model's config",
                        entry.schema().name,
                        entry.schema().version
                    ))
                })?,
                dynamic,
            )),
        };
        let work = if batching.is_some() { crate::batch::work } else { crate::infer::work };
        let executor = Executor::start(&label, ctx, self.exec.workers, queue, work)?;
        let runs_on_worker =
            device.kind == opbridge_runtime::DeviceKind::Cpu && entry.op.devices().contains(&device.kind);
        Ok(Arc::new(ModelVersion {
            model: name.to_string(),
            version,
            entry,
            fixed,
            device,
            auto,
            runs_on_worker,
            config: Arc::clone(config),
            executor,
            batching,
            stats: Stats::default(),
            load_seconds: started.elapsed().as_secs_f64(),
            alias_of: config.alias.as_ref().map(|a| a.op.clone()).filter(|op| self.read().contains_key(op)),
            library,
        }))
    }

    /// Refuses weights for a version this load does not serve, unless the version was served
    /// until now: then its folder went, or the policy dropped it, and its share is spread over
    /// the others (a warning says so). A version never served is a mistake in the config.
    fn check_weights(
        &self,
        name: &str,
        versions: BTreeMap<u32, Arc<ModelVersion>>,
    ) -> Result<BTreeMap<u32, Arc<ModelVersion>>> {
        let Some(ab) = versions.values().next().and_then(|v| v.config.ab.clone()) else { return Ok(versions) };
        let served_before: BTreeSet<u32> =
            self.read().get(name).map(|m| m.versions.keys().copied().collect()).unwrap_or_default();
        let loading: Vec<String> = versions.keys().map(u32::to_string).collect();
        for version in ab.weights.keys().filter(|v| !versions.contains_key(v)) {
            if served_before.contains(version) {
                tracing::warn!(
                    model = name,
                    "'ab.weights' names version {version}, which is no longer served: its share goes to the others"
                );
            } else {
                return Err(ServeError::invalid(format!(
                    "'ab.weights' names version {version}, which is not served (this load serves versions [{}])",
                    loading.join(", ")
                )));
            }
        }
        Ok(versions)
    }

    /// A built-in operator: every version it has.
    fn build_builtin(&self, name: &str) -> Result<BTreeMap<u32, Arc<ModelVersion>>> {
        let config = Arc::new(ModelConfig { version_policy: VersionPolicy::All, ..ModelConfig::default() });
        let info = self
            .builtins
            .list()
            .into_iter()
            .find(|op| op.name == name)
            .ok_or_else(|| ServeError::not_found(format!("no operator '{name}'")))?;
        let mut versions = BTreeMap::new();
        for (version, ..) in info.versions {
            let started = Instant::now();
            let entry = self.builtins.get(name, Some(version))?;
            let op = ServedOp { entry, fixed: Vec::new(), library: None };
            versions.insert(version, self.version(name, version, op, &config, started)?);
        }
        Ok(versions)
    }

    /// A repository model folder: an alias, or a plugin model's selected versions.
    fn build_from_folder(
        &self,
        repository: &Repository,
        name: &str,
        config: Option<ModelConfig>,
    ) -> Result<BTreeMap<u32, Arc<ModelVersion>>> {
        let folder = repository.model_with_config(name, config)?;
        let config = Arc::new(folder.config.clone());
        let mut versions = BTreeMap::new();
        if let Some(alias) = &config.alias {
            for (v, dir) in &folder.versions {
                let empty = std::fs::read_dir(dir).map(|mut d| d.next().is_none()).unwrap_or(false);
                if *v != 1 || !empty {
                    return Err(ServeError::invalid(format!(
                        "alias model '{name}' has version folder '{v}/' with content: an alias has version 1 and \
                         needs no version folder (an empty '1/' is allowed)"
                    )));
                }
            }
            let started = Instant::now();
            let op = self.alias_target(name, alias)?;
            versions.insert(1, self.version(name, 1, op, &config, started)?);
            return Ok(versions);
        }
        let available: Vec<u32> = folder.versions.keys().copied().collect();
        let selected = config.version_policy.select(&available);
        if selected.is_empty() {
            return Err(ServeError::invalid(format!(
                "no version is available (version folders: [{}], policy {:?})",
                available.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
                config.version_policy
            )));
        }
        for version in selected {
            let started = Instant::now();
            let path = repository.library(&folder, version)?;
            let registry = Registry::new();
            let library = Library::load_into(Arc::clone(&registry), &path)
                .map_err(|e| ServeError::invalid(format!("version {version}: {e}")))?;
            let Ok(entry) = registry.get(name, Some(version)) else {
                let exported: Vec<String> = library.ops().iter().map(|(n, v)| format!("{n} v{v}")).collect();
                return Err(ServeError::invalid(format!(
                    "version {version}: {} exports no operator '{name}' version {version} (it exports {})",
                    path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
                    exported.join(", ")
                )));
            };
            let op = ServedOp { entry, fixed: Vec::new(), library: Some(Arc::new(PluginLibrary(Some(library)))) };
            versions.insert(version, self.version(name, version, op, &config, started)?);
        }
        Ok(versions)
    }

    /// The op an alias serves, and the attributes it fixes (typed by the op's schema). The op
    /// is a loaded model of that name (a plugin model, or another alias whose fixed
    /// attributes it inherits), else a built-in operator.
    fn alias_target(&self, name: &str, alias: &AliasConfig) -> Result<ServedOp> {
        let loaded = (alias.op != name).then(|| self.resolve(&alias.op, alias.version).ok()).flatten();
        let (entry, mut fixed, library) = match loaded {
            Some(target) => (Arc::clone(&target.entry), target.fixed.clone(), target.library.clone()),
            None => (
                self.builtins.get(&alias.op, alias.version).map_err(|e| {
                    ServeError::invalid(format!("alias of '{}': no such loaded model or operator: {e}", alias.op))
                })?,
                Vec::new(),
                None,
            ),
        };
        let schema = entry.schema();
        for (key, value) in &alias.attributes {
            if fixed.iter().any(|(k, _)| k == key) {
                return Err(ServeError::invalid(format!("alias attribute '{key}' is fixed by '{}' already", alias.op)));
            }
            let Some(spec) = schema.attrs.iter().find(|a| &a.name == key) else {
                let known: Vec<&str> = schema.attrs.iter().map(|a| a.name.as_str()).collect();
                return Err(ServeError::invalid(format!(
                    "alias attribute '{key}': '{}' has no such attribute (it takes {})",
                    alias.op,
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                )));
            };
            let param = toml_param(value).map_err(|e| ServeError::invalid(format!("alias attribute '{key}': {e}")))?;
            fixed.push((key.clone(), crate::infer::attr_value(name, spec, &param)?));
        }
        schema.bind_attrs(fixed.iter().map(|(k, v)| (k.as_str(), v.clone())))?;
        Ok(ServedOp { entry, fixed, library })
    }

    /// Unloads every version of `name`: new requests get 503 at once, requests in flight
    /// finish (this waits for them: call it off the async runtime). Reports host RSS and the
    /// CPU pool's bytes before and after, in the log and in the index's reason.
    /// With `dependents`, the alias models serving it are unloaded too (else they keep serving:
    /// they hold what they need).
    pub fn unload(&self, name: &str, dependents: bool) -> Result<()> {
        check_name(name)?;
        if dependents {
            let aliases: Vec<String> = self
                .loaded()
                .iter()
                .filter(|v| v.alias_of.as_deref() == Some(name) && v.model != name)
                .map(|v| v.model.clone())
                .collect();
            for alias in aliases {
                self.unload(&alias, true)?;
            }
        }
        let lock = self.control_lock(name);
        let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
        let before = MemoryReport::now();
        let old = {
            let mut table = self.write();
            match table.get_mut(name) {
                Some(model) => model.swap_versions(BTreeMap::new()),
                None => {
                    // Known to a repository but never loaded: nothing to do.
                    let origin = self.locate(name).map_err(|_| {
                        ServeError::not_found(format!("failed to unload '{}': no such model", truncate(name, 64)))
                    })?;
                    table.insert(name.to_string(), Model { reason: "not loaded".into(), ..Model::new(origin) });
                    return Ok(());
                }
            }
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

    /// Refuses a repository name (the API's optional `repository_name`) that is none of ours.
    pub fn check_repository(&self, wanted: &str) -> Result<()> {
        self.repository_index(wanted).map(|_| ())
    }

    fn repository_index(&self, wanted: &str) -> Result<Option<usize>> {
        if wanted.is_empty() {
            return Ok(None);
        }
        self.repositories
            .iter()
            .position(|r| r.name() == wanted || r.given.to_string_lossy() == wanted)
            .map(Some)
            .ok_or_else(|| ServeError::not_found(format!("unknown repository '{}'", truncate(wanted, 64))))
    }

    /// Every known model version and its state (the repository index), optionally of one
    /// repository (by its folder name or path as given).
    pub fn index(&self, ready_only: bool, repository: Option<&str>) -> Result<Vec<IndexEntry>> {
        let only = self.repository_index(repository.unwrap_or(""))?;
        let in_scope = |origin: Origin| only.is_none_or(|i| origin == Origin::Repository(i));
        let table = self.read();
        let mut out = Vec::new();
        for (name, model) in table.iter().filter(|(_, m)| in_scope(m.origin)) {
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
        if !ready_only {
            // Folders added since the last scan (explicit mode): known, not loaded.
            let scanned = self.repositories.iter().enumerate().filter(|(i, _)| in_scope(Origin::Repository(*i)));
            for (_, repository) in scanned {
                for name in repository.model_names() {
                    if !table.contains_key(&name) {
                        out.push(IndexEntry { name, version: None, state: "UNAVAILABLE", reason: "not loaded".into() });
                    }
                }
            }
            out.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        }
        Ok(out)
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
            let _ = self.unload(&name, false);
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
