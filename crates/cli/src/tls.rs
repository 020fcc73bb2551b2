//! TLS for the CLI, as mosquitto's clients take it: `--tls` (or `--cafile`)
//! turns it on; the server's certificate is checked against `--cafile`, or
//! the system's roots without it; `--cert` and `--key` present a client
//! certificate. rustls with ring's cryptography, TLS 1.2 and 1.3.

use std::path::PathBuf;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

/// The TLS flags.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// CA certificates (PEM) the broker's certificate must chain to.
    pub ca: Option<PathBuf>,
    /// A client certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// Its key (PEM).
    pub key: Option<PathBuf>,
}

/// The rustls client configuration of these options.
pub fn client_config(options: &TlsOptions) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    match &options.ca {
        Some(ca) => {
            let certs = CertificateDer::pem_file_iter(ca)
                .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("--cafile {}: {e}", ca.display()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!(
                    "--cafile {}: no CA certificate in it",
                    ca.display()
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
        }
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
    match (&options.cert, &options.key) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("--cert {}: {e}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("--key {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("--cert and --key: {e}"))
        }
        _ => Err("--cert and --key go together".to_owned()),
    }
}
