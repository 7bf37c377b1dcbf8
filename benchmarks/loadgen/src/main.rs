//! `opbridge-loadgen`: a closed-loop load generator for KServe V2 / Triton inference servers, so
//! that a benchmark measures the server's ceiling rather than a Python client's.
//!
//! N connections (HTTP/1.1 keep-alive, or one HTTP/2 connection each for gRPC), one request in
//! flight per connection, a fixed number of requests shared between them after a warm-up.
//! The model takes two FP32 inputs `a` and `b` of `--n` elements and returns `out = a + b`; a
//! sample of the responses is checked element by element. One JSON line goes to stdout:
//! req/s, latency percentiles (µs), tensor payload throughput, errors.
//!
//! ```text
//! opbridge-loadgen --mode grpc --url 127.0.0.1:8001 --model add --n 4 --connections 8 --requests 20000
//! ```
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use clap::{Parser, ValueEnum};
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::net::TcpStream;

#[allow(clippy::all, dead_code, missing_debug_implementations, missing_docs, rustdoc::all)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/inference.rs"));
}

/// The Triton binary tensor extension's header: the JSON part's length.
const BINARY_HEADER: &str = "inference-header-content-length";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// HTTP/1.1, binary tensor extension (inputs and output as raw bytes after a JSON header).
    Http,
    /// HTTP/1.1, JSON tensors (`data` arrays), as servers without the extension need.
    HttpJson,
    /// gRPC `ModelInfer` with `raw_input_contents`.
    Grpc,
}

/// Closed-loop load on a V2 server's `add`-like model (FP32 `a`, `b` → `out`).
#[derive(Debug, Parser)]
#[command(name = "opbridge-loadgen", version)]
struct Args {
    #[arg(long, value_enum, default_value = "grpc")]
    mode: Mode,
    /// Server address: `host:port`, with or without `http://`.
    #[arg(long)]
    url: String,
    #[arg(long, default_value = "add")]
    model: String,
    /// Elements per input tensor.
    #[arg(long, default_value_t = 4)]
    n: usize,
    /// Concurrent connections, one request in flight on each.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Timed requests, all connections together.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Untimed requests first, all connections together.
    #[arg(long, default_value_t = 500)]
    warmup: usize,
    /// Client runtime threads (1: a single-threaded runtime, the cheapest client).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Check the values of every k-th response (the first one always).
    #[arg(long, default_value_t = 64)]
    check_every: usize,
    /// A label copied into the JSON line.
    #[arg(long, default_value = "")]
    label: String,
    /// Server process whose CPU time (user + system, from `/proc/PID/stat`) is read around the
    /// timed requests (repeatable: a server's processes are summed).
    #[arg(long = "server-pid")]
    server_pids: Vec<u32>,
}

/// What every request sends and every checked response must hold.
#[derive(Debug)]
struct Work {
    mode: Mode,
    authority: String,
    /// Every request's URI and headers, built once (a request clones them).
    uri: http::Uri,
    headers: http::HeaderMap,
    body: Bytes,
    expected: Vec<f32>,
    check_every: usize,
}

#[derive(Debug, Default)]
struct Tally {
    latencies_ns: Vec<u64>,
    errors: usize,
    wrong: usize,
    first_error: Option<String>,
}

impl Tally {
    fn error(&mut self, message: String) {
        self.errors += 1;
        self.first_error.get_or_insert(message);
    }
}

#[derive(Debug)]
enum Conn {
    Http1(http1::SendRequest<Full<Bytes>>),
    Http2(http2::SendRequest<Full<Bytes>>),
}

fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..n).map(|i| (i % 1000) as f32 * 0.25).collect();
    let b = (0..n).map(|i| 1.0 + (i % 7) as f32).collect();
    (a, b)
}

fn le_bytes(values: &[f32]) -> Bytes {
    let mut out = BytesMut::with_capacity(values.len() * 4);
    values.iter().for_each(|v| out.put_f32_le(*v));
    out.freeze()
}

