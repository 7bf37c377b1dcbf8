//! The HTTP/REST front end: KServe V2 with Triton's extensions (binary tensors, repository,
//! configuration, statistics). Every error is `{"error": "..."}` with Triton's status mapping.

use std::convert::Infallible;
use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::datatype::Datatype;
use crate::error::{Code, Result, ServeError};
use crate::infer::{self, InferInput, InferRequest, InputData, Numbers, Output, Param, RequestedOutput};
use crate::models::{check_name, ModelVersion};
use crate::server::{Server, BINARY_HEADER};

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, json!({ "error": self.message }).to_string()).into_response();
        response.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
        response
    }
}

/// A handler's answer: a response, or an error counted as a rejection of `endpoint`.
type Answer = std::result::Result<Response, (&'static str, ServeError)>;

fn answer(server: &Server, outcome: Answer) -> Response {
    match outcome {
        Ok(response) => response,
        Err((endpoint, error)) => {
            server.metrics.reject("http", endpoint, &error);
            error.into_response()
        }
    }
}

fn json_response(value: Value) -> Response {
    let mut response = (StatusCode::OK, value.to_string()).into_response();
    response.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    response
}

/// The router of the inference port.
pub fn router(server: Arc<Server>) -> Router {
    Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_v))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready_v))
        .route("/v2/models/{model}/config", get(model_config))
        .route("/v2/models/{model}/versions/{version}/config", get(model_config_v))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(model_stats_v))
        .route("/v2/models/{model}/infer", post(infer_latest))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_version))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/{repository}/index", post(repository_index_of))
        .route("/v2/repository/models/{model}/load", post(repository_load))
        .route("/v2/repository/models/{model}/unload", post(repository_unload))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(server)
}

async fn not_found(State(server): State<Arc<Server>>) -> Response {
    answer(&server, Err(("other", ServeError::not_found("Not Found"))))
}

async fn method_not_allowed(State(server): State<Arc<Server>>) -> Response {
    let error = ServeError::new(Code::InvalidArgument, "Method Not Allowed");
    server.metrics.reject("http", "other", &error);
    let mut response = error.into_response();
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(server): State<Arc<Server>>) -> StatusCode {
    if server.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    }
}

fn version_arg(text: &str) -> Result<u32> {
    text.parse().map_err(|_| ServeError::invalid(format!("model version must be a non-negative integer, got {text:?}")))
}

async fn server_metadata(State(server): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let outcome =
        server.authorize(&headers).map(|_| json_response(server.metadata_json())).map_err(|e| ("metadata", e));
    answer(&server, outcome)
}

async fn model_metadata(State(s): State<Arc<Server>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.model_metadata(&model, None)).map(json_response);
    answer(&s, outcome.map_err(|e| ("metadata", e)))
}

async fn model_metadata_v(
    State(s): State<Arc<Server>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let outcome =
        s.authorize(&headers).and_then(|_| s.model_metadata(&model, Some(version_arg(&version)?))).map(json_response);
    answer(&s, outcome.map_err(|e| ("metadata", e)))
}

fn ready_answer(s: &Server, model: &str, version: Option<u32>) -> Result<Response> {
    match s.models.resolve(model, version) {
        Ok(_) => Ok(StatusCode::OK.into_response()),
        Err(e) if e.code == Code::Unavailable => Err(ServeError::invalid("Model version not ready")),
        Err(e) => Err(e),
    }
}

async fn model_ready(State(s): State<Arc<Server>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| ready_answer(&s, &model, None));
    answer(&s, outcome.map_err(|e| ("ready", e)))
}

async fn model_ready_v(
    State(s): State<Arc<Server>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| ready_answer(&s, &model, Some(version_arg(&version)?)));
    answer(&s, outcome.map_err(|e| ("ready", e)))
}

async fn model_config(State(s): State<Arc<Server>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.model_config(&model, None)).map(json_response);
    answer(&s, outcome.map_err(|e| ("config", e)))
}

async fn model_config_v(
    State(s): State<Arc<Server>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let outcome =
        s.authorize(&headers).and_then(|_| s.model_config(&model, Some(version_arg(&version)?))).map(json_response);
    answer(&s, outcome.map_err(|e| ("config", e)))
}

async fn all_stats(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.stats_json(None, None)).map(json_response);
    answer(&s, outcome.map_err(|e| ("stats", e)))
}

async fn model_stats(State(s): State<Arc<Server>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.stats_json(Some(&model), None)).map(json_response);
    answer(&s, outcome.map_err(|e| ("stats", e)))
}

