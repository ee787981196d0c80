//! Strategy files: a config per layer, as JSON.
//!
//! ```json
//! {
//!   "model": "vgg16",
//!   "layers": [
//!     {"layer": "conv1_1", "op": "conv2d", "degrees": {"n": 4, "c": 1, "h": 1, "w": 1}, "devices": [0, 1, 2, 3]},
//!     {"layer": "fc6", "op": "dense", "degrees": {"n": 1, "c": 2}, "devices": [0, 1]}
//!   ]
//! }
//! ```
//!
//! `degrees` maps dim names (`n`, `c`, `h`, `w`) to degrees (missing dims are 1), and `red` to the
//! partial sums of each block over the input channels of a conv2d or dense layer (missing: 1);
//! `devices` lists the device of each tile in tile order (row-major over n, c, h, w, a block's
//! partials consecutive), an aligned contiguous block ([`crate::partition`]). `model` is
//! informational.
//!
//! A strategy is the contract between the planner, which writes one, and the runtime, which runs
//! it: it lives here, beside the partition vocabulary both speak, so that a program that only runs
//! strategies (a cluster's workers) needs no planner. Validation needs only the device count.

use crate::partition::{ConfigError, DeviceId, ParallelConfig};
use crate::shape::MAX_DIMS;
use crate::{Dim, Graph};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

/// The key of the reduction degree in a layer's `degrees`.
pub const RED: &str = "red";

/// One layer's entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerStrategy {
    pub layer: String,
    pub op: String,
    pub degrees: BTreeMap<String, usize>,
    pub devices: Vec<DeviceId>,
}

/// A config for every layer of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Strategy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub layers: Vec<LayerStrategy>,
}

/// What is wrong with a strategy (file).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    #[error("{file}: line {line} column {column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("layer '{layer}': {field}: {message}")]
    Field {
        layer: String,
        field: String,
        message: String,
    },
    #[error("layer '{layer}' is not in the model")]
    UnknownLayer { layer: String },
    #[error("layer '{layer}' appears more than once")]
    DuplicateLayer { layer: String },
    #[error("layer '{layer}' of the model has no entry in the strategy")]
    MissingLayer { layer: String },
}

impl Strategy {
    /// The strategy of `configs` (by layer id). Degrees list every parallelizable dim of each op.
    pub fn from_configs(graph: &Graph, configs: &[ParallelConfig]) -> Strategy {
        let layers = graph
            .layers()
            .iter()
            .zip(configs)
            .map(|(l, c)| {
                let dims = l.op.spec().parallel_dims(&l.shape);
                let mut degrees: BTreeMap<String, usize> = dims
                    .iter()
                    .filter(|d| d.axis() < l.shape.ndim())
                    .map(|d| (d.name().to_string(), c.degree(*d)))
                    .collect();
                for d in Dim::ALL {
                    if c.degree(d) > 1 {
                        degrees.insert(d.name().to_string(), c.degree(d));
                    }
                }
                if c.reduction() > 1 {
                    degrees.insert(RED.to_string(), c.reduction());
                }
                LayerStrategy {
                    layer: l.name.clone(),
                    op: l.op.kind().to_string(),
                    degrees,
                    devices: c.devices().collect(),
                }
            })
            .collect();
        Strategy {
            model: Some(graph.name.clone()),
            layers,
        }
    }

