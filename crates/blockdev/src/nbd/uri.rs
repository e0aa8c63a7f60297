//! NBD URIs and the client options they carry.
//!
//! Owns: `nbd+unix:///NAME?socket=PATH[&connections=N][&spare-connections=N][&timeout=SECS]`,
//! `nbd://HOST[:PORT]/NAME[?connections=N][&spare-connections=N][&timeout=SECS]` (port 10809
//! by default) and
//! `nbds://HOST[:PORT]/NAME?...` (TLS through `NBD_OPT_STARTTLS`), and the limits of each
//! option.
//!
//! TLS parameters (`nbds://` only), named as libnbd's where libnbd has them:
//! `tls-certificates=DIR` takes `DIR/ca-cert.pem` as the CA and, if `DIR/client-cert.pem`
//! exists, `DIR/client-cert.pem` and `DIR/client-key.pem` as the client's certificate and key
//! (the layout libnbd, qemu and nbdkit use); `tls-ca=FILE`, `tls-cert=FILE` and `tls-key=FILE`
//! name the files one by one (and win over the directory); `tls-hostname=NAME` is the name
//! the server's certificate must carry (default: the URI's host).
//!
//! Invariants: a parsed [`NbdOptions`] is inside its limits (1–[`CONNECTIONS_MAX`]
//! connections, 0–[`SPARE_CONNECTIONS_MAX`] spare connections, a timeout of 1 s – [`TIMEOUT_MAX`] from a URI); an unknown query parameter is
//! refused, never ignored, so a misspelt `timout=5` cannot silently leave the default; an
//! `nbds://` target always has a CA (no system trust store is used) and a client certificate
//! always comes with its key; TLS parameters on a clear-text URI are refused.
//!
//! Fault model: a malformed URI is an `InvalidInput` error that says what the forms are.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Connections opened when the server advertises `NBD_FLAG_CAN_MULTI_CONN`.
pub const CONNECTIONS_DEFAULT: usize = 4;
/// Most connections one device opens.
pub const CONNECTIONS_MAX: usize = 16;
/// Spare connections a device may open to lend to requests carried by their caller (see
/// [`NbdDirect`](super::NbdDirect)).
pub const SPARE_CONNECTIONS_DEFAULT: usize = 8;
/// Most spare connections a URI may ask for.
pub const SPARE_CONNECTIONS_MAX: usize = 64;
/// How long a request may wait for its reply (and for a connection to carry it).
pub const TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Longest timeout a URI may ask for.
pub const TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// How an [`NbdDevice`](super::NbdDevice) uses its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// Connections to open when the server advertises multi-conn (one otherwise).
    pub connections: usize,
    /// Spare connections it may open beside them, each lent whole to one request at a time
    /// that its caller carries itself (the io_uring data path's requests around the cache);
    /// with multi-conn and without TLS only. 0: none.
    pub spare_connections: usize,
    /// Longest a request waits, from the call to its reply, including the wait for a
    /// connection while reconnecting; also bounds each handshake step and each socket send.
    pub timeout: Duration,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            connections: CONNECTIONS_DEFAULT,
            spare_connections: SPARE_CONNECTIONS_DEFAULT,
            timeout: TIMEOUT_DEFAULT,
        }
    }
}

/// TLS settings of an `nbds://` URI: files, read when the device connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    /// CA certificates the server's certificate must chain to.
    pub ca: PathBuf,
    /// The client's certificate and key, for servers that verify clients.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// The name the server's certificate must carry.
    pub hostname: String,
}

impl TlsParams {
    /// Reads the files.
    pub fn load(&self) -> io::Result<nbd_tls::ClientTls> {
        let identity = self
            .identity
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path()));
        nbd_tls::ClientTls::load(&self.ca, identity, &self.hostname)
    }
}

/// Where an NBD URI points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Unix {
        socket: String,
        export: String,
    },
    Tcp {
        addr: String,
        export: String,
        /// `nbds://`: start TLS before anything else, and insist on it.
        tls: Option<TlsParams>,
    },
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

const FORMS: &str = "nbd+unix:///NAME?socket=PATH, nbd://HOST[:PORT]/NAME or \
                     nbds://HOST[:PORT]/NAME?tls-certificates=DIR (or tls-ca=FILE, with \
                     tls-cert=FILE&tls-key=FILE for a client certificate, and tls-hostname=NAME), \
                     optionally with connections=N, spare-connections=N and timeout=SECS";

/// Whether `spec` looks like an NBD URI (of any scheme [`parse_uri`] takes).
pub fn is_nbd_uri(spec: &str) -> bool {
    ["nbd://", "nbds://", "nbd+unix://"]
        .iter()
        .any(|scheme| spec.starts_with(scheme))
}

