//! What both front ends share: the model table, metrics, limits, tokens, and the answers that
//! do not depend on the protocol (metadata, configuration, statistics, repository control).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::HeaderMap;
use serde_json::{json, Value};

use crate::datatype::Datatype;
use crate::error::{Code, Result, ServeError};
use crate::metrics::Metrics;
use crate::models::{ModelVersion, Models};
use crate::repository::ModelConfig;

/// The binary tensor extension's header.
pub const BINARY_HEADER: &str = "inference-header-content-length";

/// The extensions this server implements (server metadata lists exactly these).
pub const EXTENSIONS: &[&str] = &[
    "binary_tensor_data",
    "parameters",
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "statistics",
];

#[derive(Debug, Clone)]
pub struct Limits {
    pub http_max_input_size: usize,
    pub grpc_max_message_size: usize,
}

/// How models are loaded (Triton's `--model-control-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlMode {
    None,
    Explicit,
    Poll,
}

/// A bearer token, compared in constant time.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    pub fn new(secret: &str) -> Token {
        Token(secret.trim().as_bytes().to_vec())
    }

    /// Constant time in the length of the candidate: no early exit on the first difference.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let mut diff = (self.0.len() != candidate.len()) as u8;
        for (i, byte) in candidate.iter().enumerate() {
            diff |= byte ^ self.0.get(i % self.0.len().max(1)).copied().unwrap_or(0);
        }
        diff == 0 && !self.0.is_empty()
    }
}

/// The shared state of the server.
#[derive(Debug)]
pub struct Server {
    pub models: Arc<Models>,
    pub metrics: Metrics,
    pub limits: Limits,
    pub auth: Option<Token>,
    pub control_token: Option<Token>,
    pub mode: ControlMode,
    pub sessions: crate::sessions::Sessions,
    /// Registered system shared-memory regions.
    pub shm: crate::shm::Regions,
    ready: AtomicBool,
}

fn unauthenticated() -> ServeError {
    ServeError::new(Code::Unauthenticated, "unauthenticated")
}

fn check_token(token: &Option<Token>, presented: Option<&[u8]>) -> Result<()> {
    let Some(token) = token else { return Ok(()) };
    let presented = presented.ok_or_else(unauthenticated)?;
    // RFC 7235: the scheme is case-insensitive; the token follows one or more spaces.
    let scheme = presented.get(..7).filter(|s| s.eq_ignore_ascii_case(b"bearer ")).ok_or_else(unauthenticated)?;
    let bearer = presented[scheme.len()..].trim_ascii_start();
    if token.matches(bearer) {
        Ok(())
    } else {
        Err(unauthenticated())
    }
}

impl Server {
    pub fn new(
        models: Arc<Models>,
        limits: Limits,
        auth: Option<Token>,
        control_token: Option<Token>,
        mode: ControlMode,
    ) -> Server {
        let sessions = crate::sessions::Sessions::new(crate::sessions::SessionLimits::default());
        Server {
            models,
            metrics: Metrics::default(),
            limits,
            auth,
            control_token,
            mode,
            sessions,
            shm: crate::shm::Regions::default(),
            ready: AtomicBool::new(false),
        }
    }

    /// The same server with these shared-memory regions.
    pub fn with_shared_memory(mut self, regions: crate::shm::Regions) -> Server {
        self.shm = regions;
        self
    }

    /// The same server with these session limits.
    pub fn with_sessions(mut self, limits: crate::sessions::SessionLimits) -> Server {
        self.sessions = crate::sessions::Sessions::new(limits);
        self
    }

