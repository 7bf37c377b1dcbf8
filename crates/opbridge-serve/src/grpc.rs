//! The gRPC front end: `inference.GRPCInferenceService` with Triton's messages (our own
//! `.proto`, compiled with protox), so `tritonclient.grpc` works unchanged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::ab;
use crate::datatype::Datatype;
use crate::error::{Code, ServeError};
use crate::infer::{self, InferInput, InferRequest, InputData, Numbers, Param, RequestedOutput};
use crate::models::Target;
use crate::repository;
use crate::server::Server;
use crate::sessions::SESSION_HEADER;
use crate::shm::{Regions, TENSOR_PARAMS};

#[allow(clippy::all, missing_debug_implementations, missing_docs, rustdoc::all)]
pub mod proto {
    tonic::include_proto!("inference");
}

use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::*;

/// The service over the shared server state.
#[derive(Debug, Clone)]
pub struct Service {
    server: Arc<Server>,
}

/// Serves gRPC on `listener` until `stop` completes.
pub async fn serve(
    listener: TcpListener,
    server: Arc<Server>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let limit = server.limits.grpc_max_message_size;
    let service = GrpcInferenceServiceServer::new(Service { server })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(usize::MAX);
    let incoming = tokio_stream_listener(listener);
    tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(move |r| over_limit_is_resource_exhausted(r, limit)))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, stop)
        .await
        .map_err(|e| format!("gRPC server: {e}"))
}

fn tokio_stream_listener(
    listener: TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static {
    futures_util::stream::unfold(listener, |listener| async move {
        let next = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            stream
        });
        Some((next, listener))
    })
}

/// tonic refuses a message over the decoding limit with OUT_OF_RANGE; the protocol (and
/// Triton) say RESOURCE_EXHAUSTED, naming the limit and the flag that raises it.
fn over_limit_is_resource_exhausted<B>(mut response: http::Response<B>, limit: usize) -> http::Response<B> {
    let headers = response.headers_mut();
    let out_of_range = headers.get("grpc-status").is_some_and(|s| s.as_bytes() == b"11");
    let too_large = headers.get("grpc-message").is_some_and(|m| {
        let text = String::from_utf8_lossy(m.as_bytes()).to_string();
        text.contains("message%20length%20too%20large") || text.contains("message length too large")
    });
    if out_of_range && too_large {
        let message = format!(
            "request message exceeds the maximum allowed size of {limit} bytes. Use --grpc-max-message-size to \
             increase the limit."
        );
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
        if let Ok(value) = http::HeaderValue::from_str(&message) {
            headers.insert("grpc-message", value);
        }
    }
    response
}

fn version_arg(text: &str) -> Result<Option<u32>, ServeError> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| {
        ServeError::invalid(format!(
            "model version must be a non-negative integer, got '{}'",
            crate::models::truncate(text, 32)
        ))
    })
}

impl Service {
    fn reject(&self, endpoint: &'static str, error: ServeError) -> Status {
        self.server.metrics.reject("grpc", endpoint, &error);
        error.into()
    }

    fn authorized<T>(&self, request: &Request<T>, endpoint: &'static str) -> Result<(), Status> {
        self.server.authorize_grpc(request.metadata()).map_err(|e| self.reject(endpoint, e))
    }
}

fn param(value: &InferParameter) -> Option<Param> {
    use proto::infer_parameter::ParameterChoice as P;
    Some(match value.parameter_choice.as_ref()? {
        P::BoolParam(b) => Param::Bool(*b),
        P::Int64Param(i) => Param::Int(*i),
        P::StringParam(s) => Param::Str(s.clone()),
        P::DoubleParam(x) => Param::Float(*x),
        P::Uint64Param(u) => Param::Uint(*u),
    })
}