/// The host of `HOST[:PORT]` (`[V6]` without its brackets).
fn host_name(host: &str) -> &str {
    if let Some(v6) = host.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

/// TLS query parameters as given.
#[derive(Default)]
struct TlsQuery {
    certificates: Option<PathBuf>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    hostname: Option<String>,
    /// The first TLS parameter seen, for the error on a clear-text URI.
    first: Option<String>,
}

impl TlsQuery {
    fn resolve(self, uri: &str, host: &str) -> io::Result<TlsParams> {
        let dir = self.certificates.as_deref();
        let ca = self
            .ca
            .or_else(|| dir.map(|d| d.join("ca-cert.pem")))
            .ok_or_else(|| {
                invalid(format!(
                    "{uri}: an nbds:// URI needs the CA that signed the server's certificate: \
                     tls-certificates=DIR (with DIR/ca-cert.pem) or tls-ca=FILE"
                ))
            })?;
        let identity = match (self.cert, self.key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(_), None) | (None, Some(_)) => {
                return Err(invalid(format!(
                    "{uri}: tls-cert and tls-key go together (the client certificate and its key)"
                )))
            }
            (None, None) => dir
                .filter(|d| d.join("client-cert.pem").exists())
                .map(|d| (d.join("client-cert.pem"), d.join("client-key.pem"))),
        };
        Ok(TlsParams {
            ca,
            identity,
            hostname: self.hostname.unwrap_or_else(|| host_name(host).to_string()),
        })
    }
}