fn work(args: &Args) -> Work {
    let n = args.n;
    let (a, b) = inputs(n);
    let expected: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let authority = args.url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let (path, body, header_len) = match args.mode {
        Mode::Http => {
            let tensor = |name: &str| {
                serde_json::json!({"name": name, "datatype": "FP32", "shape": [n],
                    "parameters": {"binary_data_size": n * 4}})
            };
            let header = serde_json::json!({
                "inputs": [tensor("a"), tensor("b")],
                "outputs": [{"name": "out", "parameters": {"binary_data": true}}],
            })
            .to_string();
            let mut body = BytesMut::with_capacity(header.len() + 8 * n);
            body.put_slice(header.as_bytes());
            body.put(le_bytes(&a));
            body.put(le_bytes(&b));
            (format!("/v2/models/{}/infer", args.model), body.freeze(), header.len())
        }
        Mode::HttpJson => {
            let tensor = |name: &str, data: &[f32]| serde_json::json!({"name": name, "datatype": "FP32", "shape": [n], "data": data});
            let body = serde_json::json!({"inputs": [tensor("a", &a), tensor("b", &b)]}).to_string();
            (format!("/v2/models/{}/infer", args.model), Bytes::from(body), 0)
        }
        Mode::Grpc => {
            let tensor = |name: &str| proto::model_infer_request::InferInputTensor {
                name: name.into(),
                datatype: "FP32".into(),
                shape: vec![n as i64],
                ..Default::default()
            };
            let request = proto::ModelInferRequest {
                model_name: args.model.clone(),
                inputs: vec![tensor("a"), tensor("b")],
                outputs: vec![proto::model_infer_request::InferRequestedOutputTensor {
                    name: "out".into(),
                    ..Default::default()
                }],
                raw_input_contents: vec![le_bytes(&a), le_bytes(&b)],
                ..Default::default()
            };
            // gRPC length-prefixed message: uncompressed flag, big-endian length, message.
            let len = request.encoded_len();
            let mut body = BytesMut::with_capacity(5 + len);
            body.put_u8(0);
            body.put_u32(len as u32);
            request.encode(&mut body).expect("capacity reserved");
            ("/inference.GRPCInferenceService/ModelInfer".into(), body.freeze(), 0)
        }
    };
    let mut headers = http::HeaderMap::new();
    let host = || HeaderValue::from_str(&authority).expect("an address");
    match args.mode {
        Mode::Http => {
            headers.insert("content-type", HeaderValue::from_static("application/octet-stream"));
            headers.insert(BINARY_HEADER, HeaderValue::from(header_len));
            headers.insert("host", host());
        }
        Mode::HttpJson => {
            headers.insert("content-type", HeaderValue::from_static("application/json"));
            headers.insert("host", host());
        }
        Mode::Grpc => {
            headers.insert("content-type", HeaderValue::from_static("application/grpc"));
            headers.insert("te", HeaderValue::from_static("trailers"));
        }
    }
    // HTTP/1.1 takes the path alone (and the Host header); HTTP/2 the absolute URI.
    let uri = match args.mode {
        Mode::Grpc => format!("http://{authority}{path}"),
        _ => path.clone(),
    };
    let uri = uri.parse().expect("a valid URI");
    Work { mode: args.mode, authority, uri, headers, body, expected, check_every: args.check_every.max(1) }
}

async fn connect(work: &Work) -> Result<Conn, String> {
    let tcp = TcpStream::connect(&work.authority).await.map_err(|e| format!("connect {}: {e}", work.authority))?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let io = TokioIo::new(tcp);
    match work.mode {
        Mode::Http | Mode::HttpJson => {
            let (sender, conn) = http1::handshake(io).await.map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
            tokio::spawn(conn);
            Ok(Conn::Http1(sender))
        }
        Mode::Grpc => {
            // Large windows: an 8 MB request must not wait on 64 KiB window updates.
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .initial_stream_window_size(32 << 20)
                .initial_connection_window_size(64 << 20)
                .max_frame_size((1 << 24) - 1)
                .handshake(io)
                .await
                .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
            tokio::spawn(conn);
            Ok(Conn::Http2(sender))
        }
    }
}

