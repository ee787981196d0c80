//! Runs a step graph on one thread, op by op in program order (a valid order: every op depends
//! only on earlier ones). The reference the device actors are checked against, and a debugging aid.
//!
//! Its independence is in the order of things, which is what the devices get wrong when they go
//! wrong: no actors, no messages, no split into per-device programs, no sharing of buffers, no
//! early or late slices. What each op computes is deliberately the devices' own (the same kernels,
//! the same region primitives and `moves::fold`): a second copy of the arithmetic would only be
//! checked against itself.

use crate::analysis::{OpKind, StepGraph};
use crate::buffer::Buffer;
use crate::exec::{self, ExecContext, HostAccess, TaskOutcome};
use crate::moves;
use crate::region::Regions;
use legion_ops::backend::cpu::{Cpu, CpuStream};
use legion_ops::backend::{Backend, In, KernelError, Out};

/// Every instance of a step graph, by global id.
pub struct SerialMemory {
    pub buffers: Vec<Buffer>,
}

impl SerialMemory {
    pub fn new(graph: &StepGraph, regions: &Regions) -> SerialMemory {
        SerialMemory {
            buffers: graph
                .instances
                .iter()
                .map(|i| Buffer::zeros(regions.info(i.region).dtype, i.rect.volume()))
                .collect(),
        }
    }

    /// Runs every op of `graph`; returns the sum of the tasks' outcomes.
    pub fn run(
        &mut self,
        graph: &StepGraph,
        ctx: &ExecContext,
    ) -> Result<TaskOutcome, KernelError> {
        let mut total = TaskOutcome::default();
        for op in &graph.ops {
            match &op.kind {
                OpKind::Task { task, instances } => {
                    // Requirements of one task use distinct instances, except several reads of one.
                    let mut taken: Vec<Option<Buffer>> = Vec::new();
                    let mut order = Vec::new();
                    for (req, &inst) in task.requirements.iter().zip(instances) {
                        if req.privilege.writes() {
                            taken.push(Some(std::mem::replace(
                                &mut self.buffers[inst as usize],
                                Buffer::F32(Vec::new()),
                            )));
                            order.push(Some(taken.len() - 1));
                        } else {
                            order.push(None);
                        }
                    }
                    let outcome = {
                        let mut writes = taken.iter_mut().map(|b| b.as_mut().unwrap());
                        let mut w: Vec<Option<&mut Buffer>> = Vec::new();
                        for o in &order {
                            w.push(o.map(|_| writes.next().unwrap()));
                        }
                        let access = w
                            .into_iter()
                            .zip(instances)
                            .map(|(w, &inst)| match w {
                                Some(b) => HostAccess::Write(b),
                                None => HostAccess::Read(&self.buffers[inst as usize]),
                            })
                            .collect();
                        // The oracle keeps no working copies: each is made for its call.
                        exec::execute(ctx, task, access, &mut None)?
                    };
                    let mut taken = taken.into_iter();
                    for (o, &inst) in order.iter().zip(instances) {
                        if o.is_some() {
                            self.buffers[inst as usize] = taken.next().unwrap().unwrap();
                        }
                    }
                    total.loss_sum += outcome.loss_sum;
                    total.correct += outcome.correct;
                }
                OpKind::Copy { src, dst, rect, .. } => {
                    let d = *dst as usize;
                    let mut out = std::mem::replace(&mut self.buffers[d], Buffer::F32(Vec::new()));
                    let s = *src as usize;
                    let from = In {
                        rect: graph.instances[s].rect,
                        mem: &self.buffers[s],
                    };
                    let to = Out {
                        rect: graph.instances[d].rect,
                        mem: &mut out,
                    };
                    Cpu::default().copy_rect(&mut CpuStream, from, to, rect);
                    self.buffers[d] = out;
                }
                OpKind::Fold {
                    srcs,
                    dst,
                    rect,
                    accumulate,
                } => {
                    let d = *dst as usize;
                    let mut out = std::mem::replace(&mut self.buffers[d], Buffer::F32(Vec::new()));
                    let terms: Vec<In<Buffer>> = srcs
                        .iter()
                        .map(|&s| In {
                            rect: graph.instances[s as usize].rect,
                            mem: &self.buffers[s as usize],
                        })
                        .collect();
                    let to = Out {
                        rect: graph.instances[d].rect,
                        mem: &mut out,
                    };
                    moves::fold(
                        &Cpu::default(),
                        &mut CpuStream,
                        to,
                        &terms,
                        rect,
                        *accumulate,
                    );
                    self.buffers[d] = out;
                }
            }
        }
        Ok(total)
    }
}

impl SerialMemory {
    /// Fills the step's initial persistent data from parameter values by slot (momentum starts at
    /// zero, as the buffers already are).
    pub fn load(&mut self, plan: &crate::plan::StepPlan, values: &[Vec<f32>]) {
        for p in &plan.step.initial {
            let Some(slot) = plan.slot_of(p.region) else {
                continue;
            };
            let full = plan.regions.info(p.region).shape.full_rect();
            let src = Buffer::F32(values[slot].clone());
            for &i in &p.instances {
                let layout = plan.step.instances[i as usize].rect;
                self.buffers[i as usize].copy_from(&layout, &src, &full, &p.rect);
            }
        }
    }

