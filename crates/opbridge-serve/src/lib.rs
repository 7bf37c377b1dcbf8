//! `opbridge serve`: opbridge operators served over the KServe V2 / Triton protocol.
//!
//! - [`models`]: every registered operator is a model; its versions are the op's versions.
//! - [`executor`]: each loaded version's bounded queue and compute workers (no kernel-sized
//!   work on the async runtime's threads: only calls of at most 64 KiB in and out, see
//!   [`infer::infer`]).
//! - [`infer`]: one inference, protocol-neutral: validate, decode into pooled memory, run.
//! - [`http`] and [`grpc`]: the two front ends; [`metrics`]: Prometheus text with Triton's names.

pub mod ab;
pub mod batch;
pub mod cli;
pub mod crossovers;
pub mod datatype;
pub mod error;
pub mod executor;
pub mod grpc;
pub mod http;
pub mod infer;
pub mod metrics;
pub mod models;
pub mod repository;
pub mod server;
pub mod sessions;
pub mod shm;

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;

use crate::cli::{LogFormat, ServeArgs};
use crate::models::{ExecOptions, Models};
use crate::repository::Repository;
use crate::server::{ControlMode, Limits, Server, Token};

/// Parses `args` (the program name first) and runs the server until SIGTERM / SIGINT.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = match ServeArgs::try_parse_from(args) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    init_logging(&args);
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("opbridge serve: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--workers-per-model`, 0 resolved: one per CPU this process may run on (its affinity mask,
/// a container's CPU limit), at most 2. A worker per CPU beyond what the process can use only
/// adds lock hand-offs and context switches: with one CPU, one worker.
fn workers_per_model(flag: usize) -> usize {
    match flag {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(2),
        n => n,
    }
}

fn init_logging(args: &ServeArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match args.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.with_ansi(false).try_init(),
    };
}

fn read_token(path: &Option<std::path::PathBuf>, flag: &str) -> Result<Option<Token>, String> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path).map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if text.trim().is_empty() {
        return Err(format!("{flag} {}: the file is empty", path.display()));
    }
    Ok(Some(Token::new(&text)))
}

