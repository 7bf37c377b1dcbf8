//! The model table and the HTTP router, without sockets: name and version resolution, load /
//! unload states, repository models, and requests through the axum router (tower's `oneshot`).

use std::path::Path;
use std::sync::Arc;

use axum::body::Body;
use http::{Request, StatusCode};
use opbridge_serve::error::Code;
use opbridge_serve::models::{ExecOptions, Models};
use opbridge_serve::repository::Repository;
use opbridge_serve::server::{ControlMode, Limits, Server};
use serde_json::{json, Value};
use tower::ServiceExt;

fn builtins() -> Arc<opbridge_ops::Registry> {
    let registry = opbridge_ops::Registry::new();
    opbridge_ops::register_builtins(&registry).expect("built-ins register");
    registry
}

fn exec() -> ExecOptions {
    ExecOptions { workers: 1, queue: 8 }
}

fn builtin_models() -> Arc<Models> {
    let models = Arc::new(Models::new(builtins(), true, Vec::new(), exec()));
    models.discover(true);
    models
}

#[test]
fn unversioned_requests_resolve_to_the_latest_version() {
    let models = builtin_models();
    let latest = models.resolve("add", None).expect("add is served");
    let versions: Vec<u32> = models.versions_of("add").unwrap().iter().map(|v| v.version).collect();
    assert_eq!(Some(&latest.version), versions.iter().max());
    assert_eq!(models.resolve("add", Some(1)).unwrap().version, 1);
}

#[test]
fn unknown_names_and_versions_are_not_found_and_path_names_are_invalid() {
    let models = builtin_models();
    assert_eq!(models.resolve("no_such_op", None).unwrap_err().code, Code::NotFound);
    assert_eq!(models.resolve("add", Some(999)).unwrap_err().code, Code::NotFound);
    for name in ["../add", "a/b", "a\\b", "", " ", "x\0y", ".."] {
        assert_eq!(models.resolve(name, None).unwrap_err().code, Code::InvalidArgument, "{name:?}");
    }
}

#[test]
fn an_unloaded_model_is_unavailable_until_loaded_again() {
    let models = builtin_models();
    models.unload("softmax", false).unwrap();
    let error = models.resolve("softmax", None).unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert!(error.message.contains("not loaded"), "{}", error.message);
    assert_eq!(models.resolve("softmax", Some(1)).unwrap_err().code, Code::Unavailable);
    let entry = models.index(false, None).unwrap().into_iter().find(|e| e.name == "softmax").unwrap();
    assert!(entry.reason.contains("RSS") && entry.reason.contains("pool"), "{}", entry.reason);
    models.load("softmax").unwrap();
    assert!(models.resolve("softmax", None).is_ok());
    // Unloading what is not loaded, or loading what is, is not an error (Triton's behaviour).
    models.load("softmax").unwrap();
    models.unload("softmax", false).unwrap();
    models.unload("softmax", false).unwrap();
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

#[test]
fn repository_alias_models_fix_attributes_and_shadow_builtins() {
    let root = std::env::temp_dir().join(format!("opbridge-router-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    write(&root.join("rows/config.toml"), "[alias]\nop = \"softmax\"\n[alias.attributes]\naxis = -1\n");
    // A folder named like a built-in shadows it: here `relu` becomes an alias of `abs`.
    write(&root.join("relu/config.toml"), "[alias]\nop = \"abs\"\n");
    write(&root.join("broken/config.toml"), "colour = 1\n");
    let repository = Repository::open(&root).unwrap();
    let models = Models::new(builtins(), false, vec![repository], exec());
    models.discover(false);
    // Explicit mode: known, not loaded.
    assert_eq!(models.resolve("rows", None).unwrap_err().code, Code::Unavailable);
    // Built-ins are not served with serve_builtins = false.
    assert_eq!(models.resolve("add", None).unwrap_err().code, Code::NotFound);
    models.load("rows").unwrap();
    let rows = models.resolve("rows", None).unwrap();
    assert_eq!(rows.version, 1);
    assert_eq!(rows.fixed.len(), 1);
    assert_eq!(rows.fixed[0].0, "axis");
    models.load("relu").unwrap();
    assert_eq!(models.resolve("relu", None).unwrap().entry.schema().name, "abs");
    let error = models.load("broken").unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument);
    assert!(error.message.contains("failed to load 'broken'") && error.message.contains("colour"), "{error}");
    let index = models.index(false, None).unwrap();
    let broken = index.iter().find(|e| e.name == "broken").unwrap();
    assert_eq!(broken.state, "UNAVAILABLE");
    assert!(broken.reason.contains("colour"), "{}", broken.reason);
    std::fs::remove_dir_all(&root).unwrap();
}

fn server() -> Arc<Server> {
    let server = Arc::new(Server::new(
        builtin_models(),
        Limits { http_max_input_size: 1 << 20, grpc_max_message_size: 1 << 20 },
        None,
        None,
        ControlMode::None,
    ));
    server.set_ready(true);
    server
}

async fn send(server: &Arc<Server>, request: Request<Body>) -> (StatusCode, axum::body::Bytes) {
    let response = opbridge_serve::http::router(Arc::clone(server)).oneshot(request).await.unwrap();
    let status = response.status();
    (status, axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap())
}

fn post_json(path: &str, body: &Value) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()
}

