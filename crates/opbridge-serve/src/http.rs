//! The HTTP/REST front end: KServe V2 with Triton's extensions (binary tensors, repository,
//! configuration, statistics). Every error is `{"error": "..."}` with Triton's status mapping.

use std::convert::Infallible;
use std::io::{Read, Write as _};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::header::{CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;

use crate::ab::{self, WeightedRoute};
use crate::datatype::Datatype;
use crate::error::{Code, Result, ServeError};
use crate::infer::{self, InferInput, InferRequest, InputData, Numbers, Output, Param, RequestedOutput};
use crate::models::{check_name, ModelVersion, Target};
use crate::repository::ModelConfig;
use crate::server::{Server, BINARY_HEADER};
use crate::sessions::SESSION_HEADER;
use crate::shm;

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
        .route("/v2/sessions", get(sessions_list))
        .route("/v2/sessions/{session}", get(session_stats))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready))
        .route("/v2/models/{model}/config", get(model_config))
        .route("/v2/models/{model}/versions/{version}/config", get(model_config))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(model_stats))
        .route("/v2/models/{model}/infer", post(infer_http))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_http))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/{repository}/index", post(repository_index))
        .route("/v2/repository/models/{model}/load", post(repository_load))
        .route("/v2/repository/models/{model}/unload", post(repository_unload))
        .route("/v2/systemsharedmemory/status", get(shm_status_all))
        .route("/v2/systemsharedmemory/region/{region}/status", get(shm_status))
        .route("/v2/systemsharedmemory/region/{region}/register", post(shm_register))
        .route("/v2/systemsharedmemory/unregister", post(shm_unregister_all))
        .route("/v2/systemsharedmemory/region/{region}/unregister", post(shm_unregister))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::map_response(json_errors))
        .with_state(server)
}

/// Every error body is `{"error": ...}` (tritonclient reads that key): the answers of axum's
/// own extractors and of anything else that is not JSON are rewrapped here.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response.headers().get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // Such bodies are one line of text; a longer one is cut, not buffered.
    let text = match axum::body::to_bytes(body, 4096).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_string() } else { text };
    parts.headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(CONTENT_LENGTH);
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        // axum's body limit left the rest of the body unread: the connection cannot go on.
        parts.headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    Response::from_parts(parts, Body::from(json!({ "error": message }).to_string()))
}

/// `{model}` and the optional `{version}` of a route; a bad value is a JSON 400 naming it.
#[derive(Debug)]
struct ModelPath {
    model: String,
    version: Option<u32>,
    repository: Option<String>,
}

impl FromRequestParts<Arc<Server>> for ModelPath {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<Server>) -> std::result::Result<Self, Response> {
        let reject = |error: ServeError| answer(state, Err(("other", error)));
        let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| reject(ServeError::invalid(e.body_text())))?;
        let mut path = ModelPath { model: String::new(), version: None, repository: None };
        for (key, value) in params {
            match key.as_str() {
                "model" => path.model = value,
                "version" => path.version = Some(version_arg(&value).map_err(reject)?),
                "repository" => path.repository = Some(value),
                _ => {}
            }
        }
        Ok(path)
    }
}

async fn not_found(State(server): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    answer_unread(&server, "other", ServeError::not_found("Not Found"), body, &headers).await
}

async fn method_not_allowed(State(server): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    let error = ServeError::new(Code::InvalidArgument, "Method Not Allowed");
    let mut response = answer_unread(&server, "other", error, body, &headers).await;
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(server): State<Arc<Server>>) -> Response {
    if server.is_ready() {
        StatusCode::OK.into_response()
    } else {
        // Triton answers 400 here; the body is JSON like every other error.
        ServeError::invalid("the server is not ready").into_response()
    }
}

fn version_arg(text: &str) -> Result<u32> {
    text.parse().map_err(|_| {
        ServeError::invalid(format!(
            "model version must be a non-negative integer, got '{}'",
            crate::models::truncate(text, 32)
        ))
    })
}

async fn server_metadata(State(server): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let outcome =
        server.authorize(&headers).map(|_| json_response(server.metadata_json())).map_err(|e| ("metadata", e));
    answer(&server, outcome)
}