    /// The session lease of a request to `model`, if the request names a session (its
    /// `session_id` parameter, or the `opbridge-session` header / metadata given as `header`).
    pub fn session_lease(
        &self,
        request: &crate::infer::InferRequest,
        header: Option<&[u8]>,
        model: &ModelVersion,
    ) -> Result<Option<crate::sessions::Lease>> {
        let param = match request.params.iter().find(|(k, _)| k == crate::sessions::SESSION_PARAM) {
            None => None,
            Some((_, crate::infer::Param::Str(name))) => Some(name.as_str()),
            Some((_, other)) => {
                return Err(ServeError::invalid(format!(
                    "parameter '{}' must be a string, got {other}",
                    crate::sessions::SESSION_PARAM
                )))
            }
        };
        match crate::sessions::requested(param, header)? {
            None => Ok(None),
            Some(name) => self.sessions.enter(&name, model).map(Some),
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Inference and metadata need the `--auth-token-file` token when one is set.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<()> {
        check_token(&self.auth, headers.get("authorization").map(|v| v.as_bytes()))
    }

    /// The same for gRPC metadata.
    pub fn authorize_grpc(&self, metadata: &tonic::metadata::MetadataMap) -> Result<()> {
        check_token(&self.auth, metadata.get("authorization").map(|v| v.as_bytes()))
    }

    /// Repository load/unload need the control token when one is set (else the auth token).
    pub fn authorize_control(&self, headers: &HeaderMap) -> Result<()> {
        let presented = headers.get("authorization").map(|v| v.as_bytes());
        match &self.control_token {
            Some(_) => check_token(&self.control_token, presented),
            None => check_token(&self.auth, presented),
        }
    }

    pub fn authorize_control_grpc(&self, metadata: &tonic::metadata::MetadataMap) -> Result<()> {
        let presented = metadata.get("authorization").map(|v| v.as_bytes());
        match &self.control_token {
            Some(_) => check_token(&self.control_token, presented),
            None => check_token(&self.auth, presented),
        }
    }

    pub fn metadata_json(&self) -> Value {
        json!({"name": "opbridge", "version": env!("CARGO_PKG_VERSION"), "extensions": EXTENSIONS})
    }

    /// Model metadata: FP32 where the op takes it (else its first dtype), `-1` for every dim.
    pub fn model_metadata(&self, name: &str, version: Option<u32>) -> Result<Value> {
        let found = self.models.resolve(name, version)?;
        let versions: Vec<String> = self.models.versions_of(name)?.iter().map(|v| v.version.to_string()).collect();
        let (inputs, outputs) = tensor_metadata(&found);
        Ok(
            json!({"name": found.model, "versions": versions, "platform": "opbridge", "inputs": inputs, "outputs": outputs}),
        )
    }

    /// The operator's schema as a Triton-style model configuration.
    pub fn model_config(&self, name: &str, version: Option<u32>) -> Result<Value> {
        let found = self.models.resolve(name, version)?;
        let schema = found.entry.schema();
        let inputs: Vec<Value> = schema
            .inputs
            .iter()
            .map(|i| {
                let accepted = found.input_dtypes(i);
                let accepted = &accepted[..];
                json!({
                    "name": i.name,
                    "data_type": config_type(preferred(accepted)),
                    "format": "FORMAT_NONE",
                    "dims": [-1],
                    "optional": i.optional,
                    "accepted_data_types": accepted.iter().map(|d| config_type(Datatype::of(*d))).collect::<Vec<_>>(),
                })
            })
            .collect();
        let outputs: Vec<Value> = schema
            .outputs
            .iter()
            .map(|o| json!({"name": o, "data_type": config_type(preferred(&schema.dtypes)), "dims": [-1]}))
            .collect();
        let mut parameters = serde_json::Map::new();
        let device = if found.auto { "auto".to_string() } else { found.device.to_string() };
        parameters.insert("device".into(), json!({"string_value": device}));
        for attr in &schema.attrs {
            let value = match &attr.default {
                Some(v) => v.to_string(),
                None => "required".into(),
            };
            parameters.insert(format!("attribute.{}", attr.name), json!({"string_value": value}));
        }
        for (k, v) in &found.fixed {
            parameters.insert(format!("fixed.{k}"), json!({"string_value": v.to_string()}));
        }
        if let Some(ab) = &found.config.ab {
            // Triton's config has no A/B routing: the weights travel as parameters.
            for (version, weight) in &ab.weights {
                parameters.insert(format!("ab.weights.{version}"), json!({"string_value": weight.to_string()}));
            }
        }
        let mut config = json!({
            "name": found.model,
            "platform": "opbridge",
            "backend": "opbridge",
            "version_policy": found.config.version_policy.to_json(),
            "max_batch_size": found.config.dynamic_batching.as_ref().map_or(0, |b| b.max_batch_size),
            "input": inputs,
            "output": outputs,
            "parameters": parameters,
            // Triton's kinds name CPU and GPU; another accelerator is the model's own placement.
            "instance_group": [{
                "name": found.model,
                "kind": if found.device.kind == opbridge_runtime::DeviceKind::Cpu { "KIND_CPU" } else { "KIND_MODEL" },
                "count": 1,
            }],
        });
        if let Some(batching) = &found.config.dynamic_batching {
            config["dynamic_batching"] = json!({
                "preferred_batch_size": batching.preferred_batch_size,
                "max_queue_delay_microseconds": batching.max_queue_delay_us,
            });
        }
        Ok(config)
    }

    /// Triton's statistics for one model version, one model, or every loaded one.
    pub fn stats_json(&self, name: Option<&str>, version: Option<u32>) -> Result<Value> {
        let versions = match (name, version) {
            (Some(name), Some(v)) => vec![self.models.resolve(name, Some(v))?],
            (Some(name), None) => self.models.versions_of(name)?,
            (None, _) => self.models.loaded(),
        };
        let stats: Vec<Value> = versions.iter().map(|v| version_stats(v)).collect();
        Ok(json!({ "model_stats": stats }))
    }

    /// Loads or unloads a model (explicit and poll modes), off the async runtime.
    /// `dependents` (unload only): also unload the alias models serving it. `config` (load
    /// only): the load API's `config` parameter, in place of the folder's `config.toml`.
    pub async fn control(&self, name: &str, load: bool, dependents: bool, config: Option<ModelConfig>) -> Result<()> {
        let refused = match self.mode {
            ControlMode::None => Some("in model control mode 'none'"),
            ControlMode::Poll => Some("if polling is enabled (model control mode 'poll')"),
            ControlMode::Explicit => None,
        };
        if let Some(why) = refused {
            return Err(ServeError::new(
                Code::Unimplemented,
                format!(
                    "explicit model load / unload is not allowed {why}; start the server with \
                     --model-control-mode explicit"
                ),
            ));
        }
        let models = Arc::clone(&self.models);
        let name = name.to_string();
        tokio::task::spawn_blocking(move || {
            if load {
                models.load_with_config(&name, config)
            } else {
                models.unload(&name, dependents)
            }
        })
        .await
        .map_err(|e| ServeError::internal(format!("the load/unload task failed: {e}")))?
    }
}

fn preferred(accepted: &[opbridge_runtime::DType]) -> Datatype {
    if accepted.contains(&opbridge_runtime::DType::F32) {
        Datatype::Fp32
    } else {
        accepted.first().map_or(Datatype::Fp32, |d| Datatype::of(*d))
    }
}

fn config_type(datatype: Datatype) -> String {
    match datatype {
        Datatype::Bytes => "TYPE_STRING".into(),
        other => format!("TYPE_{}", other.name()),
    }
}

/// (inputs, outputs) of model metadata.
pub fn tensor_metadata(model: &ModelVersion) -> (Vec<Value>, Vec<Value>) {
    let schema = model.entry.schema();
    let inputs = schema
        .inputs
        .iter()
        .map(|i| json!({"name": i.name, "datatype": preferred(i.dtypes(&schema.dtypes)).name(), "shape": [-1]}))
        .collect();
    let outputs = schema
        .outputs
        .iter()
        .map(|o| json!({"name": o, "datatype": preferred(&schema.dtypes).name(), "shape": [-1]}))
        .collect();
    (inputs, outputs)
}

/// Triton's `batch_stats`: executions by batch size, each phase's count being the executions'.
fn batch_stats(stats: &crate::models::Stats) -> Value {
    let batches = stats.batches.lock().unwrap_or_else(|p| p.into_inner());
    let phase = |count: u64, ns: u64| json!({"count": count, "ns": ns});
    batches
        .iter()
        .map(|(size, b)| {
            json!({
                "batch_size": size,
                "compute_input": phase(b.count, b.input_ns),
                "compute_infer": phase(b.count, b.infer_ns),
                "compute_output": phase(b.count, b.output_ns),
            })
        })
        .collect()
}

fn version_stats(v: &ModelVersion) -> Value {
    let d = |d: &crate::models::Duration| {
        let (count, ns) = d.get();
        json!({"count": count, "ns": ns})
    };
    let s = &v.stats;
    json!({
        "name": v.model,
        "version": v.version.to_string(),
        "last_inference": s.last_inference_ms.load(Ordering::Relaxed),
        "inference_count": s.inference_count.load(Ordering::Relaxed),
        "execution_count": s.execution_count.load(Ordering::Relaxed),
        "inference_stats": {
            "success": d(&s.success),
            "fail": d(&s.fail),
            "queue": d(&s.queue),
            "compute_input": d(&s.compute_input),
            "compute_infer": d(&s.compute_infer),
            "compute_output": d(&s.compute_output),
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "response_stats": {},
        "batch_stats": batch_stats(s),
        "memory_usage": [],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let token = Some(Token::new("s3cret\n"));
        for header in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"] {
            assert!(check_token(&token, Some(header.as_bytes())).is_ok(), "{header}");
        }
        for header in ["Bearer wrong", "Bearer s3cret2", "Basic s3cret", "Bearers3cret", "Bearer", ""] {
            assert!(check_token(&token, Some(header.as_bytes())).is_err(), "{header}");
        }
        assert!(check_token(&token, None).is_err());
        assert!(check_token(&None, None).is_ok(), "no token configured: open");
    }
}