#[tokio::test]
async fn json_inference_through_the_router_matches_the_operator() {
    let server = server();
    let request = json!({
        "id": "r1",
        "inputs": [
            {"name": "a", "shape": [2, 2], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]},
            {"name": "b", "shape": [2], "datatype": "FP32", "data": [0.5, -1.0]},
        ],
    });
    let (status, body) = send(&server, post_json("/v2/models/add/infer", &request)).await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["id"], "r1");
    assert_eq!(answer["outputs"][0]["name"], "out");
    assert_eq!(answer["outputs"][0]["shape"], json!([2, 2]));
    assert_eq!(answer["outputs"][0]["data"], json!([1.5, 1.0, 3.5, 3.0]));
}

#[tokio::test]
async fn binary_inference_through_the_router_returns_raw_output_bytes() {
    let server = server();
    let a: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let header = json!({
        "inputs": [
            {"name": "a", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 12}},
            {"name": "b", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 12}},
        ],
        "outputs": [{"name": "out", "parameters": {"binary_data": true}}],
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend_from_slice(&a);
    body.extend_from_slice(&a);
    let request = Request::post("/v2/models/add/infer")
        .header("inference-header-content-length", header.len().to_string())
        .body(Body::from(body))
        .unwrap();
    let (status, body) = send(&server, request).await;
    assert_eq!(status, StatusCode::OK);
    let tail: Vec<f32> = body[body.len() - 12..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(tail, [2.0, 4.0, 6.0]);

    // A binary_data_size that does not match shape × type size is refused, never reinterpreted.
    let header = json!({
        "inputs": [
            {"name": "a", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
            {"name": "b", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
        ],
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend_from_slice(&[0u8; 24]);
    let request = Request::post("/v2/models/add/infer")
        .header("inference-header-content-length", header.len().to_string())
        .body(Body::from(body))
        .unwrap();
    let (status, body) = send(&server, request).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body:?}");
}

#[tokio::test]
async fn client_mistakes_are_json_4xx_before_compute() {
    let server = server();
    let input = |name: &str, shape: Value, datatype: &str, data: Value| json!({"name": name, "shape": shape, "datatype": datatype, "data": data});
    let cases = [
        // element count vs shape
        (
            json!({"inputs": [input("a", json!([3]), "FP32", json!([1, 2])), input("b", json!([3]), "FP32", json!([1, 2, 3]))]}),
            "elements",
        ),
        // negative and overflowing dims
        (
            json!({"inputs": [input("a", json!([-1]), "FP32", json!([1])), input("b", json!([1]), "FP32", json!([1]))]}),
            "negative",
        ),
        (
            json!({"inputs": [input("a", json!([i64::MAX, 4]), "FP32", json!([1])), input("b", json!([1]), "FP32", json!([1]))]}),
            "a",
        ),
        // a datatype the op does not take, one that does not exist
        (
            json!({"inputs": [input("a", json!([1]), "BYTES", json!(["x"])), input("b", json!([1]), "FP32", json!([1]))]}),
            "BYTES",
        ),
        (
            json!({"inputs": [input("a", json!([1]), "FP128", json!([1])), input("b", json!([1]), "FP32", json!([1]))]}),
            "FP128",
        ),
        // missing, unknown, duplicate inputs; unknown output; unknown parameter
        (json!({"inputs": [input("a", json!([1]), "FP32", json!([1]))]}), "missing"),
        (
            json!({"inputs": [input("a", json!([1]), "FP32", json!([1])), input("b", json!([1]), "FP32", json!([1])), input("c", json!([1]), "FP32", json!([1]))]}),
            "'c'",
        ),
        (
            json!({"inputs": [input("a", json!([1]), "FP32", json!([1])), input("a", json!([1]), "FP32", json!([1]))]}),
            "twice",
        ),
        (
            json!({"inputs": [input("a", json!([1]), "FP32", json!([1])), input("b", json!([1]), "FP32", json!([1]))], "outputs": [{"name": "nope"}]}),
            "nope",
        ),
        (
            json!({"parameters": {"colour": 1}, "inputs": [input("a", json!([1]), "FP32", json!([1])), input("b", json!([1]), "FP32", json!([1]))]}),
            "colour",
        ),
        // shapes the operator refuses (a kernel-side check, still a client mistake)
        (
            json!({"inputs": [input("a", json!([2]), "FP32", json!([1, 2])), input("b", json!([3]), "FP32", json!([1, 2, 3]))]}),
            "shape",
        ),
    ];
    for (request, words) in cases {
        let (status, body) = send(&server, post_json("/v2/models/add/infer", &request)).await;
        assert!(status.is_client_error(), "{status} for {request}: {body:?}");
        let error: Value = serde_json::from_slice(&body).unwrap_or_else(|_| panic!("not JSON: {body:?}"));
        let message = error["error"].as_str().unwrap();
        assert!(message.contains(words), "{message:?} should name {words:?} ({request})");
    }
    // Not JSON at all; an unknown model; a path-like model name; a wrong method.
    let (status, _) = send(&server, Request::post("/v2/models/add/infer").body(Body::from("{")).unwrap()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = send(&server, post_json("/v2/models/nope/infer", &json!({"inputs": []}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = send(&server, post_json("/v2/models/..%2Fadd/infer", &json!({"inputs": []}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = send(&server, Request::get("/v2/models/add/infer").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    // Nothing above reached a kernel or counted as a server failure.
    assert_eq!(send(&server, Request::get("/v2/health/live").body(Body::empty()).unwrap()).await.0, StatusCode::OK);
}
