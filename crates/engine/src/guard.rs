//! Containment of the unexpected: a panic inside the engine, and errors that repeat.
//!
//! Owns: [`contain`], which every public entry point that changes or reads cache state runs
//! its work through (client I/O, knob changes, attach/detach, the background loops). Errors
//! that can repeat in a loop are logged through [`Throttled`] (the `lograte` crate).
//!
//! Invariants:
//! - a panic caught by `contain` marks the set *failed* before `contain` returns, so no later
//!   request is served from state the panic may have left half-updated, and no later commit or
//!   checkpoint writes that state (both check `failed` first): the metadata on the cache
//!   device stays what the last successful commit wrote, which recovery reads on restart;
//! - an error that repeats in a loop is logged through a `Throttled` per call site, so it
//!   cannot flood the log (one write-back retry loop once wrote 436 MB in 10 minutes).
//!
//! Fault model: the panic payload is untrusted text (shown, never parsed); a panic while the
//! failed flag itself is being set cannot happen (it is a plain mutex assignment).

use crate::state::Inner;
use crate::types::{Error, Result};
pub use lograte::Throttled;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f`; a panic inside it fails the set and becomes an error for the caller.
pub(crate) fn contain<T>(inner: &Inner, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(res) => res,
        Err(payload) => {
            let why = format!(
                "internal error (panic) in {what}: {}; nothing more is written to the cache \
                 device and its journal is intact: restart to recover",
                panic_message(&*payload)
            );
            inner.fail(&Error::State(why.clone()));
            Err(Error::State(why))
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_messages() {
        let s: Box<dyn Any + Send> = Box::new("static");
        assert_eq!(panic_message(&*s), "static");
        let s: Box<dyn Any + Send> = Box::new(String::from("owned"));
        assert_eq!(panic_message(&*s), "owned");
        let s: Box<dyn Any + Send> = Box::new(7u8);
        assert_eq!(panic_message(&*s), "(no message)");
    }
}