fn request(work: &Work) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::new(work.body.clone()));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = work.uri.clone();
    *request.headers_mut() = work.headers.clone();
    request
}

/// One request; `Ok(false)` when it answered with wrong values.
async fn one(conn: &mut Conn, work: &Work, check: bool) -> Result<bool, String> {
    let response = match conn {
        Conn::Http1(sender) => {
            sender.ready().await.map_err(|e| format!("connection: {e}"))?;
            sender.send_request(request(work)).await
        }
        Conn::Http2(sender) => {
            sender.ready().await.map_err(|e| format!("connection: {e}"))?;
            sender.send_request(request(work)).await
        }
    }
    .map_err(|e| format!("request: {e}"))?;
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.map_err(|e| format!("response body: {e}"))?;
    let trailers = collected.trailers().cloned(); // a few bytes: grpc-status and grpc-message
    let body = collected.to_bytes();
    if parts.status != StatusCode::OK {
        return Err(format!("HTTP {}: {}", parts.status, String::from_utf8_lossy(&body[..body.len().min(300)])));
    }
    match work.mode {
        Mode::Http => {
            let header_len: usize = parts
                .headers
                .get(BINARY_HEADER)
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .ok_or("no Inference-Header-Content-Length in the response")?;
            let raw = body.get(header_len..).ok_or("binary header longer than the body")?;
            if raw.len() != work.expected.len() * 4 {
                return Err(format!("output of {} bytes, expected {}", raw.len(), work.expected.len() * 4));
            }
            Ok(!check || same_bytes(raw, &work.expected))
        }
        Mode::HttpJson => {
            if !check {
                return Ok(true);
            }
            let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| format!("response JSON: {e}"))?;
            let data = value["outputs"][0]["data"].as_array().ok_or("no outputs[0].data in the response")?;
            Ok(data.len() == work.expected.len()
                && data.iter().zip(&work.expected).all(|(v, e)| v.as_f64().map(|x| x as f32) == Some(*e)))
        }
        Mode::Grpc => {
            let status = trailers
                .as_ref()
                .and_then(|t| t.get("grpc-status"))
                .or_else(|| parts.headers.get("grpc-status"))
                .and_then(|v| v.to_str().ok())
                .unwrap_or("missing");
            if status != "0" {
                let message = trailers
                    .as_ref()
                    .and_then(|t| t.get("grpc-message"))
                    .or_else(|| parts.headers.get("grpc-message"))
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                return Err(format!("grpc-status {status}: {message}"));
            }
            if body.len() < 5 || body[0] != 0 {
                return Err("not an uncompressed gRPC message".into());
            }
            let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
            if len != body.len() - 5 {
                return Err(format!("gRPC frame of {len} bytes in a body of {}", body.len()));
            }
            if !check {
                // Unchecked responses: a whole frame with OK status is enough (decoding every
                // one would make the client, not the server, the bottleneck).
                return Ok(true);
            }
            let message = body.slice(5..);
            let reply = proto::ModelInferResponse::decode(message).map_err(|e| format!("response message: {e}"))?;
            let raw = reply.raw_output_contents.first().ok_or("no raw_output_contents")?;
            if raw.len() != work.expected.len() * 4 {
                return Err(format!("output of {} bytes, expected {}", raw.len(), work.expected.len() * 4));
            }
            Ok(!check || same_bytes(raw, &work.expected))
        }
    }
}

fn same_bytes(raw: &[u8], expected: &[f32]) -> bool {
    raw.chunks_exact(4).zip(expected).all(|(c, e)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) == *e)
}

