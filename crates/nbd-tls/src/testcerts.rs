//! Test credentials made at test time with rcgen (feature `test-certs`): a CA, a server
//! certificate, client certificates, and the decoys the refusal tests need.
//!
//! Owns: [`Pki::make`], which writes PEM files under the names libnbd (`tls-certificates=DIR`),
//! qemu (`tls-creds-x509,dir=DIR`) and nbdkit (`--tls-certificates=DIR`) look for, so one
//! directory serves every client and server in the tests.
//!
//! Invariants: the server certificate is valid for `localhost`, `127.0.0.1` and `::1`; leaf
//! certificates carry the key usages and extended key usages qemu and gnutls check
//! (digitalSignature + keyEncipherment; serverAuth or clientAuth); every directory written
//! holds the real CA as `ca-cert.pem` except `wrong-ca/`.
//!
//! Fault model: test code; an rcgen or file error is an `io::Error`.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use std::io;
use std::path::{Path, PathBuf};

fn rc(e: rcgen::Error) -> io::Error {
    io::Error::other(format!("rcgen: {e}"))
}

fn make_ca(name: &str) -> io::Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rc)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().map_err(rc)?).map_err(rc)
}

/// A leaf certificate and its key, as PEM.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    name: &str,
    sans: &[&str],
    purpose: ExtendedKeyUsagePurpose,
) -> io::Result<(String, String)> {
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(sans).map_err(rc)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![purpose];
    let key = KeyPair::generate().map_err(rc)?;
    let cert = params.signed_by(&key, issuer).map_err(rc)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn write(dir: &Path, files: &[(&str, &str)]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, pem) in files {
        std::fs::write(dir.join(name), pem)?;
    }
    Ok(())
}

/// Where [`Pki::make`] put things.
#[derive(Debug, Clone)]
pub struct Pki {
    /// `ca-cert.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`,
    /// `client-key.pem`: everything a server and a trusted client need.
    pub dir: PathBuf,
    /// `ca-cert.pem` only: a client that trusts the server but has no certificate.
    pub anonymous: PathBuf,
    /// The real `ca-cert.pem` and a client certificate and key from another CA (refused by a
    /// server that verifies clients).
    pub rogue: PathBuf,
    /// `ca-cert.pem` of another CA: a client that cannot verify the server.
    pub wrong_ca: PathBuf,
}

impl Pki {
    /// Makes the CAs and certificates and writes them under `dir`.
    pub fn make(dir: &Path) -> io::Result<Pki> {
        let ca = make_ca("tiercache test CA")?;
        let other = make_ca("some other CA")?;
        let (server_cert, server_key) = leaf(
            &ca,
            "localhost",
            &["localhost", "127.0.0.1", "::1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        let (client_cert, client_key) = leaf(
            &ca,
            "tiercache test client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let (rogue_cert, rogue_key) = leaf(
            &other,
            "tiercache rogue client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let ca_pem = ca.pem();
        let pki = Pki {
            dir: dir.to_path_buf(),
            anonymous: dir.join("anonymous"),
            rogue: dir.join("rogue"),
            wrong_ca: dir.join("wrong-ca"),
        };
        write(
            &pki.dir,
            &[
                ("ca-cert.pem", &ca_pem),
                ("server-cert.pem", &server_cert),
                ("server-key.pem", &server_key),
                ("client-cert.pem", &client_cert),
                ("client-key.pem", &client_key),
            ],
        )?;
        write(&pki.anonymous, &[("ca-cert.pem", &ca_pem)])?;
        write(
            &pki.rogue,
            &[
                ("ca-cert.pem", &ca_pem),
                ("client-cert.pem", &rogue_cert),
                ("client-key.pem", &rogue_key),
            ],
        )?;
        write(&pki.wrong_ca, &[("ca-cert.pem", &other.pem())])?;
        Ok(pki)
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca-cert.pem")
    }
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server-cert.pem")
    }
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server-key.pem")
    }
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client-cert.pem")
    }
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client-key.pem")
    }
}
