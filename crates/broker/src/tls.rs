//! TLS listeners: rustls (through `tokio-rustls`), TLS 1.2 and 1.3 only,
//! ring's cryptography (pure Rust and assembly, nothing to install).
//!
//! A listener's `tls` table names PEM files: `certpath` (the chain, leaf
//! first), `keypath` (PKCS#8, PKCS#1 or SEC1), and optionally `capath`: then
//! every client must present a certificate signed by one of those CAs, and
//! the certificate's subject names the client: its `CN` is the username and
//! every subject field (`CN`, `O`, `OU`, `C`, `ST`, `L`, …) is a principal
//! attribute for the authorization policy, as Azure IoT Operations does with
//! X.509 attributes.
//!
//! A SIGHUP ([`crate::reload`]) may give a listener other files, or new
//! content in the same files: [`Tls::read`] loads and checks them first
//! (nothing changes if they do not load), [`Tls::install`] swaps them in.
//! Connections already open keep the session they negotiated; new ones get
//! the new certificate.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::RwLock;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

use crate::config::TlsFiles;

/// A listener's TLS configuration, swappable by a reload.
pub struct Tls {
    /// The listener's index in `Settings::listeners`.
    listener: usize,
    loaded: RwLock<Loaded>,
}

/// TLS files read and checked, ready to serve.
pub struct Loaded {
    files: TlsFiles,
    /// What the files held (certificate, key, CA), to tell a change.
    contents: Vec<Vec<u8>>,
    config: Arc<ServerConfig>,
}

impl Tls {
    /// Loads the files of listener number `listener`; the error names the
    /// file and what is wrong.
    pub fn load(listener: usize, files: &TlsFiles) -> Result<Tls, String> {
        Ok(Tls {
            listener,
            loaded: RwLock::new(Tls::read(files)?),
        })
    }

    /// Reads and checks `files` without using them yet.
    pub fn read(files: &TlsFiles) -> Result<Loaded, String> {
        let read = |what: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
        };
        let mut contents = vec![
            read("certificate", &files.cert)?,
            read("private key", &files.key)?,
        ];
        if let Some(ca) = &files.ca {
            contents.push(read("CA file", ca)?);
        }
        let config = server_config(files, &contents)?;
        Ok(Loaded {
            files: files.clone(),
            contents,
            config: Arc::new(config),
        })
    }

    /// The listener's index in `Settings::listeners`.
    pub fn listener(&self) -> usize {
        self.listener
    }

    /// The files in use.
    pub fn files(&self) -> TlsFiles {
        self.loaded.read().files.clone()
    }

    /// Whether `loaded` differs from what is in use (other files, or other
    /// content in the same files).
    pub fn differs(&self, loaded: &Loaded) -> bool {
        let current = self.loaded.read();
        current.files != loaded.files || current.contents != loaded.contents
    }

    /// Serves `loaded` to new connections from now on.
    pub fn install(&self, loaded: Loaded) {
        *self.loaded.write() = loaded;
    }

    /// An acceptor with the current configuration.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.loaded.read().config))
    }
}

fn server_config(files: &TlsFiles, contents: &[Vec<u8>]) -> Result<ServerConfig, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&contents[0])
        .collect::<Result<_, _>>()
        .map_err(|e| format!("certificate {}: {e}", files.cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "certificate {}: no CERTIFICATE in the file",
            files.cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&contents[1])
        .map_err(|e| format!("private key {}: {e}", files.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| e.to_string())?;
    let builder = match (&files.ca, contents.get(2)) {
        (Some(ca), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            let cas = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("CA file {}: {e}", ca.display()))?;
            let (added, _) = roots.add_parsable_certificates(cas);
            if added == 0 {
                return Err(format!(
                    "CA file {}: no usable CA certificate",
                    ca.display()
                ));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("CA file {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "certificate {} and key {} do not go together: {e}",
            files.cert.display(),
            files.key.display()
        )
    })
}

/// Who a client certificate names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertIdentity {
    /// The subject's common name: the client's username.
    pub common_name: Option<String>,
    /// Every subject field by its short name (`CN`, `O`, `OU`, …).
    pub attributes: BTreeMap<String, String>,
}

/// The identity in the client's (verified) certificate, if it sent one.
pub fn peer_identity(connection: &rustls::ServerConnection) -> Option<CertIdentity> {
    let leaf = connection.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    let mut identity = CertIdentity::default();
    let registry = x509_parser::objects::oid_registry();
    for attribute in cert.subject().iter_attributes() {
        let Ok(value) = attribute.as_str() else {
            continue;
        };
        let oid = attribute.attr_type();
        let name = x509_parser::objects::oid2abbrev(oid, registry)
            .or_else(|_| x509_parser::objects::oid2sn(oid, registry))
            .map_or_else(|_| oid.to_id_string(), str::to_owned);
        if name == "CN" && identity.common_name.is_none() {
            identity.common_name = Some(value.to_owned());
        }
        identity
            .attributes
            .entry(name)
            .or_insert_with(|| value.to_owned());
    }
    Some(identity)
}