/// Runs `total` requests over every connection; gives the connections back with the tally.
async fn phase(conns: Vec<Conn>, work: &Arc<Work>, total: usize, record: bool) -> (Vec<Conn>, Tally) {
    let issued = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let (work, issued) = (Arc::clone(work), Arc::clone(&issued));
            tokio::spawn(async move {
                let mut tally = Tally::default();
                if record {
                    tally.latencies_ns.reserve(total);
                }
                loop {
                    let k = issued.fetch_add(1, Ordering::Relaxed);
                    if k >= total {
                        break;
                    }
                    let started = Instant::now();
                    match one(&mut conn, &work, k % work.check_every == 0).await {
                        Ok(right) => {
                            if record {
                                tally.latencies_ns.push(started.elapsed().as_nanos() as u64);
                            }
                            if !right {
                                tally.wrong += 1;
                            }
                        }
                        Err(e) => {
                            tally.error(e);
                            // A broken connection is not retried: stop this one.
                            if conn_closed(&conn) {
                                break;
                            }
                        }
                    }
                }
                (conn, tally)
            })
        })
        .collect();
    let mut conns = Vec::new();
    let mut all = Tally::default();
    for task in tasks {
        let (conn, tally) = task.await.expect("a connection task panicked");
        conns.push(conn);
        all.latencies_ns.extend(tally.latencies_ns);
        all.errors += tally.errors;
        all.wrong += tally.wrong;
        if all.first_error.is_none() {
            all.first_error = tally.first_error;
        }
    }
    (conns, all)
}

fn conn_closed(conn: &Conn) -> bool {
    match conn {
        Conn::Http1(s) => s.is_closed(),
        Conn::Http2(s) => s.is_closed(),
    }
}

/// CPU seconds (user + system) of `pids` so far, from `/proc/PID/stat`; `None` when unreadable.
fn cpu_seconds(pids: &[u32]) -> Option<f64> {
    // USER_HZ: the unit of /proc's tick counts, 100 on every Linux ABI the project builds for.
    const TICKS_PER_SECOND: f64 = 100.0;
    if pids.is_empty() {
        return None;
    }
    let mut ticks = 0u64;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        ticks += fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    }
    Some(ticks as f64 / TICKS_PER_SECOND)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1e3
}

async fn run(args: Args) -> Result<serde_json::Value, String> {
    let work = Arc::new(work(&args));
    let mut conns = Vec::with_capacity(args.connections);
    for _ in 0..args.connections.max(1) {
        conns.push(connect(&work).await?);
    }
    let (conns, warm) = phase(conns, &work, args.warmup, false).await;
    let cpu_before = cpu_seconds(&args.server_pids);
    let started = Instant::now();
    let (_conns, mut tally) = phase(conns, &work, args.requests, true).await;
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let server_cpu = cpu_before.zip(cpu_seconds(&args.server_pids)).map(|(a, b)| b - a);
    tally.latencies_ns.sort_unstable();
    let ok = tally.latencies_ns.len();
    let lat = &tally.latencies_ns;
    let mean = if ok == 0 { 0.0 } else { lat.iter().sum::<u64>() as f64 / ok as f64 / 1e3 };
    // Tensor payload: both inputs sent and the output received, per successful request.
    let payload = 3 * args.n * 4;
    let gbps = (ok * payload) as f64 / seconds / 1e9;
    let connections = args.connections.max(1);
    Ok(serde_json::json!({
        "label": args.label,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "url": args.url,
        "model": args.model,
        "n": args.n,
        "connections": connections,
        "requests": args.requests,
        "ok": ok,
        "errors": tally.errors + warm.errors,
        "wrong": tally.wrong + warm.wrong,
        "first_error": tally.first_error.or(warm.first_error),
        "seconds": seconds,
        "req_per_s": ok as f64 / seconds,
        "mean_us": mean,
        "p50_us": percentile(lat, 50.0),
        "p90_us": percentile(lat, 90.0),
        "p99_us": percentile(lat, 99.0),
        "max_us": lat.last().map_or(0.0, |&x| x as f64 / 1e3),
        "payload_bytes_per_request": payload,
        "payload_gb_per_s": gbps,
        "payload_gb_per_s_per_connection": gbps / connections as f64,
        "server_cpu_s": server_cpu,
        "server_cpu_us_per_request": server_cpu.filter(|_| ok > 0).map(|s| s * 1e6 / ok as f64),
    }))
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opbridge-loadgen: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(report) => {
            println!("{report}");
            let clean = report["errors"] == 0 && report["wrong"] == 0;
            // Let the connections' tasks wind down without waiting on the server.
            runtime.shutdown_timeout(Duration::from_millis(100));
            if clean {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("opbridge-loadgen: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