async fn model_stats_v(
    State(s): State<Arc<Server>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let outcome =
        s.authorize(&headers).and_then(|_| s.stats_json(Some(&model), Some(version_arg(&version)?))).map(json_response);
    answer(&s, outcome.map_err(|e| ("stats", e)))
}

/// The request body, bounded, decompressed (bounded again) when it says it is compressed.
/// The request body, decompressed, within `limit` bytes (before and after decompression);
/// `raise` says how to raise the limit (the server flag, or the model's config key).
async fn read_body(headers: &HeaderMap, body: Body, limit: usize, raise: &str) -> Result<Bytes> {
    let too_large = |what: &str, size: Option<usize>| {
        ServeError::new(
            Code::TooLarge,
            format!(
                "{what}{} exceeds the maximum allowed input size of {limit} bytes. {raise}",
                size.map(|s| format!(" of {s} bytes")).unwrap_or_default()
            ),
        )
    };
    let declared = headers.get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if let Some(size) = declared.filter(|&n| n > limit) {
        return Err(too_large("request body", Some(size)));
    }
    let raw = axum::body::to_bytes(body, limit).await.map_err(|_| too_large("request body", None))?;
    let encoding = headers.get("content-encoding").and_then(|v| v.to_str().ok()).unwrap_or("identity").trim();
    let mut inflated = Vec::new();
    let read = match encoding.to_ascii_lowercase().as_str() {
        "identity" | "" => return Ok(raw),
        "gzip" => flate2::read::GzDecoder::new(&raw[..]).take(limit as u64 + 1).read_to_end(&mut inflated),
        "deflate" => flate2::read::ZlibDecoder::new(&raw[..]).take(limit as u64 + 1).read_to_end(&mut inflated),
        other => {
            return Err(ServeError::new(
                Code::Unimplemented,
                format!("unsupported content encoding {other:?}; gzip and deflate are accepted"),
            ))
        }
    };
    read.map_err(|e| ServeError::invalid(format!("cannot decompress the {encoding} request body: {e}")))?;
    if inflated.len() > limit {
        return Err(too_large("decompressed request body", None));
    }
    Ok(Bytes::from(inflated))
}

#[derive(Debug, Deserialize)]
struct JsonRequest {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    inputs: Vec<JsonInput>,
    #[serde(default)]
    outputs: Option<Vec<JsonOutput>>,
}

#[derive(Debug, Deserialize)]
struct JsonInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(default)]
    data: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct JsonOutput {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

fn param(name: &str, value: &Value) -> Result<Param> {
    Ok(match value {
        Value::Bool(b) => Param::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Param::Int(i),
            (None, Some(u), _) => Param::Uint(u),
            (_, _, Some(x)) => Param::Float(x),
            _ => return Err(ServeError::invalid(format!("parameter '{name}': unreadable number"))),
        },
        Value::String(s) => Param::Str(s.clone()),
        _ => return Err(ServeError::invalid(format!("parameter '{name}' must be a string, number or boolean"))),
    })
}

/// Flattens a JSON `data` array (nested or flat, row-major) into numbers of `datatype`, with
/// at most `limit` elements (the dtype-expansion bound).
fn json_numbers(input: &str, datatype: Datatype, data: &Value, limit: usize) -> Result<Numbers> {
    let mut floats = Vec::new();
    let mut ints = Vec::new();
    let mut bools = Vec::new();
    let integral = !matches!(datatype, Datatype::Fp16 | Datatype::Fp32 | Datatype::Fp64 | Datatype::Bf16);
    let mut stack = vec![data];
    let mut count = 0usize;
    while let Some(value) = stack.pop() {
        match value {
            Value::Array(items) => stack.extend(items.iter().rev()),
            Value::Number(n) if integral => {
                let i = n.as_i64().ok_or_else(|| {
                    ServeError::invalid(format!("input '{input}': {n} is not an integer of {}", datatype.name()))
                })?;
                ints.push(i);
                count += 1;
            }
            Value::Number(n) => {
                floats.push(n.as_f64().unwrap_or(f64::NAN));
                count += 1;
            }
            Value::Bool(b) if datatype == Datatype::Bool => {
                bools.push(*b);
                count += 1;
            }
            other => {
                return Err(ServeError::invalid(format!(
                    "input '{input}': {} is not a value of datatype {}",
                    crate::models::truncate(&other.to_string(), 32),
                    datatype.name()
                )))
            }
        }
        if count > limit {
            return Err(ServeError::new(
                Code::TooLarge,
                format!("input '{input}' exceeds the maximum allowed input size; use --http-max-input-size to increase the limit"),
            ));
        }
    }
    Ok(if datatype == Datatype::Bool {
        Numbers::Bool(bools)
    } else if integral {
        Numbers::I64(ints)
    } else {
        Numbers::F64(floats)
    })
}

