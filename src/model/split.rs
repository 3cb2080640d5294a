//! Which device holds which layers when a model is split across several
//! (llama.cpp's `-sm layer`): consecutive ranges of layers, one per device
//! in the order given, in proportion to each device's room for weights or
//! to shares the caller gives (`--split 3,1`). The first device also holds
//! the embedding, the last the final norm and the head; those bytes count
//! against their device's room but do not move the boundaries, so that
//! shares in layers (`--split 10,22` of 32 equal layers) put a boundary
//! exactly there.

use std::ops::Range;

use crate::error::{Error, Result};

/// The part of a model one device holds: a range of its layers, and
/// whether it begins the model (the embedding, and a vision tower) and
/// ends it (the final norm and the head).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePart {
    /// The model's layers this device holds (numbered as in the model).
    pub layers: Range<usize>,
    /// Whether it holds the embedding (and a vision tower).
    pub begins: bool,
    /// Whether it holds the final norm and the head.
    pub ends: bool,
}

impl StagePart {
    /// A model of `layers` layers on one device.
    pub fn whole(layers: usize) -> Self {
        StagePart { layers: 0..layers, begins: true, ends: true }
    }
}

/// One device's part in a split: its name (for errors) and the bytes of
/// weights it may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRoom {
    /// The adapter's name (and number), as errors show it.
    pub name: String,
    /// Bytes of weights it may hold.
    pub bytes: u64,
}

/// The bytes a split places: each layer's weights, and those only the
/// first device (the embedding) and only the last (the final norm and the
/// head) hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitBytes {
    /// Each layer's weights.
    pub layers: Vec<u64>,
    /// The embedding, on the first device.
    pub first: u64,
    /// The final norm and the head, on the last device.
    pub last: u64,
}

impl SplitBytes {
    /// The bytes of a model of `config` whose weights take `total` bytes:
    /// the embedding and the head (on the last device even where it is the
    /// embedding) as `vocab` rows each at the weights' average bytes per
    /// value, the rest shared equally by the layers.
    pub fn estimate(config: &crate::model::ModelConfig, total: u64) -> Self {
        let values = config.weight_bytes() / 2;
        let per_value = total as f64 / values.max(1) as f64;
        let matrix = (config.vocab as f64 * config.hidden as f64 * per_value) as u64;
        let tied = if config.tie_embeddings { 0 } else { matrix };
        let layers = total.saturating_sub(matrix + tied) / config.layers.max(1) as u64;
        SplitBytes { layers: vec![layers; config.layers], first: matrix, last: matrix }
    }

    /// The bytes `part` holds: its layers', and the embedding or the head
    /// where it begins or ends the model.
    pub fn of(&self, part: &StagePart) -> u64 {
        let layers: u64 = self.layers[part.layers.clone()].iter().sum();
        layers + if part.begins { self.first } else { 0 } + if part.ends { self.last } else { 0 }
    }
}

/// The layers each of `devices` holds, in order, as [`share_layers`]
/// divides them; fails with [`Error::OutOfDeviceMemory`] naming the first
/// device whose layers (and embedding or head) exceed its room, and by how
/// much.
pub fn split_layers(
    bytes: &SplitBytes,
    devices: &[DeviceRoom],
    shares: Option<&[f64]>,
) -> Result<Vec<Range<usize>>> {
    let ranges = share_layers(bytes, devices, shares)?;
    check_room(bytes, devices, &ranges)?;
    Ok(ranges)
}

