//! Compiles proto/invoices.proto with protox (no protoc needed) and
//! generates the tonic server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/invoices.proto");
    let descriptors = protox::compile(["invoices.proto"], ["proto"])?;
    // The FileDescriptorSet too: what the daemon's `descriptor_set` reads
    // (`invoices descriptor-set FILE` writes it out).
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("invoices.binpb");
    std::fs::write(out, prost::Message::encode_to_vec(&descriptors))?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
