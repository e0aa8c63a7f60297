//! Who may use the NBD socket: parsing `--socket-mode`, `--socket-owner` and `--socket-group`
//! into the server's `UnixSocketPerms`.
//!
//! Invariants: a mode is octal and never grants access to others than owner and group unless
//! asked for explicitly with the `o` bits (a warning is logged then, since any local user could
//! then read and write the disks); owners and groups are numeric ids or names resolved through
//! the system's user database (`getpwnam_r`/`getgrnam_r`, so NSS sources such as LDAP work).
//!
//! Fault model: unknown names and malformed modes are one-line errors at start, before any
//! socket exists.

use anyhow::{bail, Context, Result};
use std::ffi::CString;

/// Parses an octal permission mode such as `660` or `0600`.
pub fn parse_mode(s: &str) -> Result<u32> {
    let mode = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .with_context(|| format!("socket mode '{s}' is not an octal mode like 0660"))?;
    if mode > 0o777 {
        bail!("socket mode '{s}' has bits beyond 0777");
    }
    if mode & 0o600 != 0o600 {
        bail!("socket mode '{s}' must let the owner read and write (0600 or more)");
    }
    if mode & 0o007 != 0 {
        log::warn!("socket mode {mode:#o} lets every local user read and write the exported disks");
    }
    Ok(mode)
}

/// A user id from a number or a user name.
pub fn parse_user(s: &str) -> Result<u32> {
    lookup(s, "user", |name, buf| {
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids).
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: `name` is NUL-terminated, `buf` is a
        // writable buffer of the length passed, `pw` and `out` are live locals.
        let rc = unsafe {
            libc::getpwnam_r(
                name.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut out,
            )
        };
        (rc, (!out.is_null()).then_some(pw.pw_uid))
    })
}

/// A group id from a number or a group name.
pub fn parse_group(s: &str) -> Result<u32> {
    lookup(s, "group", |name, buf| {
        // SAFETY: all-zero is a valid `group` (null pointers, zero ids).
        let mut gr: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: as in `parse_user`.
        let rc = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut gr,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut out,
            )
        };
        (rc, (!out.is_null()).then_some(gr.gr_gid))
    })
}

/// Largest buffer tried for one user database entry.
const ENTRY_BUFFER_BYTES_MAX: usize = 1 << 20;

/// Resolves `s` (a number, or a name through `get`), growing the buffer on ERANGE.
fn lookup(
    s: &str,
    what: &str,
    get: impl Fn(&CString, &mut Vec<u8>) -> (libc::c_int, Option<u32>),
) -> Result<u32> {
    if let Ok(id) = s.parse::<u32>() {
        // (uid_t)-1 is no id: chown(2) reads it as "leave unchanged".
        if id == u32::MAX {
            bail!("{what} id {id} is not a valid id (it means \"no change\" to the system)");
        }
        return Ok(id);
    }
    let name = CString::new(s).with_context(|| format!("{what} name {s:?} contains a NUL"))?;
    let mut buf = vec![0u8; 4096];
    loop {
        match get(&name, &mut buf) {
            (0, Some(id)) => return Ok(id),
            (0, None) => bail!("no such {what}: '{s}'"),
            (libc::ERANGE, _) if buf.len() < ENTRY_BUFFER_BYTES_MAX => buf.resize(buf.len() * 2, 0),
            (rc, _) => bail!(
                "looking up {what} '{s}': {}",
                std::io::Error::from_raw_os_error(rc)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("660").unwrap(), 0o660);
        assert_eq!(parse_mode("0600").unwrap(), 0o600);
        assert_eq!(parse_mode("0o640").unwrap(), 0o640);
        for bad in ["", "rw", "888", "1777", "0440", "0060"] {
            assert!(parse_mode(bad).is_err(), "{bad} accepted");
        }
        for bad in ["4294967295", "-1", "4294967296"] {
            assert!(parse_user(bad).is_err(), "user {bad} accepted");
            assert!(parse_group(bad).is_err(), "group {bad} accepted");
        }
        assert_eq!(parse_user("4294967294").unwrap(), 4294967294);
    }

    #[test]
    fn users_and_groups() {
        assert_eq!(parse_user("0").unwrap(), 0);
        assert_eq!(parse_user("root").unwrap(), 0);
        assert_eq!(parse_group("root").unwrap(), 0);
        assert_eq!(parse_group("1234").unwrap(), 1234);
        assert!(parse_user("no-such-user-tiercache").is_err());
        assert!(parse_group("no-such-group-tiercache").is_err());
        assert!(parse_user("a\0b").is_err());
    }
}