    /// Validates the strategy against a model and a machine of `num_devices` devices; the configs
    /// by layer id.
    pub fn to_configs(
        &self,
        graph: &Graph,
        num_devices: usize,
    ) -> Result<Vec<ParallelConfig>, StrategyError> {
        let mut configs: Vec<Option<ParallelConfig>> = vec![None; graph.layers().len()];
        let mut seen: HashMap<&str, ()> = HashMap::new();
        for entry in &self.layers {
            let field = |field: &str, message: String| StrategyError::Field {
                layer: entry.layer.clone(),
                field: field.to_string(),
                message,
            };
            let id = graph
                .find(&entry.layer)
                .ok_or_else(|| StrategyError::UnknownLayer {
                    layer: entry.layer.clone(),
                })?;
            if seen.insert(&entry.layer, ()).is_some() {
                return Err(StrategyError::DuplicateLayer {
                    layer: entry.layer.clone(),
                });
            }
            let layer = graph.layer(id);
            if entry.op != layer.op.kind() {
                return Err(field(
                    "op",
                    format!(
                        "is '{}', but the model's layer is a {}",
                        entry.op,
                        layer.op.kind()
                    ),
                ));
            }
            let mut degrees = [1; MAX_DIMS];
            let mut red = 1;
            for (name, &degree) in &entry.degrees {
                let dim = match (name.as_str(), Dim::parse(name)) {
                    (_, Some(dim)) => Some(dim),
                    (RED, None) => None,
                    _ => {
                        return Err(field(
                            &format!("degrees.{name}"),
                            "unknown dim (expected n, c, h, w or red)".into(),
                        ));
                    }
                };
                // Checked against the machine as the file gave it, before it is stored in the
                // config's narrower fields: a degree past the device count never fits.
                if degree == 0 || !degree.is_power_of_two() {
                    let e = match dim {
                        Some(dim) => ConfigError::NotPowerOfTwo { dim, degree },
                        None => ConfigError::ReductionNotPowerOfTwo { red: degree },
                    };
                    return Err(field(&format!("degrees.{name}"), e.to_string()));
                }
                if degree > num_devices {
                    return Err(field(
                        &format!("degrees.{name}"),
                        format!(
                            "degree {degree} of dim {name} needs more than the machine's \
                             {num_devices} devices"
                        ),
                    ));
                }
                match dim {
                    Some(dim) => degrees[dim.axis()] = degree,
                    None => red = degree,
                }
            }
            // each degree is at most the device count (≤ MAX_DEVICES = 2^12), so the product of
            // the five fits
            let total: usize = degrees.iter().product::<usize>() * red;
            if let Some(&bad) = entry.devices.iter().find(|&&d| d >= num_devices) {
                return Err(field(
                    "devices",
                    format!(
                        "device {bad} does not exist (the machine has devices 0..{})",
                        num_devices
                    ),
                ));
            }
            let first = entry.devices.first().copied().unwrap_or(0);
            let config = ParallelConfig::new(degrees, first).with_reduction(red);
            let spec = layer.op.spec();
            let dims = spec.parallel_dims(&layer.shape);
            let channels = spec.reduction_channels(&graph.input_shapes(id));
            let checked = config
                .validate_reduction(channels)
                .and_then(|()| config.validate(&layer.shape, dims, num_devices));
            if let Err(e) = checked {
                let name = match &e {
                    ConfigError::NotPowerOfTwo { dim, .. }
                    | ConfigError::NotParallelizable { dim, .. }
                    | ConfigError::DegreeTooLarge { dim, .. } => format!("degrees.{}", dim.name()),
                    ConfigError::ReductionNotPowerOfTwo { .. }
                    | ConfigError::ReductionUnsupported { .. }
                    | ConfigError::ReductionTooLarge { .. } => format!("degrees.{RED}"),
                    ConfigError::TooManyTiles { .. } => "degrees".to_string(),
                    ConfigError::BadDeviceBlock { .. } => "devices".to_string(),
                };
                if !matches!(e, ConfigError::BadDeviceBlock { .. }) {
                    return Err(field(&name, e.to_string()));
                }
            }
            if entry.devices.len() != total {
                return Err(field(
                    "devices",
                    format!(
                        "lists {} device(s), but the degrees make {total} tile(s)",
                        entry.devices.len()
                    ),
                ));
            }
            let contiguous = entry
                .devices
                .iter()
                .enumerate()
                .all(|(t, &d)| d == first + t);
            if !contiguous {
                return Err(field(
                    "devices",
                    format!(
                        "{:?} is not a contiguous ascending block (tile t must be on device first + t)",
                        entry.devices
                    ),
                ));
            }
            config
                .validate(&layer.shape, dims, num_devices)
                .map_err(|e| field("devices", e.to_string()))?;
            configs[id.0] = Some(config);
        }
        configs
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                c.ok_or_else(|| StrategyError::MissingLayer {
                    layer: graph.layers()[i].name.clone(),
                })
            })
            .collect()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("strategies serialize")
    }

    /// Parses strategy JSON; `file` prefixes parse errors.
    pub fn from_json(text: &str, file: &str) -> Result<Strategy, StrategyError> {
        serde_json::from_str(text).map_err(|e| StrategyError::Parse {
            file: file.to_string(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })
    }

    pub fn load(path: &Path) -> Result<Strategy, StrategyError> {
        let text = std::fs::read_to_string(path).map_err(|e| StrategyError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Strategy::from_json(&text, &path.display().to_string())
    }

    pub fn save(&self, path: &Path) -> Result<(), StrategyError> {
        let text = self.to_json() + "\n";
        crate::atomic_file::write(path, text.as_bytes()).map_err(|e| StrategyError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }
}

/// `n=2,c=2` from a degree map (degrees above 1), or `1`.
pub fn describe_degrees(degrees: &BTreeMap<String, usize>) -> String {
    let mut parts: Vec<(usize, String)> = degrees
        .iter()
        .filter(|&(_, &d)| d > 1)
        .map(|(name, d)| {
            let order = Dim::parse(name).map_or(usize::MAX, |d| d.axis());
            (order, format!("{name}={d}"))
        })
        .collect();
    parts.sort();
    if parts.is_empty() {
        "1".into()
    } else {
        parts
            .into_iter()
            .map(|(_, p)| p)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `0-3` for a contiguous block, `5` for one device.
pub fn describe_devices(devices: &[DeviceId]) -> String {
    match devices {
        [] => "-".into(),
        [one] => one.to_string(),
        [first, .., last] => format!("{first}-{last}"),
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .layers
            .iter()
            .map(|l| l.layer.len())
            .max()
            .unwrap_or(5)
            .max(5);
        writeln!(
            f,
            "{:<width$}  {:<22}  {:<16}  devices",
            "layer", "op", "config"
        )?;
        for l in &self.layers {
            writeln!(
                f,
                "{:<width$}  {:<22}  {:<16}  {}",
                l.layer,
                l.op,
                describe_degrees(&l.degrees),
                describe_devices(&l.devices)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Conv2d, Dense};
    use crate::{GraphBuilder, Shape};

    fn model() -> Graph {
        let mut m = GraphBuilder::new("tiny");
        let x = m.input("data", Shape::nchw(8, 3, 16, 16)).unwrap();
        let c = m.conv2d("conv", x, Conv2d::new(8, 3).padding(1)).unwrap();
        let f = m.flatten("flat", c).unwrap();
        let d = m.dense("fc", f, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", d).unwrap();
        m.finish()
    }

    fn configs() -> Vec<ParallelConfig> {
        vec![
            ParallelConfig::split(Dim::N, 4, 0),
            ParallelConfig::new([2, 1, 2, 1], 0),
            ParallelConfig::split(Dim::N, 2, 2),
            ParallelConfig::split(Dim::C, 2, 0),
            ParallelConfig::serial(3),
        ]
    }

    #[test]
    fn round_trip_through_json_and_back_to_configs() {
        let g = model();
        let s = Strategy::from_configs(&g, &configs());
        assert_eq!(s.layers[1].devices, vec![0, 1, 2, 3]);
        assert_eq!(s.layers[1].degrees["h"], 2);
        assert_eq!(s.layers[3].degrees.len(), 2, "dense lists n and c");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.json");
        s.save(&path).unwrap();
        let back = Strategy::load(&path).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.to_configs(&g, 4).unwrap(), configs());
        let table = s.to_string();
        assert!(table.contains("conv   conv2d"), "{table}");
        assert!(table.contains("n=2,h=2"), "{table}");
        assert!(table.contains("0-3"), "{table}");
    }

    fn error(edit: impl FnOnce(&mut Strategy)) -> String {
        let g = model();
        let mut s = Strategy::from_configs(&g, &configs());
        edit(&mut s);
        s.to_configs(&g, 4).unwrap_err().to_string()
    }

    #[test]
    fn reduction_splits_round_trip_and_are_checked_against_the_op() {
        let g = model();
        let mut with_red = configs();
        with_red[1] = ParallelConfig::split(Dim::N, 2, 0).with_reduction(2);
        with_red[3] = ParallelConfig::serial(0).with_reduction(4);
        let s = Strategy::from_configs(&g, &with_red);
        assert_eq!(s.layers[1].degrees[RED], 2);
        assert_eq!(s.layers[1].devices, vec![0, 1, 2, 3]);
        assert!(s.to_string().contains("n=2,red=2"), "{s}");
        assert_eq!(
            s.to_configs(&g, 4).unwrap_or_else(|e| panic!("{e}")),
            with_red
        );
        let red = |layer: usize, red: usize, devices: Vec<usize>| {
            let mut s = s.clone();
            s.layers[layer].degrees.insert(RED.into(), red);
            s.layers[layer].devices = devices;
            s.to_configs(&g, 4).unwrap_err().to_string()
        };
        assert_eq!(
            red(1, 3, vec![0, 1, 2, 3]),
            "layer 'conv': degrees.red: reduction degree 3 is not a power of two"
        );
        assert_eq!(
            red(1, 4, vec![0, 1, 2, 3]),
            "layer 'conv': degrees.red: reduction degree 4 exceeds the 3 input channels"
        );
        assert!(
            red(2, 2, vec![0, 1, 2, 3]).starts_with(
                "layer 'flat': degrees.red: reduction degree 2: only conv2d (without groups) and \
                 dense"
            ),
            "{}",
            red(2, 2, vec![0, 1, 2, 3])
        );
        assert_eq!(
            red(3, 2, vec![0, 1, 2]),
            "layer 'fc': devices: lists 3 device(s), but the degrees make 2 tile(s)"
        );
    }

    #[test]
    fn validation_errors_name_layer_and_field() {
        assert_eq!(
            error(|s| s.layers[0].layer = "nope".into()),
            "layer 'nope' is not in the model"
        );
        assert_eq!(
            error(|s| {
                s.layers.remove(2);
            }),
            "layer 'flat' of the model has no entry in the strategy"
        );
        assert_eq!(
            error(|s| {
                let dup = s.layers[1].clone();
                s.layers.push(dup);
            }),
            "layer 'conv' appears more than once"
        );
        assert_eq!(
            error(|s| s.layers[1].op = "dense".into()),
            "layer 'conv': op: is 'dense', but the model's layer is a conv2d"
        );
        assert_eq!(
            error(|s| {
                s.layers[1].degrees.insert("h".into(), 3);
            }),
            "layer 'conv': degrees.h: degree 3 of dim h is not a power of two"
        );
        assert_eq!(
            error(|s| {
                s.layers[1].degrees.insert("x".into(), 2);
            }),
            "layer 'conv': degrees.x: unknown dim (expected n, c, h, w or red)"
        );
        assert!(
            error(|s| {
                s.layers[2].degrees.insert("c".into(), 2);
            })
            .starts_with("layer 'flat': degrees.c: dim c is not parallelizable")
        );
        assert_eq!(
            error(|s| {
                s.layers[0].degrees.insert("c".into(), 4);
            }),
            "layer 'data': degrees.c: degree 4 of dim c exceeds its extent 3"
        );
        assert_eq!(
            error(|s| {
                s.layers[1].degrees.insert("w".into(), 2);
            }),
            "layer 'conv': degrees: 8 tiles need more than the machine's 4 devices"
        );
        assert_eq!(
            error(|s| s.layers[3].devices = vec![0]),
            "layer 'fc': devices: lists 1 device(s), but the degrees make 2 tile(s)"
        );
        assert_eq!(
            error(|s| s.layers[4].devices = vec![4]),
            "layer 'loss': devices: device 4 does not exist (the machine has devices 0..4)"
        );
        assert!(
            error(|s| s.layers[3].devices = vec![1, 0])
                .starts_with("layer 'fc': devices: [1, 0] is not a contiguous ascending block")
        );
        assert!(
            error(|s| s.layers[3].devices = vec![1, 2])
                .starts_with("layer 'fc': devices: devices 1..3 are not an aligned block")
        );
    }

    #[test]
    fn parse_errors_are_located() {
        let e = Strategy::from_json("{\"layers\": [{\"layer\": 1}]}", "s.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("s.json: line 1 column"), "{e}");
        let e = Strategy::from_json("{\"layers\": [], \"extra\": 1}", "s.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `extra`"), "{e}");
    }
}
