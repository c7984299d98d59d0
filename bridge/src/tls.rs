//! TLS of the daemon's listener: a PEM certificate chain and key, and with
//! a client CA, mutual TLS (a client without a certificate that CA signed
//! is refused during the handshake). ALPN offers `h2` and `http/1.1`, so
//! the same port serves both over TLS.

use std::path::Path;
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::{ConfigError, HttpConfig};

fn invalid(field: &str, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_owned(),
        reason: reason.to_string(),
    }
}

fn certificates(field: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| invalid(field, format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(
            field,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

/// The listener's TLS: a handshake acceptor built once from `[http]`.
#[derive(Clone)]
pub struct ListenerTls {
    /// Accepts handshakes.
    pub acceptor: TlsAcceptor,
    /// Client certificates are required.
    pub mutual: bool,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

/// The listener's TLS from `[http]`; `None` without `tls_cert_file`.
pub fn acceptor(http: &HttpConfig) -> Result<Option<ListenerTls>, ConfigError> {
    let (Some(cert), Some(key)) = (&http.tls_cert_file, &http.tls_key_file) else {
        return Ok(None);
    };
    let chain = certificates("http.tls_cert_file", cert)?;
    // The key's parse error would quote nothing of it, but say only where.
    let key = PrivateKeyDer::from_pem_file(key).map_err(|_| {
        invalid(
            "http.tls_key_file",
            format!("{} holds no readable PEM private key", key.display()),
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("http.tls_cert_file", e))?;
    let builder = match &http.tls_client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certificates("http.tls_client_ca_file", ca)? {
                roots
                    .add(c)
                    .map_err(|e| invalid("http.tls_client_ca_file", e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid("http.tls_client_ca_file", e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| invalid("http.tls_key_file", e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Some(ListenerTls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        mutual: http.tls_client_ca_file.is_some(),
    }))
}