async fn model_metadata(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.model_metadata(&p.model, p.version)).map(json_response);
    answer(&s, outcome.map_err(|e| ("metadata", e)))
}

async fn model_ready(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| match s.models.resolve(&p.model, p.version) {
        Ok(_) => Ok(StatusCode::OK.into_response()),
        Err(e) if e.code == Code::Unavailable => Err(ServeError::invalid("Model version not ready")),
        Err(e) => Err(e),
    });
    answer(&s, outcome.map_err(|e| ("ready", e)))
}

async fn model_config(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.model_config(&p.model, p.version)).map(json_response);
    answer(&s, outcome.map_err(|e| ("config", e)))
}

async fn all_stats(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.stats_json(None, None)).map(json_response);
    answer(&s, outcome.map_err(|e| ("stats", e)))
}

async fn model_stats(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.stats_json(Some(&p.model), p.version)).map(json_response);
    answer(&s, outcome.map_err(|e| ("stats", e)))
}

/// `GET /v2/sessions`: every live session's memory and requests.
async fn sessions_list(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let outcome = s.authorize(&headers).map(|_| json_response(s.sessions.list_json()));
    answer(&s, outcome.map_err(|e| ("sessions", e)))
}

/// `GET /v2/sessions/{id}`.
async fn session_stats(
    State(s): State<Arc<Server>>,
    axum::extract::Path(session): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| s.sessions.session_json(&session)).map(json_response);
    answer(&s, outcome.map_err(|e| ("sessions", e)))
}

/// How much of an unread body an early answer still drains to keep the connection, and for
/// how long; past either, the answer closes the connection instead.
const DRAIN_MAX_BYTES: usize = 4 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(2);

fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok())
}

/// An answer given before the request's body was read: the body is drained (bounded in bytes
/// and time) so the connection can carry the next request, or the answer says `Connection:
/// close`. Unread, hyper would drop the connection with no warning to a keep-alive client.
async fn answer_unread(
    s: &Server,
    endpoint: &'static str,
    error: ServeError,
    body: Body,
    headers: &HeaderMap,
) -> Response {
    drain_or_close(answer(s, Err((endpoint, error))), body, headers).await
}

/// `response` to a request whose body is still unread: see [`answer_unread`].
async fn drain_or_close(mut response: Response, body: Body, headers: &HeaderMap) -> Response {
    let drained = match declared_length(headers) {
        Some(n) if n > DRAIN_MAX_BYTES => false,
        _ => {
            matches!(tokio::time::timeout(DRAIN_MAX_TIME, axum::body::to_bytes(body, DRAIN_MAX_BYTES)).await, Ok(Ok(_)))
        }
    };
    if !drained {
        close_connection(&mut response);
    }
    response
}

fn close_connection(response: &mut Response) {
    response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
}

/// Why reading a body failed: over the limit (the body was left unread past it), or the body
/// itself is broken (bad chunked framing, a connection cut short).
#[derive(Debug)]
struct BodyError {
    error: ServeError,
    /// Whether part of the body is still unread.
    unread: bool,
}

