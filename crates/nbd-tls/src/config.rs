//! Credentials from PEM files, as rustls configurations for servers and clients.
//!
//! Owns: reading certificates, private keys and certificate authorities (PEM, the files
//! `openssl`, `certtool` and the libnbd/qemu/nbdkit `ca-cert.pem`, `server-cert.pem`, ...
//! conventions use), and the choice of TLS versions (1.2 and 1.3, rustls' safe defaults; the
//! NBD spec requires 1.2) and of the crypto provider (*ring*, chosen explicitly so that no
//! process-wide default is needed).
//!
//! Invariants: a loaded [`ServerTls`] has a certificate chain and its key; when it verifies
//! clients it holds at least one CA certificate, and a client without a certificate that
//! chains to one of them fails the TLS handshake. A loaded [`ClientTls`] trusts exactly the
//! CA certificates of its file (never the system store) and checks the server's certificate
//! against the name it was given.
//!
//! Fault model: a missing, unreadable or malformed file, a file without the expected PEM
//! section, or a key that does not match its certificate is an `InvalidInput` error naming
//! the file; nothing is loaded lazily, so a bad file stops a server at start, not a client
//! at connect time.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Every certificate in a PEM file (at least one).
fn load_certs(path: &Path, what: &str) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| invalid(format!("reading the {what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!(
            "the {what} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn load_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        invalid(format!(
            "reading the TLS private key {}: {e}",
            path.display()
        ))
    })
}

/// The certificate authorities of a PEM file (at least one usable).
fn load_roots(path: &Path) -> io::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(load_certs(path, "TLS CA file")?);
    if added == 0 {
        return Err(invalid(format!(
            "the TLS CA file {} holds no usable CA certificate",
            path.display()
        )));
    }
    Ok(roots)
}

fn tls_error(context: &str, e: impl fmt::Display) -> io::Error {
    invalid(format!("{context}: {e}"))
}

/// A server's TLS credentials: its certificate and key, and the CA its clients' certificates
/// must chain to when it verifies them.
#[derive(Clone)]
pub struct ServerTls {
    pub(crate) config: Arc<rustls::ServerConfig>,
    verifies_clients: bool,
}

impl ServerTls {
    /// Loads the server certificate chain `cert` (leaf first) and its `key`; with `client_ca`,
    /// every client must present a certificate issued by one of its CAs.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> io::Result<ServerTls> {
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("TLS versions", e))?;
        let builder = match client_ca {
            Some(ca) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(load_roots(ca)?),
                    provider,
                )
                .build()
                .map_err(|e| tls_error(&format!("TLS CA file {}", ca.display()), e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(load_certs(cert, "TLS certificate")?, load_key(key)?)
            .map_err(|e| {
                tls_error(
                    &format!(
                        "TLS certificate {} with key {}",
                        cert.display(),
                        key.display()
                    ),
                    e,
                )
            })?;
        Ok(ServerTls {
            config: Arc::new(config),
            verifies_clients: client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate from the configured CA.
    pub fn verifies_clients(&self) -> bool {
        self.verifies_clients
    }
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("verifies_clients", &self.verifies_clients)
            .finish_non_exhaustive()
    }
}

/// A client's TLS settings: the CA the server's certificate must chain to, the name it must
/// carry, and optionally the client's own certificate and key.
#[derive(Clone)]
pub struct ClientTls {
    pub(crate) config: Arc<rustls::ClientConfig>,
    pub(crate) server_name: ServerName<'static>,
}

impl ClientTls {
    /// Trusts the CAs of `ca`, expects a server certificate for `server_name` (a DNS name or
    /// an IP address), and presents `identity` (certificate chain, key) when given.
    pub fn load(
        ca: &Path,
        identity: Option<(&Path, &Path)>,
        server_name: &str,
    ) -> io::Result<ClientTls> {
        let name = ServerName::try_from(server_name.to_string()).map_err(|e| {
            invalid(format!(
                "'{server_name}' is not a host name a TLS certificate can carry: {e}"
            ))
        })?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("TLS versions", e))?
            .with_root_certificates(load_roots(ca)?);
        let config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(load_certs(cert, "TLS client certificate")?, load_key(key)?)
                .map_err(|e| {
                    tls_error(
                        &format!(
                            "TLS client certificate {} with key {}",
                            cert.display(),
                            key.display()
                        ),
                        e,
                    )
                })?,
            None => builder.with_no_client_auth(),
        };
        Ok(ClientTls {
            config: Arc::new(config),
            server_name: name,
        })
    }

    /// The name the server's certificate is checked against.
    pub fn server_name(&self) -> String {
        self.server_name.to_str().into_owned()
    }
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}
