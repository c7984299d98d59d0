//! Compiles the schemas with protox (a pure-Rust protobuf compiler) so that a
//! fresh machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/openjobspec/v1/job.proto",
        "proto/grpcq/message.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    prost_build::Config::new()
        // BTreeMap keeps map encodings byte-stable, which tests rely on.
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