/// The request body, decompressed, within `limit` bytes (before and after decompression);
/// `raise` says how to raise the limit (the server flag, or the model's config key).
async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    raise: &str,
) -> std::result::Result<Bytes, BodyError> {
    let too_large = |what: &str, size: Option<usize>| {
        ServeError::new(
            Code::TooLarge,
            format!(
                "{what}{} exceeds the maximum allowed input size of {limit} bytes. {raise}",
                size.map(|s| format!(" of {s} bytes")).unwrap_or_default()
            ),
        )
    };
    let encoding = headers.get(CONTENT_ENCODING).and_then(|v| v.to_str().ok()).unwrap_or("identity").trim();
    let encoding = encoding.to_ascii_lowercase();
    if !matches!(encoding.as_str(), "identity" | "" | "gzip" | "deflate") {
        let error = ServeError::new(
            Code::UnsupportedMediaType,
            format!(
                "unsupported content encoding '{}'; gzip and deflate are accepted",
                crate::models::truncate(&encoding, 32)
            ),
        );
        return Err(BodyError { error, unread: true });
    }
    if let Some(size) = declared_length(headers).filter(|&n| n > limit) {
        return Err(BodyError { error: too_large("request body", Some(size)), unread: true });
    }
    let mut stream = body.into_data_stream();
    let mut raw = bytes::BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError {
            error: ServeError::invalid(format!("cannot read the request body: {}", body_error_text(&e))),
            unread: false,
        })?;
        if raw.len() + chunk.len() > limit {
            return Err(BodyError { error: too_large("request body", None), unread: true });
        }
        raw.extend_from_slice(&chunk);
    }
    let raw = raw.freeze();
    let mut inflated = Vec::new();
    let read = match encoding.as_str() {
        "gzip" => flate2::read::GzDecoder::new(&raw[..]).take(limit as u64 + 1).read_to_end(&mut inflated),
        "deflate" => flate2::read::ZlibDecoder::new(&raw[..]).take(limit as u64 + 1).read_to_end(&mut inflated),
        _ => return Ok(raw),
    };
    read.map_err(|e| BodyError {
        error: ServeError::invalid(format!("cannot decompress the {encoding} request body: {e}")),
        unread: false,
    })?;
    if inflated.len() > limit {
        return Err(BodyError { error: too_large("decompressed request body", None), unread: false });
    }
    Ok(Bytes::from(inflated))
}

/// The innermost cause of a body error (hyper's "invalid chunk size line", not axum's wrapper).
fn body_error_text(error: &axum::Error) -> String {
    let mut source: &dyn std::error::Error = error;
    while let Some(inner) = source.source() {
        source = inner;
    }
    source.to_string()
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

/// Triton parses JSON with rapidjson's `kParseNanAndInfFlag`: bare `NaN`, `Infinity` and
/// `-Infinity` are numbers. serde_json refuses them, so outside strings they are rewritten as
/// strings (a NUL, then the token) that the readers below take back as the number. `None`:
/// nothing to rewrite (the usual case, no copy).
fn rewrite_non_finite(text: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let (mut in_string, mut escaped) = (false, false);
    let mut i = 0;
    let mut copied = 0;
    while i < text.len() {
        let b = text[i];
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            i += 1;
            continue;
        }
        // Only these bytes can start a token: the usual digits cost one comparison each.
        let token = match b {
            b'N' | b'I' | b'-' => {
                ["NaN", "Infinity", "-Infinity"].into_iter().find(|t| text[i..].starts_with(t.as_bytes()))
            }
            _ => None,
        };
        match token {
            Some(token) => {
                let out = out.get_or_insert_with(|| Vec::with_capacity(text.len() + 64));
                out.extend_from_slice(&text[copied..i]);
                out.extend_from_slice(b"\"\\u0000");
                out.extend_from_slice(token.as_bytes());
                out.push(b'"');
                i += token.len();
                copied = i;
            }
            None => {
                in_string = b == b'"';
                i += 1;
            }
        }
    }
    let mut out = out?;
    out.extend_from_slice(&text[copied..]);
    Some(out)
}

