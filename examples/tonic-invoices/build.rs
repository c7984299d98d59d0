//! Compiles proto/invoices.proto with protox (no protoc needed) and
//! generates the tonic server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/invoices.proto");
    let descriptors = protox::compile(["invoices.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
