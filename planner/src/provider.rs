//! Where compute times come from: the [`CostProvider`] trait (t_c of one tile) and the analytical
//! [`RooflineCost`]. Measured times come from [`crate::profile::ProfiledCost`], which the runtime's
//! profiler feeds.

use crate::machine::{DeviceId, DeviceSpec, MachineModel};
use legion_ops::op::{Flops, ParamSpec};
use legion_ops::{Layer, Op, Rect, Shape};

/// Forward and backward seconds of one tile.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    pub forward: f64,
    pub backward: f64,
}

impl PhaseTimes {
    pub fn total(&self) -> f64 {
        self.forward + self.backward
    }
}

/// Compute seconds of a tile (its rect) of one layer on a device: see [`CostProvider::tile_pricer`].
pub type TilePricer<'a> = Box<dyn FnMut(&Rect, DeviceId) -> f64 + 'a>;

/// Time to run one tile of a layer on a device.
///
/// The answer may depend on the device only through its [`DeviceSpec`] and on the layer only through
/// its op and shapes (not its name): the cost tables price each distinct (tile, device spec) once and
/// share tables between identical layers.
pub trait CostProvider {
    /// Forward and backward seconds of the tile `tile_out` of `layer` (whose inputs have `inputs`
    /// shapes) on `device`; the simulator schedules the two phases apart.
    fn phase_times(
        &self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device: DeviceId,
    ) -> PhaseTimes;

    /// Forward + backward seconds of the tile.
    fn compute_time(
        &self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device: DeviceId,
    ) -> f64 {
        self.phase_times(layer, inputs, tile_out, device).total()
    }

    /// [`CostProvider::compute_time`] of `layer`'s tiles, one call per tile and the same numbers:
    /// the cost tables price hundreds of tiles of each layer through it, so a provider may work out
    /// once what they have in common.
    fn tile_pricer<'a>(&'a self, layer: &'a Layer, inputs: &'a [Shape]) -> TilePricer<'a> {
        Box::new(move |tile_out, device| self.compute_time(layer, inputs, tile_out, device))
    }
}

/// Analytical compute times: each phase takes the longer of its FLOPs at the device's sustained
/// compute rate and its memory traffic at the sustained memory bandwidth, plus the device's fixed
/// per-task overhead.
///
/// - FLOPs of a tile: the layer's FLOPs times the tile's share of the output volume.
/// - Bytes of a tile (at the machine's [`MachineModel::activation_bytes`] per element: 4 in
///   fp32, 2 in bf16, where the parameters are read as their bf16 working copy): forward reads the projected input rects and the parameter slices and
///   writes the tile; backward reads and writes each of them once more (gradients), i.e. twice the
///   forward traffic.
/// - The input layer costs nothing (data loading is not part of the step model).
#[derive(Clone, Debug)]
pub struct RooflineCost {
    devices: Vec<DeviceSpec>,
    /// Fraction of peak FLOP/s a dense kernel sustains (cuDNN and gemm reach 60–75%).
    pub compute_efficiency: f64,
    /// Fraction of peak memory bandwidth a streaming kernel sustains.
    pub memory_efficiency: f64,
    /// Bytes of each element a kernel streams (the machine's precision).
    element_bytes: f64,
}

impl RooflineCost {
    pub fn new(machine: &MachineModel) -> RooflineCost {
        RooflineCost {
            devices: (0..machine.num_devices())
                .map(|d| machine.device(d).clone())
                .collect(),
            compute_efficiency: 0.7,
            memory_efficiency: 0.8,
            element_bytes: machine.activation_bytes() as f64,
        }
    }

    /// Phase times of a tile on a device of `spec`.
    pub fn phase_times_on(
        &self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        spec: &DeviceSpec,
    ) -> PhaseTimes {
        LayerWork::new(layer, inputs).phase_times(self, tile_out, spec, &mut Vec::new())
    }
}

/// What the roofline of every tile of one layer reads besides the tile: FLOPs and parameters are
/// the layer's, so pricing many tiles computes them once.
struct LayerWork<'a> {
    layer: &'a Layer,
    inputs: &'a [Shape],
    flops: Flops,
    params: Vec<ParamSpec>,
}

impl<'a> LayerWork<'a> {
    fn new(layer: &'a Layer, inputs: &'a [Shape]) -> LayerWork<'a> {
        let op = layer.op.spec();
        LayerWork {
            layer,
            inputs,
            flops: op
                .flops(inputs, &layer.shape)
                .expect("the builder checked every layer's FLOP count"),
            params: op.params(inputs),
        }
    }

    /// The phase times of `tile_out` on a device of `spec`; `projected` is scratch space for the
    /// tile's input rects.
    fn phase_times(
        &self,
        cost: &RooflineCost,
        tile_out: &Rect,
        spec: &DeviceSpec,
        projected: &mut Vec<Rect>,
    ) -> PhaseTimes {
        let layer = self.layer;
        let tile_volume = tile_out.volume();
        if matches!(layer.op, Op::Input(_)) || tile_volume == 0 {
            return PhaseTimes::default();
        }
        let op = layer.op.spec();
        let share = tile_volume as f64 / layer.shape.numel() as f64;
        projected.clear();
        op.project_into(self.inputs, tile_out, projected);
        let input_elems: usize = projected.iter().map(|r| r.volume()).sum();
        let param_elems: usize = self
            .params
            .iter()
            .map(|p| op.param_rect(p, tile_out).volume())
            .sum();
        let forward_bytes = cost.element_bytes * (input_elems + tile_volume + param_elems) as f64;
        let flop_rate = spec.peak_flops_per_s() * cost.compute_efficiency;
        let byte_rate = spec.memory_bytes_per_s() * cost.memory_efficiency;
        let phase = |flops: f64, bytes: f64| {
            (flops / flop_rate).max(bytes / byte_rate) + spec.task_overhead_s()
        };
        PhaseTimes {
            forward: phase(self.flops.forward as f64 * share, forward_bytes),
            backward: phase(self.flops.backward as f64 * share, 2.0 * forward_bytes),
        }
    }
}

