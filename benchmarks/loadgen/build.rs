//! The server's own `.proto` files, compiled as its build script does (protox, pure Rust: no
//! system `protoc`); messages only, the load generator frames gRPC itself over hyper's HTTP/2.
#![forbid(unsafe_code)]

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "../../crates/opbridge-serve/proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let files = protox::compile(["grpc_service.proto"], [PROTO])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_fds(files)?;
    Ok(())
}