/// The request's JSON header and binary tensors, as a protocol-neutral request, plus whether
/// outputs default to binary.
fn parse_request(s: &Server, model: &ModelVersion, headers: &HeaderMap, body: Bytes) -> Result<(InferRequest, bool)> {
    let header_len = match headers.get(BINARY_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| ServeError::invalid(format!("{BINARY_HEADER} must be a non-negative integer")))?,
        ),
    };
    if header_len == Some(0) {
        return raw_binary_request(model, body);
    }
    let split = header_len.unwrap_or(body.len());
    if split > body.len() {
        return Err(ServeError::invalid(format!(
            "{BINARY_HEADER} is {split} but the body has only {} bytes",
            body.len()
        )));
    }
    let header = body.slice(..split);
    let mut binary = body.slice(split..);
    let parsed: JsonRequest = serde_json::from_slice(&header)
        .map_err(|e| ServeError::invalid(format!("failed to parse the request JSON: {e}")))?;
    let mut request = InferRequest {
        id: match parsed.id {
            None => String::new(),
            Some(Value::String(id)) => id,
            Some(other) => return Err(ServeError::invalid(format!("request id must be a string, got {other}"))),
        },
        ..Default::default()
    };
    let mut binary_output = false;
    for (key, value) in parsed.parameters.iter().flatten() {
        if key == "binary_data_output" {
            binary_output =
                value.as_bool().ok_or_else(|| ServeError::invalid("binary_data_output must be a boolean"))?;
        }
        request.params.push((key.clone(), param(key, value)?));
    }
    let limit = s.limits.http_max_input_size;
    for input in parsed.inputs {
        let size = input.parameters.as_ref().and_then(|p| p.get("binary_data_size"));
        let data = match (size, &input.data) {
            (Some(size), None) => {
                let size = size
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| ServeError::invalid(format!("input '{}': bad binary_data_size", input.name)))?;
                if size > binary.len() {
                    return Err(ServeError::invalid(format!(
                        "input '{}': binary_data_size {size} is more than the {} bytes left in the body",
                        input.name,
                        binary.len()
                    )));
                }
                InputData::Raw(binary.split_to(size))
            }
            (None, Some(data)) => {
                // Datatypes the input does not take are refused before their data is read.
                if let Some(spec) = model.entry.schema().inputs.iter().find(|s| s.name == input.name) {
                    infer::accepted_dtype(model, spec, &input.name, &input.datatype)?;
                }
                let datatype = Datatype::parse(&input.datatype).ok_or_else(|| {
                    ServeError::invalid(format!(
                        "input '{}': unknown datatype '{}'",
                        input.name,
                        crate::models::truncate(&input.datatype, 16)
                    ))
                })?;
                let max_elements = limit / datatype.size().unwrap_or(1).max(1);
                InputData::Numbers(json_numbers(&input.name, datatype, data, max_elements)?)
            }
            (Some(_), Some(_)) => {
                return Err(ServeError::invalid(format!("input '{}' has both data and binary_data_size", input.name)))
            }
            (None, None) => return Err(ServeError::invalid(format!("input '{}' has no data", input.name))),
        };
        request.inputs.push(InferInput { name: input.name, datatype: input.datatype, shape: input.shape, data });
    }
    if !binary.is_empty() {
        return Err(ServeError::invalid(format!(
            "{} bytes of binary data are not claimed by any input's binary_data_size",
            binary.len()
        )));
    }
    if let Some(outputs) = parsed.outputs {
        let mut wanted = Vec::new();
        for out in outputs {
            let binary = match out.parameters.as_ref().and_then(|p| p.get("binary_data")) {
                None => None,
                Some(v) => Some(v.as_bool().ok_or_else(|| ServeError::invalid("binary_data must be a boolean"))?),
            };
            wanted.push(RequestedOutput { name: out.name, binary });
        }
        request.outputs = Some(wanted);
    }
    Ok((request, binary_output))
}