/// Typed contents as numbers of the input's datatype (8/16-bit ints travel in 32-bit fields).
fn typed_contents(name: &str, datatype: &str, contents: InferTensorContents) -> Result<Numbers, ServeError> {
    let datatype = Datatype::parse(datatype).ok_or_else(|| {
        ServeError::invalid(format!("input '{name}': unknown datatype '{}'", crate::models::truncate(datatype, 16)))
    })?;
    let wrong = || ServeError::invalid(format!("input '{name}': contents do not match datatype {}", datatype.name()));
    Ok(match datatype {
        Datatype::Fp32 => Numbers::F64(contents.fp32_contents.iter().map(|&x| x as f64).collect()),
        Datatype::Fp64 => Numbers::F64(contents.fp64_contents),
        Datatype::Int8 | Datatype::Int16 | Datatype::Int32 => {
            Numbers::I64(contents.int_contents.iter().map(|&x| x as i64).collect())
        }
        Datatype::Int64 => Numbers::I64(contents.int64_contents),
        Datatype::Uint8 | Datatype::Uint16 | Datatype::Uint32 => {
            Numbers::U64(contents.uint_contents.iter().map(|&x| x as u64).collect())
        }
        Datatype::Uint64 => Numbers::U64(contents.uint64_contents),
        Datatype::Bool => Numbers::Bool(contents.bool_contents),
        Datatype::Fp16 | Datatype::Bf16 | Datatype::Bytes => return Err(wrong()),
    })
}

