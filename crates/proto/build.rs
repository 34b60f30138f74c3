//! Generates the Rust types, their proto3 JSON mapping and (with the `grpc` feature) the gRPC
//! service from `proto/`, with a vendored protoc, so a plain `cargo build` works on a machine without protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = out.join("descriptors.bin");
    let protos = ["proto/bettercompute/agent/v1/agent.proto"];
    let mut config = prost_build::Config::new();
    config.file_descriptor_set_path(&descriptors).btree_map(["."]);
    #[cfg(feature = "grpc")]
    {
        // No transport in this crate: the gateway and the daemon bring tonic's transport and TLS.
        tonic_prost_build::configure().build_transport(false).compile_with_config(config, &protos, &["proto"])?;
    }
    #[cfg(not(feature = "grpc"))]
    config.compile_protos(&protos, &["proto"])?;
    pbjson_build::Builder::new()
        .register_descriptors(&std::fs::read(&descriptors)?)?
        .btree_map(["."])
        .build(&[".bettercompute"])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