/// The number a rewritten `NaN` / `Infinity` / `-Infinity` stands for.
fn non_finite(text: &str) -> Option<f64> {
    match text.strip_prefix('\0')? {
        "NaN" => Some(f64::NAN),
        "Infinity" => Some(f64::INFINITY),
        "-Infinity" => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

/// A JSON value as the client wrote it (a rewritten non-finite number as its token), cut.
fn as_written(value: &Value) -> String {
    match value {
        Value::String(s) if non_finite(s).is_some() => s[1..].to_string(),
        other => crate::models::truncate(&other.to_string(), 32),
    }
}

fn param(name: &str, value: &Value) -> Result<Param> {
    Ok(match value {
        Value::String(s) if non_finite(s).is_some() => Param::Float(non_finite(s).unwrap_or(f64::NAN)),
        Value::Array(items) => {
            Param::Ints(items.iter().map(Value::as_i64).collect::<Option<_>>().ok_or_else(|| {
                ServeError::invalid(format!(
                    "parameter '{name}': a list parameter holds integers, got {}",
                    as_written(value)
                ))
            })?)
        }
        Value::Bool(b) => Param::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Param::Int(i),
            (None, Some(u), _) => Param::Uint(u),
            (_, _, Some(x)) => Param::Float(x),
            _ => return Err(ServeError::invalid(format!("parameter '{name}': unreadable number"))),
        },
        Value::String(s) => Param::Str(s.clone()),
        _ => {
            return Err(ServeError::invalid(format!(
                "parameter '{name}' must be a string, number, boolean or list of integers, got {}",
                as_written(value)
            )))
        }
    })
}

/// Flattens a JSON `data` array (nested or flat, row-major) into numbers of `datatype`, within
/// `limit_bytes` once expanded to the datatype (the dtype-expansion bound).
fn json_numbers(input: &str, datatype: Datatype, data: &Value, limit_bytes: usize) -> Result<Numbers> {
    let limit = limit_bytes / datatype.size().unwrap_or(1).max(1);
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
            Value::String(s) if !integral && non_finite(s).is_some() => {
                floats.push(non_finite(s).unwrap_or(f64::NAN));
                count += 1;
            }
            Value::Bool(b) if datatype == Datatype::Bool => {
                bools.push(*b);
                count += 1;
            }
            other => {
                return Err(ServeError::invalid(format!(
                    "input '{input}': {} is not a value of datatype {}",
                    as_written(other),
                    datatype.name()
                )))
            }
        }
        if count > limit {
            return Err(ServeError::new(
                Code::TooLarge,
                format!(
                    "input '{input}' as {} exceeds the maximum allowed input size of {limit_bytes} bytes. Use \
                     --http-max-input-size to increase the limit.",
                    datatype.name()
                ),
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

/// A request body before a version is chosen: its JSON header parsed, its binary tensors not.
#[derive(Debug)]
enum SplitRequest {
    /// `Inference-Header-Content-Length: 0`: the body is the only input's bytes.
    Raw(Bytes),
    Json {
        parsed: JsonRequest,
        binary: Bytes,
    },
}

fn split_request(headers: &HeaderMap, body: Bytes) -> Result<SplitRequest> {
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
        return Ok(SplitRequest::Raw(body));
    }
    let split = header_len.unwrap_or(body.len());
    if split > body.len() {
        return Err(ServeError::invalid(format!(
            "{BINARY_HEADER} is {split} but the body has only {} bytes",
            body.len()
        )));
    }
    let header = body.slice(..split);
    let binary = body.slice(split..);
    let parsed: std::result::Result<JsonRequest, _> = match rewrite_non_finite(&header) {
        Some(rewritten) => serde_json::from_slice(&rewritten),
        None => serde_json::from_slice(&header),
    };
    let parsed = parsed.map_err(|e| ServeError::invalid(format!("failed to parse the request JSON: {e}")))?;
    Ok(SplitRequest::Json { parsed, binary })
}

/// A weighted model's routing key: parameter `ab_key`, else `session_id`, else the
/// `opbridge-session` header.
fn routing_key(split: &SplitRequest, headers: &HeaderMap) -> Result<Option<Vec<u8>>> {
    if let SplitRequest::Json { parsed, .. } = split {
        let params = parsed.parameters.as_ref();
        if let Some((name, value)) = ab::KEY_PARAMS.iter().find_map(|k| params.and_then(|p| p.get_key_value(*k))) {
            return Ok(Some(ab::key_text(&param(name, value)?).into_bytes()));
        }
    }
    Ok(headers.get(SESSION_HEADER).map(|v| v.as_bytes().to_vec()))
}

/// The split request as a protocol-neutral request for `model`, plus whether outputs default
/// to binary.
fn convert_request(
    s: &Server,
    model: &ModelVersion,
    split: SplitRequest,
    owner: &[u8],
) -> Result<(InferRequest, bool)> {
    let (parsed, mut binary) = match split {
        SplitRequest::Raw(body) => return raw_binary_request(model, body),
        SplitRequest::Json { parsed, binary } => (parsed, binary),
    };
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
    let owner = shm::owner_of(owner, &request.params)?;
    let limit = s.limits.http_max_input_size;
    for input in parsed.inputs {
        let keys = input.parameters.iter().flat_map(|p| p.keys().map(String::as_str));
        infer::check_tensor_params("input", &input.name, keys, &INPUT_PARAMS)?;
        let shm = s.shm.tensor(owner, "input", &input.name, &tensor_params(input.parameters.as_ref())?)?;
        let size = input.parameters.as_ref().and_then(|p| p.get("binary_data_size"));
        let data = match (size, &input.data, shm) {
            (None, None, Some(slice)) => InputData::Shm(slice),
            (_, _, Some(_)) => {
                return Err(ServeError::invalid(format!(
                    "input '{}' is in shared memory: it cannot also have data or binary_data_size",
                    input.name
                )))
            }
            (Some(size), None, None) => {
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
            (None, Some(data), None) => {
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
                InputData::Numbers(json_numbers(&input.name, datatype, data, limit)?)
            }
            (Some(_), Some(_), None) => {
                return Err(ServeError::invalid(format!("input '{}' has both data and binary_data_size", input.name)))
            }
            (None, None, None) => return Err(ServeError::invalid(format!("input '{}' has no data", input.name))),
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
            let keys = out.parameters.iter().flat_map(|p| p.keys().map(String::as_str));
            infer::check_tensor_params("output", &out.name, keys, &OUTPUT_PARAMS)?;
            let binary = match out.parameters.as_ref().and_then(|p| p.get("binary_data")) {
                None => None,
                Some(v) => Some(v.as_bool().ok_or_else(|| ServeError::invalid("binary_data must be a boolean"))?),
            };
            let shm = s.shm.tensor(owner, "output", &out.name, &tensor_params(out.parameters.as_ref())?)?;
            wanted.push(RequestedOutput { name: out.name, binary, shm });
        }
        request.outputs = Some(wanted);
    }
    Ok((request, binary_output))
}

const INPUT_PARAMS: [&str; 4] =
    ["binary_data_size", shm::TENSOR_PARAMS[0], shm::TENSOR_PARAMS[1], shm::TENSOR_PARAMS[2]];
const OUTPUT_PARAMS: [&str; 4] = ["binary_data", shm::TENSOR_PARAMS[0], shm::TENSOR_PARAMS[1], shm::TENSOR_PARAMS[2]];

/// A tensor's parameters as the protocol-neutral values.
fn tensor_params(parameters: Option<&Map<String, Value>>) -> Result<Vec<(String, Param)>> {
    parameters.into_iter().flatten().map(|(key, value)| Ok((key.clone(), param(key, value)?))).collect()
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

/// Writes a number as JSON; for the non-finite, Triton's tokens (what rapidjson writes and
/// Python's `json` reads), where serde_json would write `null`.
fn push_number<T: serde::Serialize + Into<f64> + Copy>(out: &mut Vec<u8>, x: T) {
    let wide: f64 = x.into();
    if wide.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if wide.is_infinite() {
        out.extend_from_slice(if wide > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else {
        // serde_json's writer: the shortest text that reads back (f32 as f32), no allocation.
        let _ = serde_json::to_writer(&mut *out, &x);
    }
}

/// An output's values as a flat JSON array.
fn push_output_data(out: &mut Vec<u8>, output: &Output) {
    let bytes = output.bytes();
    out.push(b'[');
    let mut first = true;
    let mut sep = |out: &mut Vec<u8>| {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
    };
    match output.datatype {
        Datatype::Fp16 => bytes.chunks_exact(2).for_each(|c| {
            sep(out);
            push_number(out, half::f16::from_le_bytes([c[0], c[1]]).to_f32());
        }),
        Datatype::Fp32 => bytes.chunks_exact(4).for_each(|c| {
            sep(out);
            push_number(out, f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        }),
        Datatype::Fp64 => bytes.chunks_exact(8).for_each(|c| {
            sep(out);
            push_number(out, f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
        }),
        Datatype::Int32 => bytes.chunks_exact(4).for_each(|c| {
            sep(out);
            push_number(out, i32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        }),
        _ => bytes.chunks_exact(8).for_each(|c| {
            sep(out);
            // Integers are never non-finite (and i64 has no lossless f64).
            let _ =
                serde_json::to_writer(&mut *out, &i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
        }),
    }
    out.push(b']');
}

/// A JSON string literal.
fn json_str(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// A shared-memory region's owner: the caller's session (none: the empty one).
fn shm_owner(headers: &HeaderMap) -> &[u8] {
    headers.get(SESSION_HEADER).map_or(&[][..], |v| v.as_bytes())
}

/// The JSON list of the caller's regions (`region`: that one, 404 when it has none such).
fn shm_status_of(s: &Server, headers: &HeaderMap, region: Option<&str>) -> Response {
    let outcome = s.authorize(headers).and_then(|_| s.shm.status(shm_owner(headers), region));
    let list = |regions: Vec<Arc<shm::Region>>| json_response(regions.iter().map(|r| r.json()).collect());
    answer(s, outcome.map(list).map_err(|e| ("shared_memory", e)))
}

async fn shm_status_all(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    shm_status_of(&s, &headers, None)
}

async fn shm_status(State(s): State<Arc<Server>>, Path(region): Path<String>, headers: HeaderMap) -> Response {
    shm_status_of(&s, &headers, Some(&region))
}

#[derive(Debug, Deserialize)]
struct ShmRegisterBody {
    key: String,
    #[serde(default)]
    offset: u64,
    byte_size: u64,
}

async fn shm_register(
    State(s): State<Arc<Server>>,
    Path(region): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let outcome = s.authorize(&headers).and_then(|_| {
        let body: ShmRegisterBody = serde_json::from_slice(&body).map_err(|e| {
            ServeError::invalid(format!("a register request is {{\"key\", \"offset\", \"byte_size\"}}: {e}"))
        })?;
        s.shm.register(shm_owner(&headers), &region, &body.key, body.offset, body.byte_size)
    });
    answer(&s, outcome.map(|()| json_response(json!({}))).map_err(|e| ("shared_memory", e)))
}

fn shm_unregister_of(s: &Server, headers: &HeaderMap, region: Option<&str>) -> Response {
    let outcome = s.authorize(headers).and_then(|_| s.shm.unregister(shm_owner(headers), region));
    answer(s, outcome.map(|()| json_response(json!({}))).map_err(|e| ("shared_memory", e)))
}

async fn shm_unregister_all(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    shm_unregister_of(&s, &headers, None)
}

async fn shm_unregister(State(s): State<Arc<Server>>, Path(region): Path<String>, headers: HeaderMap) -> Response {
    shm_unregister_of(&s, &headers, Some(&region))
}

/// `POST .../infer`, with or without a version.
async fn infer_http(
    State(s): State<Arc<Server>>,
    p: std::result::Result<ModelPath, Response>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let p = match p {
        Ok(p) => p,
        Err(rejection) => return drain_or_close(rejection, body, &headers).await,
    };
    // Auth and the model first: neither needs the body, which is then drained or abandoned.
    let front = s.authorize(&headers).and_then(|_| s.models.target(&p.model, p.version));
    let found = match front {
        Ok(Target::Version(found)) => found,
        Ok(Target::Weighted(route)) => return infer_weighted(s, &p.model, route, headers, body, started).await,
        Err(e) => return answer_unread(&s, "infer", e, body, &headers).await,
    };
    let (limit, raise) = request_limit(&found, s.limits.http_max_input_size, "--http-max-input-size");
    let body = match read_infer_body(&s, &headers, body, limit, &raise).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    infer_on(&s, &found, &headers, started, || split_request(&headers, body)).await
}

/// The body of an inference request within `limit`, or the answer refusing it (which closes
/// the connection when part of the body is left unread).
async fn read_infer_body(
    s: &Server,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    raise: &str,
) -> std::result::Result<Bytes, Response> {
    read_body(headers, body, limit, raise).await.map_err(|BodyError { error, unread }| {
        let mut response = answer(s, Err(("infer", error)));
        if unread {
            close_connection(&mut response);
        }
        response
    })
}

/// Serves a read request on the version `found`: from here on it belongs to that version,
/// counted in its statistics (errors of `split` included), as CANCELED if the client goes away
/// first (hyper then drops this future).
async fn infer_on(
    s: &Server,
    found: &Arc<ModelVersion>,
    headers: &HeaderMap,
    started: Instant,
    split: impl FnOnce() -> Result<SplitRequest>,
) -> Response {
    let mut pending = infer::Pending::new(Arc::clone(found), started, "http");
    let outcome = async {
        let (request, binary_default) = convert_request(s, found, split()?, shm_owner(headers))?;
        pending.identify(&request.id);
        let id = request.id.clone();
        let session = s.session_lease(&request, headers.get(SESSION_HEADER).map(|v| v.as_bytes()), found)?;
        let outputs = infer::infer(Arc::clone(found), request, s.limits.http_max_input_size, session).await?;
        Ok::<_, ServeError>(encode_response(found, id, outputs, binary_default))
    }
    .await;
    pending.finish(outcome.as_ref().map(|_| ()));
    outcome.unwrap_or_else(IntoResponse::into_response)
}

/// An unversioned request to a model with `[ab]` weights: the body is read first (its
/// parameters may hold the routing key), within the largest limit of the versions it may go
/// to; the version chosen then checks its own limit and serves it.
async fn infer_weighted(
    s: Arc<Server>,
    model: &str,
    route: Arc<WeightedRoute>,
    headers: HeaderMap,
    body: Body,
    started: Instant,
) -> Response {
    let server_limit = s.limits.http_max_input_size;
    let limit = route.request_limit(server_limit);
    let raise = limit_hint(model, limit, server_limit, "--http-max-input-size");
    let body = match read_infer_body(&s, &headers, body, limit, &raise).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let size = body.len();
    // Parse errors come before any version is chosen: front-end rejections, like a bad path.
    let routed = split_request(&headers, body).and_then(|split| Ok((routing_key(&split, &headers)?, split)));
    let (key, split) = match routed {
        Ok(routed) => routed,
        Err(e) => return answer(&s, Err(("infer", e))),
    };
    let found = route.pick(key.as_deref());
    drop(route);
    let within_limit = || {
        let (limit, raise) = request_limit(&found, server_limit, "--http-max-input-size");
        if size > limit {
            return Err(ServeError::new(
                Code::TooLarge,
                format!(
                    "request body of {size} bytes exceeds the maximum allowed input size of {limit} bytes of version \
                     {}. {raise}",
                    found.version
                ),
            ));
        }
        Ok(split)
    };
    infer_on(&s, &found, &headers, started, within_limit).await
}

/// The largest request `model` takes and how to raise it: the server's `flag`, or the
/// model's own `max_request_bytes` when that is lower.
pub(crate) fn request_limit(model: &ModelVersion, server_limit: usize, flag: &str) -> (usize, String) {
    let limit = model.request_limit(server_limit);
    (limit, limit_hint(&model.model, limit, server_limit, flag))
}

fn limit_hint(model: &str, limit: usize, server_limit: usize, flag: &str) -> String {
    if limit < server_limit {
        format!("The limit is max_request_bytes in the config.toml of model '{model}'.")
    } else {
        format!("Use {flag} to increase the limit.")
    }
}

/// The response: JSON, or the JSON header followed by binary outputs (sent from the output
/// tensors' memory, not copied). The JSON is written here, not by serde_json, which has no
/// NaN / Infinity.
fn encode_response(model: &ModelVersion, id: String, outputs: Vec<Output>, binary_default: bool) -> Response {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut header: Vec<u8> = Vec::with_capacity(256);
    let _ = write!(header, "{{\"model_name\":{},\"model_version\":\"{}\"", json_str(&model.model), model.version);
    if !id.is_empty() {
        let _ = write!(header, ",\"id\":{}", json_str(&id));
    }
    header.extend_from_slice(b",\"outputs\":[");
    for (k, output) in outputs.into_iter().enumerate() {
        if k > 0 {
            header.push(b',');
        }
        let shape: Vec<String> = output.shape.iter().map(usize::to_string).collect();
        let _ = write!(
            header,
            "{{\"name\":{},\"datatype\":\"{}\",\"shape\":[{}]",
            json_str(&output.name),
            output.datatype.name(),
            shape.join(",")
        );
        if let Some(slice) = &output.shm {
            let params: Map<String, Value> = slice.params().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            let _ = write!(header, ",\"parameters\":{}}}", Value::Object(params));
        } else if let (true, Some(data)) = (output.binary.unwrap_or(binary_default), &output.data) {
            let _ = write!(header, ",\"parameters\":{{\"binary_data_size\":{}}}}}", data.as_ref().len());
            chunks.push(Bytes::from_owner(output.data.expect("matched")));
        } else {
            header.extend_from_slice(b",\"data\":");
            push_output_data(&mut header, &output);
            header.push(b'}');
        }
    }
    header.extend_from_slice(b"]}");
    let header = Bytes::from(header);
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

async fn repository_index(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap, body: Bytes) -> Response {
    index_response(s, p.repository, headers, body)
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
        let mut config = None;
        for (key, value) in request.parameters.iter().flatten() {
            match key.as_str() {
                "unload_dependents" if !load => {
                    dependents = value.as_bool().ok_or_else(|| {
                        ServeError::invalid(format!("parameter 'unload_dependents' must be a boolean, got {value}"))
                    })?
                }
                "config" if load => {
                    let text = value.as_str().ok_or_else(|| {
                        ServeError::invalid("parameter 'config' must be a string holding a JSON object")
                    })?;
                    config = Some(
                        ModelConfig::parse_json(text)
                            .map_err(|e| ServeError::invalid(format!("parameter 'config': {e}")))?,
                    );
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
        s.control(&model, load, dependents, config).await?;
        Ok(json_response(json!({})))
    }
    .await;
    answer(&s, outcome.map_err(|e| ("repository", e)))
}

async fn repository_load(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap, body: Bytes) -> Response {
    repository_control(s, p.model, headers, body, true).await
}

async fn repository_unload(State(s): State<Arc<Server>>, p: ModelPath, headers: HeaderMap, body: Bytes) -> Response {
    repository_control(s, p.model, headers, body, false).await
}

/// Serves `router` on `listener` until `stop` completes: HTTP/1.1, each request's head read
/// within `header_timeout` (a slowloris client is cut off); then stops accepting and lets the
/// connections finish the requests they carry.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// The metrics port's router.
pub fn metrics_router(server: Arc<Server>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Arc<Server>>| async move {
                let mut response = s.metrics.render(&s.models, &s.sessions).into_response();
                response
                    .headers_mut()
                    .insert("content-type", HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
                response
            }),
        )
        .fallback(|| async { ServeError::not_found("Not Found").into_response() })
        .layer(axum::middleware::map_response(json_errors))
        .with_state(server)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_tokens_are_rewritten_outside_strings_only() {
        assert_eq!(rewrite_non_finite(br#"{"id": "-Infinity", "data": [1, -2.5e3]}"#), None, "nothing to do: no copy");
        let text = br#"{"id": "NaN \"Infinity\"", "data": [NaN, -Infinity, Infinity, 1]}"#;
        let rewritten = rewrite_non_finite(text).expect("tokens to rewrite");
        let value: Value = serde_json::from_slice(&rewritten).expect("valid JSON");
        assert_eq!(value["id"], "NaN \"Infinity\"", "strings are left alone");
        let data = value["data"].as_array().expect("an array");
        assert!(non_finite(data[0].as_str().unwrap_or_default()).is_some_and(f64::is_nan));
        assert_eq!(non_finite(data[1].as_str().unwrap_or_default()), Some(f64::NEG_INFINITY));
        assert_eq!(non_finite(data[2].as_str().unwrap_or_default()), Some(f64::INFINITY));
        assert_eq!(data[3], 1);
    }

    #[test]
    fn floats_are_json_numbers_or_tritons_tokens() {
        let mut out = Vec::new();
        for x in [1.0, -0.5, 1e300, 1e-7, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            push_number(&mut out, x);
            out.push(b',');
        }
        push_number(&mut out, 0.1f32);
        assert_eq!(String::from_utf8_lossy(&out), "1.0,-0.5,1e+300,1e-7,NaN,Infinity,-Infinity,0.1");
    }
}