impl CostProvider for RooflineCost {
    fn phase_times(
        &self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device: DeviceId,
    ) -> PhaseTimes {
        self.phase_times_on(layer, inputs, tile_out, &self.devices[device])
    }

    fn tile_pricer<'a>(&'a self, layer: &'a Layer, inputs: &'a [Shape]) -> TilePricer<'a> {
        let work = LayerWork::new(layer, inputs);
        let mut projected = Vec::new();
        Box::new(move |tile_out, device| {
            work.phase_times(self, tile_out, &self.devices[device], &mut projected)
                .total()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::GraphBuilder;
    use legion_ops::op::{Conv2d, Dense};

    /// In bf16 a memory-bound tile streams half the bytes; on a P100 (no bf16 tensor cores) a
    /// compute-bound one takes as long as in fp32, on an H100 it runs on the tensor cores.
    #[test]
    fn bf16_halves_the_streamed_bytes_and_speeds_up_only_tensor_cores() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(512, 4096)).unwrap();
        let fc = m.dense("fc", x, Dense::new(4096)).unwrap();
        let r = m.relu("r", fc).unwrap();
        let g = m.finish();
        let time = |machine: &MachineModel, id| {
            let cost = RooflineCost::new(machine);
            let layer = g.layer(id);
            cost.compute_time(layer, &g.input_shapes(id), &layer.shape.full_rect(), 0)
        };
        let p100 = MachineModel::preset("paper:4").unwrap();
        let p100_bf16 = p100.clone().with_precision(legion_ops::Precision::Bf16);
        assert_eq!(time(&p100_bf16, fc), time(&p100, fc));
        let overhead = 2.0 * p100.device(0).task_overhead_s();
        let streamed = |m: &MachineModel| time(m, r) - overhead;
        assert!((streamed(&p100) / streamed(&p100_bf16) - 2.0).abs() < 1e-9);
        let h100 = MachineModel::preset("dgx-h100").unwrap();
        let h100_bf16 = h100.clone().with_precision(legion_ops::Precision::Bf16);
        assert!(time(&h100_bf16, fc) < time(&h100, fc) / 5.0);
    }

    #[test]
    fn dense_tile_is_compute_bound_and_scales_with_its_share() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(512, 4096)).unwrap();
        let fc = m.dense("fc", x, Dense::new(4096)).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:4").unwrap();
        let cost = RooflineCost::new(&machine);
        let layer = g.layer(fc);
        let inputs = g.input_shapes(fc);
        let whole = cost.compute_time(layer, &inputs, &layer.shape.full_rect(), 0);
        let flops = 3.0 * 2.0 * 512.0 * 4096.0 * 4096.0 + 3.0 * 512.0 * 4096.0;
        let expected = flops / (9.3e12 * 0.7) + 2.0 * 10e-6;
        assert!(
            (whole - expected).abs() / expected < 1e-9,
            "{whole} vs {expected}"
        );
        let quarter = Rect::new(&[0, 0], &[128, 4096]);
        let t = cost.compute_time(layer, &inputs, &quarter, 1);
        assert!(t < whole / 3.0 && t > whole / 5.0, "{t}");
        // backward does twice the forward's FLOPs; each phase pays the task overhead once
        let p = cost.phase_times(layer, &inputs, &quarter, 1);
        assert!(
            (p.backward + 10e-6 - 2.0 * p.forward).abs() < 1e-12,
            "{p:?}"
        );
    }

    #[test]
    fn a_layers_tile_pricer_prices_as_compute_time() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 17, 17)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(6, 3).padding(1)).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:4").unwrap();
        let cost = RooflineCost::new(&machine);
        for id in [x, c] {
            let (layer, inputs) = (g.layer(id), g.input_shapes(id));
            let mut price = cost.tile_pricer(layer, &inputs);
            for tile in [
                layer.shape.full_rect(),
                Rect::new(&[0, 0, 0, 0], &[4, 3, 9, 17]),
                Rect::new(&[4, 2, 8, 5], &[8, 3, 17, 9]),
                Rect::new(&[4, 2, 8, 5], &[4, 3, 17, 9]),
            ] {
                let direct = cost.compute_time(layer, &inputs, &tile, 3);
                assert_eq!(price(&tile, 3), direct, "{tile}");
            }
        }
    }

    #[test]
    fn input_layer_is_free_and_small_layers_pay_overhead() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(2, 3, 8, 8)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(4, 3).padding(1)).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:1").unwrap();
        let cost = RooflineCost::new(&machine);
        let full = |id| g.layer(id).shape.full_rect();
        assert_eq!(cost.compute_time(g.layer(x), &[], &full(x), 0), 0.0);
        let t = cost.compute_time(g.layer(c), &g.input_shapes(c), &full(c), 0);
        assert!((20e-6..21e-6).contains(&t), "{t}");
    }
}
