//! Compiles the OJS gRPC binding's protos (proto/ojs/v1) with protox, so a
//! fresh machine needs no `protoc`, into prost messages and the tonic
//! server and client; the descriptor set is kept for server reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "ojs/v1/job.proto",
        "ojs/v1/worker.proto",
        "ojs/v1/queue.proto",
        "ojs/v1/workflow.proto",
        "ojs/v1/events.proto",
        "ojs/v1/service.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed=proto/{file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("ojs_v1.binpb");
    std::fs::write(out, prost::Message::encode_to_vec(&descriptors))?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