/// The layers each of `devices` holds, in order, whatever their room (a
/// device whose experts stream needs less than its layers' bytes): the
/// boundaries fall where the layers' bytes before them come nearest each
/// device's share of all the layers' bytes (its room, or its entry of
/// `shares`), every device with at least one layer. Fails with
/// [`Error::InvalidSplit`] for shares that are not one positive number per
/// device, or more devices than layers.
pub fn share_layers(
    bytes: &SplitBytes,
    devices: &[DeviceRoom],
    shares: Option<&[f64]>,
) -> Result<Vec<Range<usize>>> {
    let shares = check_shares(bytes.layers.len(), devices, shares)?;
    let total: f64 = bytes.layers.iter().map(|&b| b as f64).sum();
    let whole: f64 = shares.iter().sum();
    let mut ranges = Vec::with_capacity(devices.len());
    let (mut start, mut before, mut share_before) = (0, 0f64, 0f64);
    for (i, share) in shares.iter().enumerate() {
        share_before += share;
        let rest = devices.len() - i - 1;
        // The last device takes every layer left; the others stop at the
        // boundary nearest their share, leaving a layer for each after them.
        let end = if rest == 0 {
            bytes.layers.len()
        } else {
            let target = total * share_before / whole;
            let mut end = start + 1;
            before += bytes.layers[start] as f64;
            while end < bytes.layers.len() - rest {
                let next = bytes.layers[end] as f64;
                if (before + next - target).abs() >= (before - target).abs() {
                    break;
                }
                before += next;
                end += 1;
            }
            end
        };
        ranges.push(start..end);
        start = end;
    }
    Ok(ranges)
}

/// The shares of the split: `shares` where given (one positive, finite
/// number per device), else the devices' rooms.
fn check_shares(layers: usize, devices: &[DeviceRoom], shares: Option<&[f64]>) -> Result<Vec<f64>> {
    let described = || match shares {
        Some(s) => s.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(","),
        None => format!("by memory over {} devices", devices.len()),
    };
    let invalid = |reason: String| Err(Error::InvalidSplit { split: described(), reason });
    if devices.is_empty() {
        return invalid("no devices to split across".into());
    }
    if devices.len() > layers {
        return invalid(format!("{} devices for {layers} layers: each device needs a layer", devices.len()));
    }
    let shares: Vec<f64> = match shares {
        Some(s) => s.to_vec(),
        None => devices.iter().map(|d| d.bytes as f64).collect(),
    };
    if shares.len() != devices.len() {
        return invalid(format!("{} shares for {} devices", shares.len(), devices.len()));
    }
    if let Some((i, bad)) = shares.iter().enumerate().find(|(_, s)| !(s.is_finite() && **s > 0.0)) {
        return invalid(format!("share {bad} of {} is not a positive number", devices[i].name));
    }
    Ok(shares)
}

/// Each device's layers, with the embedding on the first and the head on
/// the last, within its room.
fn check_room(bytes: &SplitBytes, devices: &[DeviceRoom], ranges: &[Range<usize>]) -> Result<()> {
    for (i, (device, range)) in devices.iter().zip(ranges).enumerate() {
        let part = StagePart { layers: range.clone(), begins: i == 0, ends: i + 1 == devices.len() };
        let held = bytes.of(&part);
        if held > device.bytes {
            return Err(Error::OutOfDeviceMemory {
                what: format!("layers {}..{} of the split on {}", range.start, range.end, device.name),
                needed_bytes: Some(held),
                message: format!(
                    "{} holds {} bytes of weights, {} fewer than its layers need",
                    device.name,
                    device.bytes,
                    held - device.bytes
                ),
            });
        }
    }
    Ok(())
}