/// `Inference-Header-Content-Length: 0`: the body is the only input's bytes, as a 1-D tensor.
fn raw_binary_request(model: &ModelVersion, body: Bytes) -> Result<(InferRequest, bool)> {
    let schema = model.entry.schema();
    let required: Vec<_> = schema.inputs.iter().filter(|i| !i.optional).collect();
    if required.len() != 1 {
        return Err(ServeError::invalid(format!(
            "a raw binary request needs a model with one input; '{}' has {}",
            model.model,
            required.len()
        )));
    }
    let accepted = required[0].dtypes(&schema.dtypes);
    let dtype =
        if accepted.contains(&opbridge_runtime::DType::F32) { opbridge_runtime::DType::F32 } else { accepted[0] };
    if body.len() % dtype.size() != 0 {
        return Err(ServeError::invalid(format!(
            "a raw binary request of {} bytes is not a whole number of {} elements",
            body.len(),
            Datatype::of(dtype).name()
        )));
    }
    let input = InferInput {
        name: required[0].name.clone(),
        datatype: Datatype::of(dtype).name().into(),
        shape: vec![(body.len() / dtype.size()) as i64],
        data: InputData::Raw(body),
    };
    Ok((InferRequest { inputs: vec![input], ..Default::default() }, true))
}

fn output_json(output: &Output) -> Value {
    let bytes = output.bytes();
    let data: Vec<Value> = match output.datatype {
        Datatype::Fp16 => {
            bytes.chunks_exact(2).map(|c| json!(half::f16::from_le_bytes([c[0], c[1]]).to_f32())).collect()
        }
        Datatype::Fp32 => {
            bytes.chunks_exact(4).map(|c| json!(f32::from_le_bytes(c.try_into().unwrap_or([0; 4])))).collect()
        }
        Datatype::Fp64 => {
            bytes.chunks_exact(8).map(|c| json!(f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))).collect()
        }
        Datatype::Int32 => {
            bytes.chunks_exact(4).map(|c| json!(i32::from_le_bytes(c.try_into().unwrap_or([0; 4])))).collect()
        }
        _ => bytes.chunks_exact(8).map(|c| json!(i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))).collect(),
    };
    Value::Array(data)
}

async fn infer_latest(
    State(s): State<Arc<Server>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    infer_http(s, model, None, headers, body).await
}

async fn infer_version(
    State(s): State<Arc<Server>>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match version_arg(&version) {
        Ok(v) => infer_http(s, model, Some(v), headers, body).await,
        Err(e) => answer(&s, Err(("infer", e))),
    }
}

async fn infer_http(s: Arc<Server>, model: String, version: Option<u32>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let front = async {
        s.authorize(&headers)?;
        let found = s.models.resolve(&model, version)?;
        let (limit, raise) = request_limit(&found, s.limits.http_max_input_size, "--http-max-input-size");
        let body = read_body(&headers, body, limit, &raise).await?;
        Ok::<_, ServeError>((found, body))
    };
    let (found, body) = match front.await {
        Ok(x) => x,
        Err(e) => return answer(&s, Err(("infer", e))),
    };
    // From here on the request belongs to a loaded model version: counted in its statistics.
    let outcome = async {
        let (request, binary_default) = parse_request(&s, &found, &headers, body)?;
        let id = request.id.clone();
        let outputs = infer::infer(Arc::clone(&found), request, s.limits.http_max_input_size).await?;
        Ok::<_, ServeError>(encode_response(&found, id, outputs, binary_default))
    }
    .await;
    s.finish(&found, outcome.as_ref().map(|_| ()), started);
    outcome.unwrap_or_else(IntoResponse::into_response)
}

/// The largest request `model` takes and how to raise it: the server's `flag`, or the
/// model's own `max_request_bytes` when that is lower.
pub(crate) fn request_limit(model: &ModelVersion, server_limit: usize, flag: &str) -> (usize, String) {
    let limit = model.request_limit(server_limit);
    if limit < server_limit {
        (limit, format!("The limit is max_request_bytes in the config.toml of model '{}'.", model.model))
    } else {
        (limit, format!("Use {flag} to increase the limit."))
    }
}

