//! Compiles our Triton-compatible `.proto` files with a pure-Rust compiler (protox): no system
//! `protoc` on a clean machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(["grpc_service.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        // Raw tensor contents as `Bytes`: slices of the received message, not a copy each.
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_fds(files)?;
    Ok(())
}
