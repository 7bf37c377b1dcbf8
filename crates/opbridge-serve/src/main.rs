//! `opbridge-serve`: the standalone server binary (the same flags as `opbridge serve`).

fn main() -> std::process::ExitCode {
    opbridge_serve::main_with_args(std::env::args_os())
}
