//! The command line: Triton's flag names where Triton has one.

use std::path::PathBuf;

use clap::Parser;

use crate::server::ControlMode;

/// Serve opbridge operators over the KServe V2 / Triton protocol (HTTP and gRPC).
#[derive(Debug, Clone, Parser)]
#[command(name = "opbridge serve", version)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// gRPC port (0 picks a free one).
    #[arg(long, default_value_t = 8001)]
    pub grpc_port: u16,
    /// Prometheus metrics port (0 picks a free one).
    #[arg(long, default_value_t = 8002)]
    pub metrics_port: u16,
    /// A model repository folder (repeatable).
    #[arg(long = "repository")]
    pub repositories: Vec<PathBuf>,
    /// none: load everything at start; explicit: load with --load-model or the repository API;
    /// poll: also follow changes of the repository folders.
    #[arg(long, value_enum, default_value = "none")]
    pub model_control_mode: ControlMode,
    /// A model to load at start in explicit mode (repeatable).
    #[arg(long = "load-model")]
    pub load_models: Vec<String>,
    /// Seconds between repository polls in poll mode.
    #[arg(long, default_value_t = 15)]
    pub repository_poll_secs: u64,
    /// Do not serve the built-in operators.
    #[arg(long)]
    pub no_builtins: bool,
    /// Largest HTTP request body, decompressed body and input after JSON expansion, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub http_max_input_size: usize,
    /// Largest gRPC message, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub grpc_max_message_size: usize,
    /// A file holding the bearer token every inference and metadata request must present.
    #[arg(long)]
    pub auth_token_file: Option<PathBuf>,
    /// A file holding the bearer token repository load/unload requests must present.
    #[arg(long)]
    pub control_token_file: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log level (error, warn, info, debug, trace) or a tracing filter.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Compute workers per model version (0: as many as the CPUs this process may use, at most 2).
    #[arg(long, default_value_t = 0)]
    pub workers_per_model: usize,
    /// Nice levels below the process's that compute workers run at (0: the same as the I/O
    /// threads), so that a woken worker does not preempt the I/O thread request by request.
    #[arg(long, default_value_t = crate::executor::DEFAULT_COMPUTE_NICE, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub compute_nice: i32,
    /// The host/device crossovers for `device = "auto"` models: what `ob.calibrate()` saved
    /// (default: `crossovers.json` in opbridge's cache folder, where the Python package keeps it).
    #[arg(long, value_name = "PATH")]
    pub crossovers: Option<std::path::PathBuf>,
    /// Requests queued per model version before 503 / UNAVAILABLE.
    #[arg(long, default_value_t = 1024)]
    pub max_queue_size: usize,
    /// Byte quota of a session's pool for a model (a model's config.toml may set session_quota).
    #[arg(long, default_value_t = 1 << 30)]
    pub session_quota: usize,
    /// Sessions that may exist at once (a request naming a new one beyond: 503 / UNAVAILABLE).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sessions: u64,
    /// Seconds without requests after which a session and its pools are released.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub session_idle_secs: u64,
    /// Allow system shared memory (Triton's extension): clients register /dev/shm regions and
    /// name them instead of sending tensors' bytes. Off by default, as Triton.
    #[arg(long)]
    pub allow_shared_memory: bool,
    /// Seconds to let requests in flight finish after SIGTERM / SIGINT.
    #[arg(long, default_value_t = 30)]
    pub exit_timeout_secs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}