/// The order in which `devices` devices in a row run `passes` passes
/// (prompt chunks, or parts of a step) that go through each of them in
/// turn: in wave w device d runs pass w - d, on what device d - 1 gave at
/// the end of wave w - 1, so that the devices work on different passes at
/// once and each device runs the passes in order. Each wave is a list of
/// (device, pass).
pub fn waves(passes: usize, devices: usize) -> impl Iterator<Item = Vec<(usize, usize)>> {
    (0..(passes + devices).saturating_sub(1)).map(move |wave| {
        (0..devices).filter_map(|d| wave.checked_sub(d).filter(|&m| m < passes).map(|m| (d, m))).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rooms(bytes: &[u64]) -> Vec<DeviceRoom> {
        bytes.iter().enumerate().map(|(i, &b)| DeviceRoom { name: format!("gpu{i}"), bytes: b }).collect()
    }

    fn equal(layers: usize) -> SplitBytes {
        SplitBytes { layers: vec![100; layers], first: 10, last: 20 }
    }

    #[test]
    fn waves_run_each_pass_through_the_devices_in_order() {
        let three: Vec<_> = waves(3, 2).collect();
        assert_eq!(three, vec![vec![(0, 0)], vec![(0, 1), (1, 0)], vec![(0, 2), (1, 1)], vec![(1, 2)]]);
        assert_eq!(waves(1, 3).collect::<Vec<_>>(), vec![vec![(0, 0)], vec![(1, 0)], vec![(2, 0)]]);
    }

    #[test]
    fn layers_follow_the_devices_memory() {
        let split = split_layers(&equal(32), &rooms(&[3000, 1000]), None).unwrap();
        assert_eq!(split, vec![0..24, 24..32]);
        let split = split_layers(&equal(10), &rooms(&[1000, 1000, 1000]), None).unwrap();
        assert_eq!(split, vec![0..3, 3..7, 7..10], "boundaries nearest a third and two thirds");
    }

    #[test]
    fn shares_in_layers_put_each_boundary_there() {
        for boundary in 1..8 {
            let shares = [boundary as f64, (8 - boundary) as f64];
            let split = split_layers(&equal(8), &rooms(&[10_000, 10_000]), Some(&shares)).unwrap();
            assert_eq!(split, vec![0..boundary, boundary..8]);
        }
    }

    #[test]
    fn uneven_layers_move_the_boundary_to_the_nearest() {
        // A large first layer: half the bytes are reached after it.
        let bytes = SplitBytes { layers: vec![400, 100, 100, 100, 100], first: 0, last: 0 };
        assert_eq!(split_layers(&bytes, &rooms(&[1000, 1000]), None).unwrap(), vec![0..1, 1..5]);
    }

    #[test]
    fn every_device_gets_a_layer() {
        let split = split_layers(&equal(3), &rooms(&[100_000, 1000, 1000]), None).unwrap();
        assert_eq!(split, vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn an_overflow_names_the_device_and_the_bytes_missing() {
        // Layers 4..8 and the head: 420 bytes on a device of 300.
        let err = split_layers(&equal(8), &rooms(&[1000, 300]), Some(&[1.0, 1.0])).unwrap_err();
        let text = err.to_string();
        match err {
            Error::OutOfDeviceMemory { what, needed_bytes, message } => {
                assert_eq!(what, "layers 4..8 of the split on gpu1");
                assert_eq!(needed_bytes, Some(420));
                assert!(
                    message.contains("gpu1 holds 300 bytes") && message.contains("120 fewer"),
                    "{message}"
                );
            }
            other => panic!("expected an overflow, got {other}"),
        }
        assert!(text.contains("gpu1") && text.contains("120 fewer"), "{text}");
    }

    #[test]
    fn bad_splits_are_typed_errors() {
        // Device rooms, shares, and what the error says.
        type Case<'a> = (&'a [u64], Option<&'a [f64]>, &'a str);
        let cases: [Case; 5] = [
            (&[1000, 1000], Some(&[1.0]), "1 shares for 2 devices"),
            (&[1000, 1000], Some(&[1.0, 0.0]), "share 0 of gpu1"),
            (&[1000, 1000], Some(&[f64::NAN, 1.0]), "share NaN of gpu0"),
            (&[1000; 9], None, "9 devices for 8 layers"),
            (&[], None, "no devices"),
        ];
        for (devices, shares, wanted) in cases {
            let err = split_layers(&equal(8), &rooms(devices), shares).unwrap_err();
            assert!(matches!(err, Error::InvalidSplit { .. }), "{err}");
            assert!(err.to_string().contains(wanted), "{err}");
        }
    }
}
