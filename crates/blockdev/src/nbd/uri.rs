//! NBD URIs and the client options they carry.
//!
//! Owns: `nbd+unix:///NAME?socket=PATH[&connections=N][&timeout=SECS]` and
//! `nbd://HOST[:PORT]/NAME[?connections=N][&timeout=SECS]` (port 10809 by default), and the
//! limits of each option.
//!
//! Invariants: a parsed [`NbdOptions`] is inside its limits (1–[`CONNECTIONS_MAX`]
//! connections, a timeout of 1 s – [`TIMEOUT_MAX`] from a URI); an unknown query parameter is
//! refused, never ignored, so a misspelt `timout=5` cannot silently leave the default.
//!
//! Fault model: a malformed URI is an `InvalidInput` error that says what the forms are.

use std::io;
use std::time::Duration;

/// Connections opened when the server advertises `NBD_FLAG_CAN_MULTI_CONN`.
pub const CONNECTIONS_DEFAULT: usize = 4;
/// Most connections one device opens.
pub const CONNECTIONS_MAX: usize = 16;
/// How long a request may wait for its reply (and for a connection to carry it).
pub const TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Longest timeout a URI may ask for.
pub const TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// How an [`NbdDevice`](super::NbdDevice) uses its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// Connections to open when the server advertises multi-conn (one otherwise).
    pub connections: usize,
    /// Longest a request waits, from the call to its reply, including the wait for a
    /// connection while reconnecting; also bounds each handshake step and each socket send.
    pub timeout: Duration,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            connections: CONNECTIONS_DEFAULT,
            timeout: TIMEOUT_DEFAULT,
        }
    }
}

/// Where an NBD URI points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Unix { socket: String, export: String },
    Tcp { addr: String, export: String },
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

const FORMS: &str = "nbd+unix:///NAME?socket=PATH or nbd://HOST[:PORT]/NAME, optionally with \
                     connections=N and timeout=SECS";

/// Parses `nbd+unix:///NAME?socket=PATH` or `nbd://HOST[:PORT]/NAME`; the query parameters
/// `connections` and `timeout` override `defaults`.
pub fn parse_uri(uri: &str, defaults: NbdOptions) -> io::Result<(Target, NbdOptions)> {
    let (unix, rest) = if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        (true, rest)
    } else if let Some(rest) = uri.strip_prefix("nbd://") {
        (false, rest)
    } else {
        return Err(invalid(format!("'{uri}' is not an NBD URI ({FORMS})")));
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut options = defaults;
    let mut socket = None;
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
        match key {
            "socket" if unix => socket = Some(value.to_string()),
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
                export: "x".into()
            }
        );
        assert_eq!(
            target("nbd://localhost:2000/"),
            Target::Tcp {
                addr: "localhost:2000".into(),
                export: "".into()
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
        ] {
            let e = parse_uri(bad, d).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
    }

    #[test]
    fn query_parameters_override_the_defaults() {
        let d = NbdOptions {
            connections: 2,
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
                export: "e".into()
            }
        );
        assert_eq!((o.connections, o.timeout), (16, d.timeout));
    }
}