/// A weighted model's routing key: parameter `ab_key`, else `session_id`, else the
/// `opbridge-session` metadata.
fn routing_key(
    message: &ModelInferRequest,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Option<String>, ServeError> {
    if let Some((name, value)) = ab::KEY_PARAMS.iter().find_map(|k| message.parameters.get_key_value(*k)) {
        let value = param(value).ok_or_else(|| ServeError::invalid(format!("parameter '{name}' has no value")))?;
        return Ok(Some(ab::key_text(&value)));
    }
    let Some(session) = metadata.get(SESSION_HEADER) else { return Ok(None) };
    let text = session
        .to_str()
        .map_err(|_| ServeError::invalid(format!("metadata '{}' must be visible ASCII", SESSION_HEADER)))?;
    Ok(Some(text.to_string()))
}

/// A tensor's parameters as the protocol-neutral values.
fn tensor_params(parameters: &HashMap<String, InferParameter>) -> Result<Vec<(String, Param)>, ServeError> {
    let value = |(key, value): (&String, &InferParameter)| {
        param(value)
            .map(|v| (key.clone(), v))
            .ok_or_else(|| ServeError::invalid(format!("parameter '{key}' has no value")))
    };
    parameters.iter().map(value).collect()
}

/// The request as a protocol-neutral one; shared memory named in it is `owner`'s.
fn to_request(message: ModelInferRequest, regions: &Regions, owner: &[u8]) -> Result<InferRequest, ServeError> {
    let mut request = InferRequest { id: message.id, ..Default::default() };
    for (key, value) in &message.parameters {
        let value = param(value).ok_or_else(|| ServeError::invalid(format!("parameter '{key}' has no value")))?;
        request.params.push((key.clone(), value));
    }
    request.params.sort_by(|a, b| a.0.cmp(&b.0));
    let owner = crate::shm::owner_of(owner, &request.params)?;
    // Raw contents belong, in order, to the inputs not in shared memory (tritonclient sends none
    // for the others).
    let in_shm = |input: &model_infer_request::InferInputTensor| input.parameters.contains_key(TENSOR_PARAMS[0]);
    let plain = message.inputs.iter().filter(|input| !in_shm(input)).count();
    let raw = message.raw_input_contents;
    if !raw.is_empty() && raw.len() != plain {
        let others =
            if plain < message.inputs.len() { " not in shared memory, which cannot also have data" } else { "" };
        return Err(ServeError::invalid(format!(
            "expected {plain} raw_input_contents (one per input{others}), got {}",
            raw.len()
        )));
    }
    let mut raw = raw.into_iter();
    for input in message.inputs {
        infer::check_tensor_params("input", &input.name, input.parameters.keys().map(String::as_str), &TENSOR_PARAMS)?;
        let shm = regions.tensor(owner, "input", &input.name, &tensor_params(&input.parameters)?)?;
        let data = match shm {
            Some(slice) if input.contents.as_ref().is_some_and(|c| *c != InferTensorContents::default()) => {
                return Err(ServeError::invalid(format!(
                    "input '{}' is in shared memory ('{}'): it cannot also have contents",
                    input.name, slice.region.name
                )))
            }
            Some(slice) => InputData::Shm(slice),
            None => match (raw.next(), input.contents) {
                (Some(_), Some(c)) if c != InferTensorContents::default() => {
                    return Err(ServeError::invalid(format!(
                        "input '{}': contents and raw_input_contents cannot both be given",
                        input.name
                    )))
                }
                (Some(bytes), _) => InputData::Raw(bytes),
                (None, Some(contents)) => InputData::Numbers(typed_contents(&input.name, &input.datatype, contents)?),
                (None, None) => return Err(ServeError::invalid(format!("input '{}' has no data", input.name))),
            },
        };
        request.inputs.push(InferInput { name: input.name, datatype: input.datatype, shape: input.shape, data });
    }
    if !message.outputs.is_empty() {
        let mut wanted = Vec::with_capacity(message.outputs.len());
        for output in message.outputs {
            let keys = output.parameters.keys().map(String::as_str);
            infer::check_tensor_params("output", &output.name, keys, &TENSOR_PARAMS)?;
            let shm = regions.tensor(owner, "output", &output.name, &tensor_params(&output.parameters)?)?;
            wanted.push(RequestedOutput { name: output.name, binary: None, shm });
        }
        request.outputs = Some(wanted);
    }
    Ok(request)
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(&self, _: Request<ServerLiveRequest>) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse { ready: self.server.is_ready() }))
    }

    async fn model_ready(&self, request: Request<ModelReadyRequest>) -> Result<Response<ModelReadyResponse>, Status> {
        self.authorized(&request, "ready")?;
        let r = request.into_inner();
        let version = version_arg(&r.version).map_err(|e| self.reject("ready", e))?;
        match self.server.models.resolve(&r.name, version) {
            Ok(_) => Ok(Response::new(ModelReadyResponse { ready: true })),
            Err(e) if e.code == Code::Unavailable => Ok(Response::new(ModelReadyResponse { ready: false })),
            Err(e) => Err(self.reject("ready", e)),
        }
    }

    async fn server_metadata(
        &self,
        request: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        self.authorized(&request, "metadata")?;
        Ok(Response::new(ServerMetadataResponse {
            name: "opbridge".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: crate::server::EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        self.authorized(&request, "metadata")?;
        let r = request.into_inner();
        let answer = (|| {
            let version = version_arg(&r.version)?;
            let found = self.server.models.resolve(&r.name, version)?;
            let versions = self.server.models.versions_of(&r.name)?.iter().map(|v| v.version.to_string()).collect();
            let (inputs, outputs) = crate::server::tensor_metadata(&found);
            let tensor = |v: serde_json::Value| model_metadata_response::TensorMetadata {
                name: v["name"].as_str().unwrap_or_default().into(),
                datatype: v["datatype"].as_str().unwrap_or_default().into(),
                shape: vec![-1],
            };
            Ok::<_, ServeError>(ModelMetadataResponse {
                name: found.model.clone(),
                versions,
                platform: "opbridge".into(),
                inputs: inputs.into_iter().map(tensor).collect(),
                outputs: outputs.into_iter().map(tensor).collect(),
            })
        })();
        answer.map(Response::new).map_err(|e| self.reject("metadata", e))
    }

    async fn model_infer(&self, request: Request<ModelInferRequest>) -> Result<Response<ModelInferResponse>, Status> {
        let started = Instant::now();
        self.authorized(&request, "infer")?;
        let (metadata, _, message) = request.into_parts();
        let version = version_arg(&message.model_version).map_err(|e| self.reject("infer", e))?;
        let target = self.server.models.target(&message.model_name, version).map_err(|e| self.reject("infer", e))?;
        let found = match target {
            Target::Version(found) => found,
            Target::Weighted(route) => {
                let key = routing_key(&message, &metadata).map_err(|e| self.reject("infer", e))?;
                route.pick(key.as_deref().map(str::as_bytes))
            }
        };
        // Counted as CANCELED if the client cancels (tonic then drops this future).
        let mut pending = infer::Pending::new(Arc::clone(&found), started, "grpc");
        pending.identify(&message.id);
        let outcome = async {
            let (limit, raise) =
                crate::http::request_limit(&found, self.server.limits.grpc_max_message_size, "--grpc-max-message-size");
            let size = prost::Message::encoded_len(&message);
            if size > limit {
                return Err(ServeError::new(
                    Code::TooLarge,
                    format!(
                        "request message of {size} bytes exceeds the maximum allowed size of {limit} bytes. {raise}"
                    ),
                ));
            }
            let header = metadata.get(SESSION_HEADER).map(|v| v.as_bytes());
            let request = to_request(message, &self.server.shm, header.unwrap_or_default())?;
            let id = request.id.clone();
            let session = self.server.session_lease(&request, header, &found)?;
            let limit = self.server.limits.grpc_max_message_size;
            let outputs = infer::infer(Arc::clone(&found), request, limit, session).await?;
            let mut response = ModelInferResponse {
                model_name: found.model.clone(),
                model_version: found.version.to_string(),
                id,
                ..Default::default()
            };
            for output in outputs {
                let parameters = output.shm.iter().flat_map(|slice| slice.params()).map(|(key, value)| {
                    use proto::infer_parameter::ParameterChoice as P;
                    let choice = match value {
                        serde_json::Value::String(s) => P::StringParam(s),
                        other => P::Int64Param(other.as_i64().unwrap_or_default()),
                    };
                    (key.to_string(), InferParameter { parameter_choice: Some(choice) })
                });
                response.outputs.push(model_infer_response::InferOutputTensor {
                    name: output.name.clone(),
                    datatype: output.datatype.name().into(),
                    shape: output.shape.iter().map(|&d| d as i64).collect(),
                    parameters: parameters.collect(),
                    ..Default::default()
                });
                // An output in shared memory keeps its place with no bytes: clients index the
                // raw contents by output.
                let data = output.data.map(bytes::Bytes::from_owner);
                response.raw_output_contents.push(data.unwrap_or_default());
            }
            Ok::<_, ServeError>(response)
        }
        .await;
        pending.finish(outcome.as_ref().map(|_| ()));
        outcome.map(Response::new).map_err(Status::from)
    }

    type ModelStreamInferStream =
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<ModelStreamInferResponse, Status>> + Send + 'static>>;

    async fn model_stream_infer(
        &self,
        _: Request<tonic::Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        Err(self.reject("infer", ServeError::new(Code::Unimplemented, "streaming inference is not supported")))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        self.authorized(&request, "config")?;
        let r = request.into_inner();
        let answer = (|| {
            let version = version_arg(&r.version)?;
            let json = self.server.model_config(&r.name, version)?;
            Ok::<_, ServeError>(config_message(&json))
        })();
        answer
            .map(|config| Response::new(ModelConfigResponse { config: Some(config) }))
            .map_err(|e| self.reject("config", e))
    }

    async fn model_statistics(
        &self,
        request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        self.authorized(&request, "stats")?;
        let r = request.into_inner();
        let answer = (|| {
            let name = (!r.name.is_empty()).then_some(r.name.as_str());
            let version = version_arg(&r.version)?;
            let json = self.server.stats_json(name, version)?;
            Ok::<_, ServeError>(stats_message(&json))
        })();
        answer.map(Response::new).map_err(|e| self.reject("stats", e))
    }

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        self.authorized(&request, "repository")?;
        let r = request.into_inner();
        let models = self
            .server
            .models
            .index(r.ready, Some(&r.repository_name))
            .map_err(|e| self.reject("repository", e))?
            .into_iter()
            .map(|e| repository_index_response::ModelIndex {
                name: e.name,
                version: e.version.map(|v| v.to_string()).unwrap_or_default(),
                state: e.state.into(),
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.server.authorize_control_grpc(request.metadata()).map_err(|e| self.reject("repository", e))?;
        let r = request.into_inner();
        let mut config = None;
        for (key, param) in &r.parameters {
            use model_repository_parameter::ParameterChoice as P;
            let outcome = match (key.as_str(), &param.parameter_choice) {
                ("config", Some(P::StringParam(text))) => repository::ModelConfig::parse_json(text)
                    .map(|parsed| config = Some(parsed))
                    .map_err(|e| ServeError::invalid(format!("parameter 'config': {e}"))),
                ("config", _) => Err(ServeError::invalid("parameter 'config' must be a string (a JSON object)")),
                _ => Err(ServeError::new(Code::Unimplemented, "loading with files in the request is not supported")),
            };
            outcome.map_err(|e| self.reject("repository", e))?;
        }
        self.server.models.check_repository(&r.repository_name).map_err(|e| self.reject("repository", e))?;
        self.server.control(&r.model_name, true, false, config).await.map_err(|e| self.reject("repository", e))?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        self.server.authorize_control_grpc(request.metadata()).map_err(|e| self.reject("repository", e))?;
        let r = request.into_inner();
        self.server.models.check_repository(&r.repository_name).map_err(|e| self.reject("repository", e))?;
        let mut dependents = false;
        for (key, param) in &r.parameters {
            match (key.as_str(), &param.parameter_choice) {
                ("unload_dependents", Some(model_repository_parameter::ParameterChoice::BoolParam(b))) => {
                    dependents = *b
                }
                (other, _) => {
                    let error = ServeError::invalid(format!(
                        "unknown or mistyped parameter '{}' (unload takes unload_dependents, a boolean)",
                        crate::models::truncate(other, 64)
                    ));
                    return Err(self.reject("repository", error));
                }
            }
        }
        self.server.control(&r.model_name, false, dependents, None).await.map_err(|e| self.reject("repository", e))?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        request: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        self.authorized(&request, "shared_memory")?;
        let owner = shm_owner(request.metadata()).to_vec();
        let name = Some(request.get_ref().name.as_str()).filter(|n| !n.is_empty());
        let regions = self.server.shm.status(&owner, name).map_err(|e| self.reject("shared_memory", e))?;
        let regions = regions.iter().map(|region| {
            let status = system_shared_memory_status_response::RegionStatus {
                name: region.name.clone(),
                key: region.key.clone(),
                offset: region.offset as u64,
                byte_size: region.byte_size as u64,
            };
            (region.name.clone(), status)
        });
        Ok(Response::new(SystemSharedMemoryStatusResponse { regions: regions.collect() }))
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        self.authorized(&request, "shared_memory")?;
        let owner = shm_owner(request.metadata()).to_vec();
        let r = request.into_inner();
        let registered = self.server.shm.register(&owner, &r.name, &r.key, r.offset, r.byte_size);
        registered.map_err(|e| self.reject("shared_memory", e))?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        self.authorized(&request, "shared_memory")?;
        let owner = shm_owner(request.metadata()).to_vec();
        let name = Some(request.get_ref().name.as_str()).filter(|n| !n.is_empty());
        self.server.shm.unregister(&owner, name).map_err(|e| self.reject("shared_memory", e))?;
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        _: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        Err(unimplemented("CUDA shared memory"))
    }

    async fn cuda_shared_memory_register(
        &self,
        _: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        Err(unimplemented("CUDA shared memory"))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        _: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        Err(unimplemented("CUDA shared memory"))
    }

    async fn trace_setting(&self, _: Request<TraceSettingRequest>) -> Result<Response<TraceSettingResponse>, Status> {
        Err(unimplemented("trace settings"))
    }

    async fn log_settings(&self, _: Request<LogSettingsRequest>) -> Result<Response<LogSettingsResponse>, Status> {
        Err(unimplemented("log settings"))
    }
}

/// A shared-memory region's owner: the caller's session (none: the empty one).
fn shm_owner(metadata: &tonic::metadata::MetadataMap) -> &[u8] {
    metadata.get(SESSION_HEADER).map_or(&[][..], |v| v.as_bytes())
}

fn unimplemented(what: &str) -> Status {
    Status::unimplemented(format!("{what} is not supported by this server"))
}

/// The configuration JSON (see `Server::model_config`) as the protocol's message.
fn config_message(json: &serde_json::Value) -> ModelConfig {
    let type_code = |name: &str| {
        Datatype::ALL
            .into_iter()
            .find(|d| format!("TYPE_{}", d.name()) == name || (name == "TYPE_STRING" && *d == Datatype::Bytes))
            .map_or(0, Datatype::config_code)
    };
    let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    let mut parameters: HashMap<String, ModelParameter> = HashMap::new();
    for (k, v) in json["parameters"].as_object().into_iter().flatten() {
        parameters.insert(k.clone(), ModelParameter { string_value: s(&v["string_value"]) });
    }
    for input in json["input"].as_array().into_iter().flatten() {
        let accepted: Vec<String> = input["accepted_data_types"].as_array().into_iter().flatten().map(&s).collect();
        parameters.insert(
            format!("input.{}.data_types", s(&input["name"])),
            ModelParameter { string_value: accepted.join(",") },
        );
    }
    let versions: Vec<i64> = json["version_policy"]["specific"]["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_i64())
        .collect();
    ModelConfig {
        name: s(&json["name"]),
        platform: s(&json["platform"]),
        backend: s(&json["backend"]),
        version_policy: Some(ModelVersionPolicy {
            policy_choice: Some(model_version_policy::PolicyChoice::Specific(model_version_policy::Specific {
                versions,
            })),
        }),
        max_batch_size: json["max_batch_size"].as_i64().and_then(|n| i32::try_from(n).ok()).unwrap_or(0),
        dynamic_batching: json.get("dynamic_batching").map(|b| ModelDynamicBatching {
            preferred_batch_size: b["preferred_batch_size"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_i64().and_then(|n| i32::try_from(n).ok()))
                .collect(),
            max_queue_delay_microseconds: b["max_queue_delay_microseconds"].as_u64().unwrap_or(0),
            preserve_ordering: false,
        }),
        input: json["input"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| ModelInput {
                name: s(&i["name"]),
                data_type: type_code(i["data_type"].as_str().unwrap_or_default()),
                dims: vec![-1],
                optional: i["optional"].as_bool().unwrap_or(false),
                ..Default::default()
            })
            .collect(),
        output: json["output"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|o| ModelOutput {
                name: s(&o["name"]),
                data_type: type_code(o["data_type"].as_str().unwrap_or_default()),
                dims: vec![-1],
                ..Default::default()
            })
            .collect(),
        parameters,
        ..Default::default()
    }
}

/// The statistics JSON (see `Server::stats_json`) as the protocol's message.
fn stats_message(json: &serde_json::Value) -> ModelStatisticsResponse {
    let duration = |v: &serde_json::Value| {
        Some(StatisticDuration { count: v["count"].as_u64().unwrap_or(0), ns: v["ns"].as_u64().unwrap_or(0) })
    };
    let model_stats = json["model_stats"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            let i = &m["inference_stats"];
            ModelStatistics {
                name: m["name"].as_str().unwrap_or_default().into(),
                version: m["version"].as_str().unwrap_or_default().into(),
                last_inference: m["last_inference"].as_u64().unwrap_or(0),
                inference_count: m["inference_count"].as_u64().unwrap_or(0),
                execution_count: m["execution_count"].as_u64().unwrap_or(0),
                inference_stats: Some(InferStatistics {
                    success: duration(&i["success"]),
                    fail: duration(&i["fail"]),
                    queue: duration(&i["queue"]),
                    compute_input: duration(&i["compute_input"]),
                    compute_infer: duration(&i["compute_infer"]),
                    compute_output: duration(&i["compute_output"]),
                    cache_hit: duration(&i["cache_hit"]),
                    cache_miss: duration(&i["cache_miss"]),
                }),
                batch_stats: m["batch_stats"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|b| InferBatchStatistics {
                        batch_size: b["batch_size"].as_u64().unwrap_or(0),
                        compute_input: duration(&b["compute_input"]),
                        compute_infer: duration(&b["compute_infer"]),
                        compute_output: duration(&b["compute_output"]),
                    })
                    .collect(),
                ..Default::default()
            }
        })
        .collect();
    ModelStatisticsResponse { model_stats }
}