/// The response: JSON, or the JSON header followed by binary outputs (sent from the output
/// tensors' memory, not copied).
fn encode_response(model: &ModelVersion, id: String, outputs: Vec<Output>, binary_default: bool) -> Response {
    let mut described = Vec::new();
    let mut chunks: Vec<Bytes> = Vec::new();
    for output in outputs {
        let shape: Vec<u64> = output.shape.iter().map(|&d| d as u64).collect();
        let mut entry = json!({"name": output.name, "datatype": output.datatype.name(), "shape": shape});
        if output.binary.unwrap_or(binary_default) {
            entry["parameters"] = json!({"binary_data_size": output.bytes().len()});
            chunks.push(Bytes::from_owner(output.data));
        } else {
            entry["data"] = output_json(&output);
        }
        described.push(entry);
    }
    let mut header =
        json!({"model_name": model.model, "model_version": model.version.to_string(), "outputs": described});
    if !id.is_empty() {
        header["id"] = Value::String(id);
    }
    let header = Bytes::from(header.to_string());
    if chunks.is_empty() {
        return json_response_bytes(header);
    }
    let header_len = header.len();
    let total: usize = header_len + chunks.iter().map(Bytes::len).sum::<usize>();
    chunks.insert(0, header);
    let stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, Infallible>));
    let mut response = Response::new(Body::from_stream(stream));
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/octet-stream"));
    headers.insert(BINARY_HEADER, HeaderValue::from(header_len));
    headers.insert("content-length", HeaderValue::from(total));
    response
}

fn json_response_bytes(body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    response
}

#[derive(Debug, Deserialize, Default)]
struct IndexRequest {
    #[serde(default)]
    ready: bool,
}

async fn repository_index(State(s): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    index_response(s, None, headers, body)
}

async fn repository_index_of(
    State(s): State<Arc<Server>>,
    Path(repository): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    index_response(s, Some(repository), headers, body)
}

fn index_response(s: Arc<Server>, repository: Option<String>, headers: HeaderMap, body: Bytes) -> Response {
    let outcome = (|| {
        s.authorize(&headers)?;
        let request: IndexRequest = if body.iter().all(u8::is_ascii_whitespace) {
            IndexRequest::default()
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| ServeError::invalid(format!("failed to parse the request JSON: {e}")))?
        };
        let entries: Vec<Value> = s
            .models
            .index(request.ready, repository.as_deref())?
            .into_iter()
            .map(|e| {
                let mut v = json!({"name": e.name, "state": e.state, "reason": e.reason});
                if let Some(version) = e.version {
                    v["version"] = json!(version.to_string());
                }
                v
            })
            .collect();
        Ok(json_response(Value::Array(entries)))
    })();
    answer(&s, outcome.map_err(|e| ("repository", e)))
}

#[derive(Debug, Deserialize, Default)]
struct ControlRequest {
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

async fn repository_control(s: Arc<Server>, model: String, headers: HeaderMap, body: Bytes, load: bool) -> Response {
    let outcome = async {
        s.authorize_control(&headers)?;
        check_name(&model)?;
        let request: ControlRequest = if body.iter().all(u8::is_ascii_whitespace) {
            ControlRequest::default()
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| ServeError::invalid(format!("failed to parse the request JSON: {e}")))?
        };
        let mut dependents = false;
        for (key, value) in request.parameters.iter().flatten() {
            match key.as_str() {
                "unload_dependents" if !load => {
                    dependents = value.as_bool().ok_or_else(|| {
                        ServeError::invalid(format!("parameter 'unload_dependents' must be a boolean, got {value}"))
                    })?
                }
                "config" => {
                    return Err(ServeError::new(Code::Unimplemented, "loading with a config override is not supported"))
                }
                key if key.starts_with("file:") => {
                    return Err(ServeError::new(
                        Code::Unimplemented,
                        "loading model files from the request is not supported",
                    ))
                }
                other => {
                    return Err(ServeError::invalid(format!(
                        "unknown parameter '{}'",
                        crate::models::truncate(other, 64)
                    )))
                }
            }
        }
        s.control(&model, load, dependents).await?;
        Ok(json_response(json!({})))
    }
    .await;
    answer(&s, outcome.map_err(|e| ("repository", e)))
}

async fn repository_load(
    State(s): State<Arc<Server>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    repository_control(s, model, headers, body, true).await
}

async fn repository_unload(
    State(s): State<Arc<Server>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    repository_control(s, model, headers, body, false).await
}

/// The metrics port's router.
pub fn metrics_router(server: Arc<Server>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Arc<Server>>| async move {
                let mut response = s.metrics.render(&s.models).into_response();
                response
                    .headers_mut()
                    .insert("content-type", HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
                response
            }),
        )
        .fallback(|| async { ServeError::not_found("Not Found").into_response() })
        .with_state(server)
}