/// Builds the model table, binds every listener, prints the ready line, and serves until
/// SIGTERM / SIGINT; then stops accepting, lets requests in flight finish (bounded), unloads.
pub fn run(args: ServeArgs) -> Result<(), String> {
    let auth = read_token(&args.auth_token_file, "--auth-token-file")?;
    let control_token = read_token(&args.control_token_file, "--control-token-file")?;
    let repositories =
        args.repositories.iter().map(|path| Repository::open(path)).collect::<Result<Vec<_>, String>>()?;
    if args.model_control_mode != ControlMode::Explicit && !args.load_models.is_empty() {
        return Err("--load-model needs --model-control-mode explicit (the other modes load every model)".into());
    }
    // Models may name `device = "ascend:0"`: the backend loads ACL only when a model asks for it.
    opbridge_ascend::register();
    // The crossovers of `device = "auto"` models: a broken file named on the command line stops
    // the server; the default one (the Python package's) is only warned about.
    let (path, given) = match &args.crossovers {
        Some(path) => (Some(path.clone()), true),
        None => (crossovers::default_path(), false),
    };
    if let Some(path) = path {
        match crossovers::load(&path) {
            Ok(applied) => {
                tracing::info!(file = %path.display(), applied, "host/device crossovers (device = \"auto\")")
            }
            Err(e) if given => return Err(format!("--crossovers: {e}")),
            Err(e) => tracing::warn!("ignoring the saved crossovers: {e}"),
        }
    }
    // Built-ins are always registered: alias models may name them even with --no-builtins.
    let builtins = opbridge_ops::Registry::new();
    opbridge_ops::register_builtins(&builtins).map_err(|e| e.to_string())?;
    executor::set_compute_nice(args.compute_nice);
    let models = Arc::new(Models::new(
        builtins,
        !args.no_builtins,
        repositories,
        ExecOptions { workers: workers_per_model(args.workers_per_model), queue: args.max_queue_size },
    ));
    match args.model_control_mode {
        ControlMode::None | ControlMode::Poll => models.discover(true),
        ControlMode::Explicit => {
            models.discover(false);
            for name in &args.load_models {
                models.load(name).map_err(|e| format!("--load-model {name}: {e}"))?;
            }
        }
    }
    let regions = if args.allow_shared_memory { shm::Regions::allowed()? } else { shm::Regions::default() };
    let server = Arc::new(
        Server::new(
            Arc::clone(&models),
            Limits { http_max_input_size: args.http_max_input_size, grpc_max_message_size: args.grpc_max_message_size },
            auth,
            control_token,
            args.model_control_mode,
        )
        .with_sessions(sessions::SessionLimits {
            quota: args.session_quota,
            max_sessions: args.max_sessions as usize,
            idle: Duration::from_secs(args.session_idle_secs),
            ..sessions::SessionLimits::default()
        })
        .with_shared_memory(regions),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("opbridge-serve-io")
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let served = runtime.block_on(serve(args, Arc::clone(&server)));
    // Requests in flight have finished (or the grace period is over): the handlers still
    // running are dropped with the runtime, so no response is being written from memory that
    // is released below (an accelerator's pinned blocks go with the driver).
    runtime.shutdown_timeout(Duration::from_secs(1));
    served?;
    // Unload everything.
    models.unload_all();
    // Ascend models' work is done: cached device memory goes back and ACL is finalized (a no-op
    // when no model used the device).
    if let Err(e) = opbridge_ascend::shutdown() {
        tracing::warn!("releasing the Ascend devices: {e}");
    }
    tracing::info!("stopped");
    Ok(())
}

async fn bind(host: &str, port: u16, what: &str) -> Result<TcpListener, String> {
    TcpListener::bind((host, port)).await.map_err(|e| format!("cannot listen for {what} on {host}:{port}: {e}"))
}

async fn serve(args: ServeArgs, server: Arc<Server>) -> Result<(), String> {
    // Handlers first: a SIGTERM sent right after the ready line must drain, not kill.
    let signals = install_signals()?;
    let header_timeout = read_timeout()?;
    let http = bind(&args.host, args.http_port, "HTTP").await?;
    let grpc = bind(&args.host, args.grpc_port, "gRPC").await?;
    let metrics = bind(&args.host, args.metrics_port, "metrics").await?;
    let addr = |l: &TcpListener| l.local_addr().map(|a: SocketAddr| a.to_string()).unwrap_or_default();
    let ready_line =
        serde_json::json!({"event": "ready", "http": addr(&http), "grpc": addr(&grpc), "metrics": addr(&metrics)});

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let http_task = tokio::spawn(http::serve(http, http::router(Arc::clone(&server)), header_timeout, stopped()));
    let metrics_task =
        tokio::spawn(http::serve(metrics, http::metrics_router(Arc::clone(&server)), header_timeout, stopped()));
    let grpc_task = tokio::spawn(grpc::serve(grpc, Arc::clone(&server), stopped()));
    if args.model_control_mode == ControlMode::Poll {
        tokio::spawn(poll_repositories(
            Arc::clone(&server.models),
            Duration::from_secs(args.repository_poll_secs.max(1)),
            stopped(),
        ));
    }

    tokio::spawn(expire_sessions(Arc::clone(&server), stopped()));
    server.set_ready(true);
    {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{ready_line}");
        let _ = stdout.flush();
    }
    tracing::info!(%ready_line, "serving");

    wait_for_signal(signals).await;
    tracing::info!("shutting down: no new connections; requests in flight finish");
    server.set_ready(false);
    for version in server.models.loaded() {
        version.executor.hurry();
    }
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs(args.exit_timeout_secs);
    let all = async {
        let _ = http_task.await;
        let _ = grpc_task.await;
        let _ = metrics_task.await;
    };
    if tokio::time::timeout(grace, all).await.is_err() {
        tracing::warn!("requests still in flight after {}s: stopping anyway", args.exit_timeout_secs);
    }
    Ok(())
}

/// How long a client may take to send a request's head (`OPBRIDGE_SERVE_READ_TIMEOUT_MS`,
/// default 30 s): a slowloris client holding connections open is cut off after it, and so is
/// a keep-alive connection idle that long (hyper times the next head from the last answer).
fn read_timeout() -> Result<Duration, String> {
    const VAR: &str = "OPBRIDGE_SERVE_READ_TIMEOUT_MS";
    match std::env::var(VAR) {
        Err(_) => Ok(Duration::from_secs(30)),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
            _ => Err(format!("{VAR} must be a positive number of milliseconds, got '{text}'")),
        },
    }
}

/// Releases idle sessions, checking a few times per idle period (at least every second).
async fn expire_sessions(server: Arc<Server>, stopped: impl std::future::Future<Output = ()>) {
    tokio::pin!(stopped);
    let every = (server.sessions.limits().idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut ticks = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = ticks.tick() => { server.sessions.expire(); }
        }
    }
}

/// Poll mode: rescans the repositories every `every` until the server stops (the scan and
/// any load run on a blocking thread, one scan at a time).
async fn poll_repositories(models: Arc<Models>, every: Duration, stopped: impl std::future::Future<Output = ()>) {
    tokio::pin!(stopped);
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await; // the first tick is immediate: the start already loaded everything
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = ticks.tick() => {
                let models = Arc::clone(&models);
                let _ = tokio::task::spawn_blocking(move || models.poll()).await;
            }
        }
    }
}

#[cfg(unix)]
type Signals = (tokio::signal::unix::Signal, tokio::signal::unix::Signal);
#[cfg(not(unix))]
type Signals = ();

#[cfg(unix)]
fn install_signals() -> Result<Signals, String> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate()).map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
    let int = signal(SignalKind::interrupt()).map_err(|e| format!("cannot handle SIGINT: {e}"))?;
    Ok((term, int))
}

#[cfg(not(unix))]
fn install_signals() -> Result<Signals, String> {
    Ok(())
}

async fn wait_for_signal(signals: Signals) {
    #[cfg(unix)]
    {
        let (mut term, mut int) = signals;
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let () = signals;
        let _ = tokio::signal::ctrl_c().await;
    }
}
