//! `serve --ublk`: each volume also served as `/dev/ublkbN` (the `ublk` crate), beside the
//! NBD sockets. The devices serve the same `Export`s as the sockets (so the same statistics
//! and metrics), are started before the sockets listen and stopped after the sockets'
//! requests are done, before the cache set is saved.

use crate::serve::{Running, ServeConfig};
use anyhow::{Context, Result};
use std::sync::Arc;

/// Starts a ublk device for every export (in name order, numbered from `ublk_first_id`);
/// nothing without `ublk`. A device that fails to start stops those already started.
pub fn start_all(cfg: &ServeConfig, running: &Arc<Running>) -> Result<Vec<ublk::Device>> {
    let mut devices = Vec::new();
    if !cfg.ublk {
        return Ok(devices);
    }
    let mut names = running.exports.names();
    names.sort();
    let first = cfg.ublk_first_id.unwrap_or(0);
    for (i, name) in names.iter().enumerate() {
        let Some(export) = running.exports.get(name) else {
            continue;
        };
        let opts = ublk::Options {
            dev_id: first + i as u32,
            queues: cfg.ublk_queues.unwrap_or(2),
            ..ublk::Options::default()
        };
        match ublk::Device::start(export, &opts)
            .with_context(|| format!("serving {name} as /dev/ublkb{}", opts.dev_id))
        {
            Ok(d) => {
                log::info!(
                    "{name} is {}{}",
                    d.path().display(),
                    if d.recovered() {
                        " (recovered: taken over from a server that died)"
                    } else {
                        ""
                    }
                );
                devices.push(d);
            }
            Err(e) => {
                stop_all(devices);
                return Err(e);
            }
        }
    }
    Ok(devices)
}

/// Stops and deletes the devices (their requests in flight are finished first).
pub fn stop_all(devices: Vec<ublk::Device>) {
    for d in devices {
        let path = d.path();
        if let Err(e) = d.stop() {
            log::error!("stopping {}: {e}", path.display());
        }
    }
}