/// Parses `nbd+unix:///NAME?socket=PATH`, `nbd://HOST[:PORT]/NAME` or
/// `nbds://HOST[:PORT]/NAME?...`; the query parameters `connections` and `timeout` override
/// `defaults`.
pub fn parse_uri(uri: &str, defaults: NbdOptions) -> io::Result<(Target, NbdOptions)> {
    let (unix, tls, rest) = if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        (true, false, rest)
    } else if let Some(rest) = uri.strip_prefix("nbd://") {
        (false, false, rest)
    } else if let Some(rest) = uri.strip_prefix("nbds://") {
        (false, true, rest)
    } else {
        return Err(invalid(format!("'{uri}' is not an NBD URI ({FORMS})")));
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut options = defaults;
    let mut socket = None;
    let mut tls_query = TlsQuery::default();
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
        if key.starts_with("tls-") {
            tls_query.first.get_or_insert_with(|| key.to_string());
            if value.is_empty() {
                return Err(invalid(format!("{uri}: {key} needs a value")));
            }
        }
        match key {
            "socket" if unix => socket = Some(value.to_string()),
            "tls-certificates" => tls_query.certificates = Some(value.into()),
            "tls-ca" => tls_query.ca = Some(value.into()),
            "tls-cert" => tls_query.cert = Some(value.into()),
            "tls-key" => tls_query.key = Some(value.into()),
            "tls-hostname" => tls_query.hostname = Some(value.to_string()),
            "connections" => {
                options.connections = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=CONNECTIONS_MAX).contains(n))
                    .ok_or_else(|| {
                        invalid(format!(
                            "{uri}: connections must be 1 to {CONNECTIONS_MAX}, not '{value}'"
                        ))
                    })?;
            }
            "spare-connections" => {
                options.spare_connections = value
                    .parse()
                    .ok()
                    .filter(|n| *n <= SPARE_CONNECTIONS_MAX)
                    .ok_or_else(|| {
                        invalid(format!(
                            "{uri}: spare-connections must be 0 to {SPARE_CONNECTIONS_MAX}, not \
                             '{value}'"
                        ))
                    })?;
            }
            "timeout" => {
                options.timeout = value
                    .parse()
                    .ok()
                    .map(Duration::from_secs)
                    .filter(|t| (Duration::from_secs(1)..=TIMEOUT_MAX).contains(t))
                    .ok_or_else(|| {
                        invalid(format!(
                            "{uri}: timeout must be 1 to {} seconds, not '{value}'",
                            TIMEOUT_MAX.as_secs()
                        ))
                    })?;
            }
            _ => {
                return Err(invalid(format!(
                    "{uri}: unknown parameter '{key}' ({FORMS})"
                )))
            }
        }
    }
    if let (false, Some(key)) = (tls, &tls_query.first) {
        return Err(invalid(format!(
            "{uri}: {key} applies only to TLS, with an nbds:// URI"
        )));
    }
    let target = if unix {
        let socket = socket
            .filter(|s| !s.is_empty())
            .ok_or_else(|| invalid(format!("{uri}: missing ?socket=PATH")))?;
        Target::Unix {
            socket,
            export: path.strip_prefix('/').unwrap_or(path).to_string(),
        }
    } else {
        let (host, export) = path.split_once('/').unwrap_or((path, ""));
        if host.is_empty() {
            return Err(invalid(format!("{uri}: missing host")));
        }
        let addr = if host.contains(':') {
            host.to_string()
        } else {
            format!("{host}:10809")
        };
        Target::Tcp {
            addr,
            export: export.to_string(),
            tls: if tls {
                Some(tls_query.resolve(uri, host)?)
            } else {
                None
            },
        }
    };
    Ok((target, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(uri: &str) -> Target {
        parse_uri(uri, NbdOptions::default()).unwrap().0
    }

    #[test]
    fn uris_parse_or_explain() {
        assert_eq!(
            target("nbd+unix:///disk?socket=/tmp/s.sock"),
            Target::Unix {
                socket: "/tmp/s.sock".into(),
                export: "disk".into()
            }
        );
        assert_eq!(
            target("nbd://127.0.0.1/x"),
            Target::Tcp {
                addr: "127.0.0.1:10809".into(),
                export: "x".into(),
                tls: None,
            }
        );
        assert_eq!(
            target("nbd://localhost:2000/"),
            Target::Tcp {
                addr: "localhost:2000".into(),
                export: "".into(),
                tls: None,
            }
        );
        let d = NbdOptions::default();
        for bad in [
            "nbd+unix:///x",
            "nbd+unix:///x?socket=",
            "http://x",
            "nbd:///x",
            "nbd://h/x?socket=/s",
            "nbd://h/x?timout=5",
            "nbd://h/x?timeout=0",
            "nbd://h/x?timeout=3601",
            "nbd://h/x?timeout=1.5",
            "nbd://h/x?connections=0",
            "nbd://h/x?connections=17",
            "nbd://h/x?spare-connections=65",
            "nbd://h/x?spare-connections=-1",
            // TLS parameters only with nbds://, and nbds:// needs a CA.
            "nbd://h/x?tls-ca=/ca.pem",
            "nbd+unix:///x?socket=/s&tls-certificates=/d",
            "nbds://h/x",
            "nbds://h/x?tls-hostname=h",
            "nbds://h/x?tls-ca=",
            "nbds://h/x?tls-ca=/ca.pem&tls-cert=/c.pem",
            "nbds://h/x?tls-ca=/ca.pem&tls-key=/k.pem",
            "nbds://h/x?tls-ca=/ca.pem&tls-verify=1",
        ] {
            let e = parse_uri(bad, d).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
    }

    #[test]
    fn query_parameters_override_the_defaults() {
        let d = NbdOptions {
            connections: 2,
            spare_connections: 3,
            timeout: Duration::from_millis(500),
        };
        let (t, o) = parse_uri("nbd+unix:///x?timeout=7&socket=/s&connections=1", d).unwrap();
        assert_eq!(
            t,
            Target::Unix {
                socket: "/s".into(),
                export: "x".into()
            }
        );
        assert_eq!(o.connections, 1);
        assert_eq!(o.timeout, Duration::from_secs(7));
        let (t, o) = parse_uri("nbd://h:1/e?connections=16", d).unwrap();
        assert_eq!(
            t,
            Target::Tcp {
                addr: "h:1".into(),
                export: "e".into(),
                tls: None,
            }
        );
        assert_eq!((o.connections, o.timeout), (16, d.timeout));
        assert_eq!(o.spare_connections, 3);
        let (_, o) = parse_uri("nbd://h/e?spare-connections=0", d).unwrap();
        assert_eq!(o.spare_connections, 0);
        let (_, o) = parse_uri("nbd://h/e?spare-connections=64", d).unwrap();
        assert_eq!(o.spare_connections, 64);
    }

    fn tls(uri: &str) -> TlsParams {
        match target(uri) {
            Target::Tcp { tls: Some(t), .. } => t,
            other => panic!("{uri}: {other:?}"),
        }
    }

    #[test]
    fn nbds_uris_carry_their_tls_files() {
        // libnbd's directory layout: the client certificate only if it is there.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let anonymous = tls(&format!("nbds://localhost:2000/x?tls-certificates={d}"));
        assert_eq!(anonymous.ca, dir.path().join("ca-cert.pem"));
        assert_eq!(anonymous.identity, None);
        assert_eq!(anonymous.hostname, "localhost");
        std::fs::write(dir.path().join("client-cert.pem"), "").unwrap();
        let with_cert = tls(&format!(
            "nbds://[::1]:2000/x?tls-certificates={d}&timeout=5"
        ));
        assert_eq!(
            with_cert.identity,
            Some((
                dir.path().join("client-cert.pem"),
                dir.path().join("client-key.pem")
            ))
        );
        assert_eq!(with_cert.hostname, "::1");
        // Files one by one win over the directory; the host name can be overridden.
        let files = tls(
            "nbds://10.0.0.1/x?tls-certificates=/d&tls-ca=/ca.pem&tls-cert=/c.pem\
                         &tls-key=/k.pem&tls-hostname=disk.example",
        );
        assert_eq!(files.ca, PathBuf::from("/ca.pem"));
        assert_eq!(
            files.identity,
            Some((PathBuf::from("/c.pem"), PathBuf::from("/k.pem")))
        );
        assert_eq!(files.hostname, "disk.example");
        assert_eq!(tls("nbds://h/x?tls-ca=/ca.pem").hostname, "h");
        assert!(is_nbd_uri("nbds://h/x") && is_nbd_uri("nbd://h/") && !is_nbd_uri("/dev/sdb"));
    }
}