    /// The current value of parameter `slot`.
    pub fn param(&self, plan: &crate::plan::StepPlan, slot: usize) -> Vec<f32> {
        let region = plan.regions.param(slot);
        let full = plan.regions.info(region).shape.full_rect();
        let mut out = Buffer::zeros(crate::region::DType::F32, full.volume());
        for p in plan.step.persistent.iter().filter(|p| p.region == region) {
            let i = p.instances[0] as usize;
            out.copy_from(
                &full,
                &self.buffers[i],
                &plan.step.instances[i].rect,
                &p.rect,
            );
        }
        out.into_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::StepInput;
    use crate::plan::StepPlan;
    use legion_ops::partition::ParallelConfig;
    use legion_ops::train::{ParamStore, Sgd, Trainer};
    use legion_ops::zoo;
    use legion_ops::{Dim, Graph};

    fn model(name: &str, image: usize) -> Graph {
        let z = zoo::find(name).unwrap();
        let cfg = zoo::ZooConfig {
            image_size: image,
            classes: 10,
            ..z.default_config(8)
        };
        z.build(&cfg).unwrap()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    fn check(graph: &Graph, configs: Vec<ParallelConfig>, devices: usize) {
        let plan = StepPlan::build(graph, &configs, devices).unwrap();
        let params = ParamStore::init(graph, 7);
        let sgd = Sgd::default();
        let mut trainer = Trainer::new(graph.clone(), params.clone(), sgd, 11);
        let mut mem = SerialMemory::new(&plan.step, &plan.regions);
        mem.load(&plan, &params.values);
        let input_shape = graph.layer(graph.input()).shape;
        for step in 0..3u64 {
            let images: Vec<f32> = (0..input_shape.numel())
                .map(|i| (i as f32 * 0.37 + step as f32).sin())
                .collect();
            let labels: Vec<u32> = (0..graph.batch() as u32)
                .map(|i| (i * 7 + step as u32) % 10)
                .collect();
            let stats = trainer.step(&images, &labels).unwrap();
            let input = StepInput::whole(step, images, labels, graph.batch());
            let ctx = ExecContext {
                graph,
                precision: plan.regions.precision(),
                seed: 11,
                sgd,
                input: &input,
            };
            let out = mem.run(&plan.step, &ctx).unwrap();
            let loss = (out.loss_sum / graph.batch() as f64) as f32;
            assert!(
                (loss - stats.loss).abs() < 1e-4 * stats.loss.abs().max(1.0),
                "step {step}: loss {loss} vs {}",
                stats.loss
            );
            let reference = trainer.params().unwrap();
            for (slot, p) in reference.params.iter().enumerate() {
                let err = max_rel(&mem.param(&plan, slot), &reference.values[slot]);
                assert!(err < 1e-4, "step {step}: {}: relative error {err}", p.name);
            }
        }
        let reference = trainer.params().unwrap();
        for (slot, p) in reference.params.iter().enumerate() {
            let ours = mem.param(&plan, slot);
            let err = max_rel(&ours, &reference.values[slot]);
            assert!(err < 1e-4, "{}: relative error {err}", p.name);
        }
    }

    fn split_all(graph: &Graph, dim: Dim, degree: usize) -> Vec<ParallelConfig> {
        graph
            .layers()
            .iter()
            .map(|l| {
                let dims = l.op.spec().parallel_dims(&l.shape);
                if dims.contains(&dim) && l.shape.dim(dim.axis()) >= degree {
                    ParallelConfig::split(dim, degree, 0)
                } else {
                    ParallelConfig::serial(0)
                }
            })
            .collect()
    }

    #[test]
    fn lenet_data_and_model_parallel_match_one_device() {
        let g = model("lenet5", 28);
        check(&g, split_all(&g, Dim::N, 4), 4);
        check(&g, split_all(&g, Dim::C, 4), 4);
        check(&g, split_all(&g, Dim::H, 2), 4);
    }

    /// A valid config per layer drawn at random (`devices` a power of two): a power-of-two degree
    /// per parallelizable dim within its extent and the devices left, on an aligned block.
    fn random_configs(graph: &Graph, devices: usize, seed: u64) -> Vec<ParallelConfig> {
        let mut rng = legion_ops::rng::Rng::new(seed);
        graph
            .layers()
            .iter()
            .map(|l| {
                let mut degrees = [1; legion_ops::shape::MAX_DIMS];
                let mut total = 1;
                for &dim in l.op.spec().parallel_dims(&l.shape) {
                    let most = (devices / total).min(l.shape.dim(dim.axis()));
                    // 2^k for k up to log2(most), uniformly
                    let degree = 1 << rng.below(most.ilog2() as usize + 1);
                    degrees[dim.axis()] = degree;
                    total *= degree;
                }
                let config = ParallelConfig::new(degrees, total * rng.below(devices / total));
                config
                    .validate(&l.shape, l.op.spec().parallel_dims(&l.shape), devices)
                    .expect("drawn within the space");
                config
            })
            .collect()
    }

    #[test]
    fn random_strategies_match_one_device() {
        let g = model("alexnet", 64);
        check(&g, random_configs(&g, 4, 1), 4);
    }
}
