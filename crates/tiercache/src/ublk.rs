//! `serve --ublk`: each volume also served as `/dev/ublkbN` (the `ublk` crate), beside the
//! NBD sockets. The devices serve the same `Export`s as the sockets (so the same statistics
//! and metrics), are started before the sockets listen and stopped after the sockets'
//! requests are done, before the cache set is saved.

use anyhow::{Context, Result};

/// Starts a ublk device with `queues` queues for every export of `exports` (in name order,
/// numbered from `first_id`). A device that fails to start stops those already started.
pub fn start_all(
    exports: &server::ExportRegistry,
    queues: u16,
    first_id: u32,
) -> Result<Vec<ublk::Device>> {
    let mut devices = Vec::new();
    let mut names = exports.names();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        let Some(export) = exports.get(name) else {
            continue;
        };
        let opts = ublk::Options {
            dev_id: first_id + i as u32,
            queues,
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
