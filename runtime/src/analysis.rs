//! Dependence analysis: from tasks launched in program order to a graph of operations (tasks,
//! copies, folds) with their dependences. Pure: no threads, no I/O.
//!
//! # Model
//!
//! Data lives in *physical instances*: a buffer of one region on one device laid out over exactly
//! one rect. A read, write-discard or read-write requirement uses the *normal* instance keyed by
//! (region, device, rect), created on first use, so a kernel always gets a contiguous buffer of
//! exactly its rect. A reduce requirement gets a fresh *reduction* instance that the kernel
//! overwrites with its term; folds sum terms later. *Staging* instances receive remote terms.
//!
//! Each region is cut into *fragments* (disjoint rects) with a state:
//! - `Empty`: not written in this step. Reading it is an error, except for zero-initialised
//!   regions (sums of contributions), where it reads zeros.
//! - `Valid`: these instances hold the current value, each ready once its op has run.
//! - `Reduced`: a base value (none means zero) plus terms in reduction instances.
//!
//! A read brings every fragment of its rect into the reader's instance: nothing if it already
//! holds it, a copy from a holder (one on the same device if any, else the first, which is the
//! writer), or for a `Reduced` fragment a *fold*: remote terms are copied into staging instances on
//! the reader's device, then summed there in ascending device order (program order within a
//! device) on top of the base. Writes make their instance the only holder. Reductions only add
//! terms, so they never wait for each other.
//!
//! Hazards are tracked per instance and rect: a write into an instance waits for earlier reads and
//! writes of overlapping rects of that instance (write-after-read, write-after-write); a read waits
//! for the op that made its data valid (read-after-write).
//!
//! # Locality
//!
//! Every dependence is on an op executed by the same device, with copies split in two halves: a
//! copy's source side (its data being ready) is on the source device, its destination side (the
//! destination instance being free) on the destination device. So devices exchange only data,
//! never events; `program` relies on this.

use crate::region::{RegionId, Regions};
use crate::task::{Privilege, TaskSpec};
use legion_ops::Rect;
use legion_ops::partition::DeviceId;
use std::collections::HashMap;
use thiserror::Error;

pub type OpId = u32;
pub type InstanceId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InstanceKind {
    Normal,
    Reduction,
    Staging,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Instance {
    pub region: RegionId,
    pub device: DeviceId,
    pub rect: Rect,
    pub kind: InstanceKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    /// A task; `instances[i]` serves requirement `i`.
    Task {
        task: TaskSpec,
        instances: Vec<InstanceId>,
    },
    /// Copies `rect` from `src` into `dst`. `dst_deps` must finish on the destination device
    /// before `dst` may be overwritten; the op's `deps` are on the source device.
    Copy {
        src: InstanceId,
        dst: InstanceId,
        rect: Rect,
        dst_deps: Vec<OpId>,
    },
    /// `dst[rect] = (accumulate ? dst[rect] : 0) + Σ srcs[rect]`, summed in the order given. All
    /// instances are on one device.
    Fold {
        srcs: Vec<InstanceId>,
        dst: InstanceId,
        rect: Rect,
        accumulate: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub kind: OpKind,
    /// Ops that must finish first (for a copy: on its source device).
    pub deps: Vec<OpId>,
}

#[derive(Clone, Debug, Error, PartialEq)]
pub enum AnalysisError {
    #[error("{task} reads {region} {rect}, which nothing wrote before it")]
    ReadBeforeWrite {
        task: String,
        region: String,
        rect: String,
    },
    #[error("{task}: rect {rect} lies outside region {region} of shape {shape:?}")]
    OutOfBounds {
        task: String,
        region: String,
        rect: String,
        shape: Vec<usize>,
    },
}

/// An instance holding valid data, and the op after which it does (`None`: before the step).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Holder {
    instance: InstanceId,
    ready: Option<OpId>,
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    Empty,
    Valid(Vec<Holder>),
    Reduced {
        base: Vec<Holder>,
        terms: Vec<Holder>,
    },
}

#[derive(Clone, Debug)]
struct Fragment {
    rect: Rect,
    state: State,
}

/// Earlier accesses of one instance, for hazards.
#[derive(Clone, Debug, Default)]
struct Uses {
    writes: Vec<(Rect, OpId)>,
    reads: Vec<(Rect, OpId)>,
}

/// Data valid at a point of the step: `region[rect]` held by `instances`.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub region: RegionId,
    pub rect: Rect,
    pub instances: Vec<InstanceId>,
}

/// The analysed step.
#[derive(Clone, Debug)]
pub struct StepGraph {
    pub instances: Vec<Instance>,
    pub ops: Vec<Op>,
    /// How many of `ops`, from the first, are the training step's: those after them are
    /// inference's (`crate::plan::InferencePlan`), run on their own.
    pub step_ops: usize,
    /// Data the step expects before it starts (see [`Analysis::place`]).
    pub initial: Vec<Placement>,
    /// Where the persistent regions' data is valid after the step.
    pub persistent: Vec<Placement>,
}

impl StepGraph {
    /// The device that executes op `op` (for a copy, its destination).
    pub fn device(&self, op: OpId) -> DeviceId {
        match &self.ops[op as usize].kind {
            OpKind::Task { task, .. } => task.device,
            OpKind::Copy { dst, .. } | OpKind::Fold { dst, .. } => {
                self.instances[*dst as usize].device
            }
        }
    }

    /// Copies between different devices in a training step.
    pub fn remote_copies(&self) -> impl Iterator<Item = (OpId, &Instance, &Instance, Rect)> + '_ {
        self.ops[..self.step_ops]
            .iter()
            .enumerate()
            .filter_map(|(i, op)| match op.kind {
                OpKind::Copy { src, dst, rect, .. } => {
                    let (s, d) = (&self.instances[src as usize], &self.instances[dst as usize]);
                    (s.device != d.device).then_some((i as OpId, s, d, rect))
                }
                _ => None,
            })
    }

    /// Bytes that cross between devices per step.
    pub fn remote_bytes(&self, regions: &Regions) -> u64 {
        self.remote_copies()
            .map(|(_, s, _, rect)| (rect.volume() * regions.info(s.region).dtype.size()) as u64)
            .sum()
    }
}

/// Where a fragment of a prefetch comes from: a relay device and the rect of its instance, or
/// `None` for the usual holder ([`Analysis::prefetch_via`]).
pub type Via<'a> = &'a dyn Fn(&Rect) -> Option<(DeviceId, Rect)>;

/// The analysis state while a step's tasks are launched.
pub struct Analysis<'r> {
    regions: &'r Regions,
    instances: Vec<Instance>,
    normal: HashMap<(RegionId, DeviceId, Rect), InstanceId>,
    uses: Vec<Uses>,
    fragments: Vec<Vec<Fragment>>,
    ops: Vec<Op>,
    initial: Vec<Placement>,
}

impl<'r> Analysis<'r> {
    pub fn new(regions: &'r Regions) -> Analysis<'r> {
        let fragments = regions
            .ids()
            .map(|r| {
                vec![Fragment {
                    rect: regions.info(r).shape.full_rect(),
                    state: State::Empty,
                }]
            })
            .collect();
        Analysis {
            regions,
            instances: Vec::new(),
            normal: HashMap::new(),
            uses: Vec::new(),
            fragments,
            ops: Vec::new(),
            initial: Vec::new(),
        }
    }

    /// Declares that, when the step starts, `region[rect]` is valid in the normal instance of
    /// `rect` on each of `devices` (persistent data left there by the previous step, or loaded).
    pub fn place(&mut self, region: RegionId, rect: Rect, devices: &[DeviceId]) {
        let keys: Vec<(DeviceId, Rect)> = devices.iter().map(|&d| (d, rect)).collect();
        self.place_in(region, rect, &keys);
    }

    /// Like [`place`](Self::place), with the holders given as (device, instance rect): each
    /// instance's rect contains `rect`.
    pub fn place_in(&mut self, region: RegionId, rect: Rect, holders: &[(DeviceId, Rect)]) {
        let holders: Vec<Holder> = holders
            .iter()
            .map(|&(d, inst_rect)| {
                debug_assert!(inst_rect.contains(&rect));
                Holder {
                    instance: self.normal_instance(region, d, inst_rect),
                    ready: None,
                }
            })
            .collect();
        self.initial.push(Placement {
            region,
            rect,
            instances: holders.iter().map(|h| h.instance).collect(),
        });
        for f in self.split(region, &rect) {
            self.fragments[region.index()][f].state = State::Valid(holders.clone());
        }
    }

    /// Launches a task; returns its op.
    pub fn launch(&mut self, task: TaskSpec) -> Result<OpId, AnalysisError> {
        for req in &task.requirements {
            let shape = self.regions.info(req.region).shape;
            if req.rect.ndim() != shape.ndim() || !shape.full_rect().contains(&req.rect) {
                return Err(AnalysisError::OutOfBounds {
                    task: task.to_string(),
                    region: self.regions.info(req.region).name.clone(),
                    rect: req.rect.to_string(),
                    shape: shape.dims().to_vec(),
                });
            }
        }
        let instances: Vec<InstanceId> = task
            .requirements
            .iter()
            .map(|req| match req.privilege {
                Privilege::Reduce => {
                    self.new_instance(req.region, task.device, req.rect, InstanceKind::Reduction)
                }
                _ => self.normal_instance(req.region, task.device, req.rect),
            })
            .collect();
        let mut deps = Vec::new();
        for (req, &inst) in task.requirements.iter().zip(&instances) {
            if req.privilege.reads() {
                self.read_into(req.region, req.rect, inst, None, &mut deps)
                    .map_err(|region| AnalysisError::ReadBeforeWrite {
                        task: task.to_string(),
                        region,
                        rect: req.rect.to_string(),
                    })?;
            }
        }
        for (req, &inst) in task.requirements.iter().zip(&instances) {
            if req.privilege.writes() {
                self.write_hazards(inst, &req.rect, &mut deps);
            }
        }
        let op = self.push(
            OpKind::Task {
                task: task.clone(),
                instances: instances.clone(),
            },
            deps,
        );
        for (req, &inst) in task.requirements.iter().zip(&instances) {
            match req.privilege {
                Privilege::ReadOnly => self.uses[inst as usize].reads.push((req.rect, op)),
                Privilege::WriteDiscard | Privilege::ReadWrite => {
                    self.record_write(inst, req.rect, op);
                    for f in self.split(req.region, &req.rect) {
                        self.fragments[req.region.index()][f].state = State::Valid(vec![Holder {
                            instance: inst,
                            ready: Some(op),
                        }]);
                    }
                }
                Privilege::Reduce => {
                    self.record_write(inst, req.rect, op);
                    let term = Holder {
                        instance: inst,
                        ready: Some(op),
                    };
                    for f in self.split(req.region, &req.rect) {
                        let frag = &mut self.fragments[req.region.index()][f];
                        frag.state = match std::mem::replace(&mut frag.state, State::Empty) {
                            State::Empty => State::Reduced {
                                base: Vec::new(),
                                terms: vec![term],
                            },
                            State::Valid(base) => State::Reduced {
                                base,
                                terms: vec![term],
                            },
                            State::Reduced { base, mut terms } => {
                                terms.push(term);
                                State::Reduced { base, terms }
                            }
                        };
                    }
                }
            }
        }
        Ok(op)
    }

    /// Makes `region[rect]` valid in the normal instance of `rect` on `device` ahead of the tasks
    /// that will read it there (e.g. broadcasting updated parameters to their replicas).
    pub fn prefetch(
        &mut self,
        region: RegionId,
        rect: Rect,
        device: DeviceId,
    ) -> Result<(), AnalysisError> {
        self.prefetch_via(region, rect, device, &|_| None)
    }

    /// [`prefetch`](Self::prefetch), a fragment that `via` maps to `(relay, its rect)` coming
    /// through the relay's normal instance of that rect (filled first if it does not hold it).
    pub fn prefetch_via(
        &mut self,
        region: RegionId,
        rect: Rect,
        device: DeviceId,
        via: Via<'_>,
    ) -> Result<(), AnalysisError> {
        let inst = self.normal_instance(region, device, rect);
        let mut deps = Vec::new();
        self.read_into(region, rect, inst, Some(via), &mut deps)
            .map_err(|name| AnalysisError::ReadBeforeWrite {
                task: format!("prefetch to device {device}"),
                region: name,
                rect: rect.to_string(),
            })
    }

    /// Sums, on `at`, the terms of the sum `region[rect]` that `devices` and `at` hold, so that
    /// a later read finds one term on `at` in their place: each term from another device is
    /// copied into a staging instance on `at` and folded, in ascending device order, onto `at`'s
    /// own term (or into a new reduction instance where `at` holds none).
    pub fn combine_terms(
        &mut self,
        region: RegionId,
        rect: Rect,
        devices: &[DeviceId],
        at: DeviceId,
    ) {
        for f in self.split(region, &rect) {
            let frag = self.fragments[region.index()][f].clone();
            let State::Reduced { base, terms } = frag.state else {
                continue;
            };
            let device_of = |h: &Holder| self.instances[h.instance as usize].device;
            let (mut combined, kept): (Vec<Holder>, Vec<Holder>) = terms
                .into_iter()
                .partition(|h| device_of(h) == at || devices.contains(&device_of(h)));
            if combined.len() < 2 {
                continue;
            }
            combined.sort_by_key(|h| self.instances[h.instance as usize].device);
            let own = combined
                .iter()
                .position(|h| self.instances[h.instance as usize].device == at);
            let (dst, base_ready) = match own {
                Some(i) => {
                    let h = combined.remove(i);
                    (h.instance, Some(h.ready))
                }
                None => (
                    self.new_instance(region, at, frag.rect, InstanceKind::Reduction),
                    None,
                ),
            };
            let srcs = combined
                .into_iter()
                .map(|t| {
                    let staging = self.new_instance(region, at, frag.rect, InstanceKind::Staging);
                    let op = self.copy(t, staging, frag.rect);
                    Holder {
                        instance: staging,
                        ready: Some(op),
                    }
                })
                .collect();
            let ready = self.fold(srcs, dst, frag.rect, base_ready);
            let mut terms = kept;
            terms.push(Holder {
                instance: dst,
                ready: Some(ready),
            });
            self.fragments[region.index()][f].state = State::Reduced { base, terms };
        }
    }

    pub fn finish(self) -> StepGraph {
        let persistent = self.persistent_now();
        StepGraph {
            instances: self.instances,
            step_ops: self.ops.len(),
            ops: self.ops,
            initial: self.initial,
            persistent,
        }
    }

    /// Where the persistent regions' data is valid after the tasks launched so far.
    pub fn persistent_now(&self) -> Vec<Placement> {
        self.regions
            .ids()
            .filter(|&r| self.regions.info(r).kind.persistent())
            .flat_map(|r| self.valid(r))
            .collect()
    }

    /// Where `region`'s data is valid after the tasks launched so far, fragment by fragment.
    pub fn valid(&self, region: RegionId) -> Vec<Placement> {
        self.fragments[region.index()]
            .iter()
            .filter_map(|f| match &f.state {
                State::Valid(holders) => Some(Placement {
                    region,
                    rect: f.rect,
                    instances: holders.iter().map(|h| h.instance).collect(),
                }),
                _ => None,
            })
            .collect()
    }

    /// Starts a new run after the tasks launched so far: only the persistent regions' data
    /// carries over (it stays where it is); every other region is unwritten again, as at a
    /// step's start, so that a reduction into it starts from nothing rather than accumulating
    /// onto the last run's value.
    pub fn forget_transient(&mut self) {
        for region in self.regions.ids() {
            if self.regions.info(region).kind.persistent() {
                continue;
            }
            self.fragments[region.index()] = vec![Fragment {
                rect: self.regions.info(region).shape.full_rect(),
                state: State::Empty,
            }];
        }
    }

    /// Ops launched so far.
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }

    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    fn normal_instance(&mut self, region: RegionId, device: DeviceId, rect: Rect) -> InstanceId {
        if let Some(&id) = self.normal.get(&(region, device, rect)) {
            return id;
        }
        let id = self.new_instance(region, device, rect, InstanceKind::Normal);
        self.normal.insert((region, device, rect), id);
        id
    }

    fn new_instance(
        &mut self,
        region: RegionId,
        device: DeviceId,
        rect: Rect,
        kind: InstanceKind,
    ) -> InstanceId {
        self.instances.push(Instance {
            region,
            device,
            rect,
            kind,
        });
        self.uses.push(Uses::default());
        (self.instances.len() - 1) as InstanceId
    }

    fn push(&mut self, kind: OpKind, mut deps: Vec<OpId>) -> OpId {
        deps.sort_unstable();
        deps.dedup();
        self.ops.push(Op { kind, deps });
        (self.ops.len() - 1) as OpId
    }

    /// Brings `region[rect]` into instance `inst`, adding what the reader must wait for to
    /// `deps`. Errs with the region's name if part of it was never written.
    /// A fragment `via` maps to `(relay, its rect)` comes through the relay's normal instance of
    /// that rect (see [`Analysis::prefetch_via`]).
    fn read_into(
        &mut self,
        region: RegionId,
        rect: Rect,
        inst: InstanceId,
        via: Option<Via<'_>>,
        deps: &mut Vec<OpId>,
    ) -> Result<(), String> {
        let device = self.instances[inst as usize].device;
        let kind = self.regions.info(region).kind;
        for f in self.split(region, &rect) {
            let frag = self.fragments[region.index()][f].clone();
            let ready = match frag.state {
                State::Empty if kind.zero_initialized() => {
                    self.fold(Vec::new(), inst, frag.rect, None)
                }
                State::Empty => return Err(self.regions.info(region).name.clone()),
                State::Valid(holders) => match holders.iter().find(|h| h.instance == inst) {
                    Some(h) => {
                        deps.extend(h.ready);
                        continue;
                    }
                    None => {
                        let mut holders = holders;
                        let mut src = holder_on(&self.instances, &holders, device);
                        if let Some((relay, relay_rect)) = via.and_then(|via| via(&frag.rect))
                            && relay != device
                        {
                            let at_relay = self.normal_instance(region, relay, relay_rect);
                            src = match holders.iter().find(|h| h.instance == at_relay) {
                                Some(&h) => h,
                                None => {
                                    let from = holder_on(&self.instances, &holders, relay);
                                    let op = self.copy(from, at_relay, frag.rect);
                                    let h = Holder {
                                        instance: at_relay,
                                        ready: Some(op),
                                    };
                                    holders.push(h);
                                    h
                                }
                            };
                        }
                        let op = self.copy(src, inst, frag.rect);
                        holders.push(Holder {
                            instance: inst,
                            ready: Some(op),
                        });
                        self.fragments[region.index()][f].state = State::Valid(holders);
                        deps.push(op);
                        continue;
                    }
                },
                State::Reduced { base, terms } => {
                    let base = match base.iter().find(|h| h.instance == inst) {
                        Some(h) => Some(h.ready),
                        None => {
                            let local = base
                                .iter()
                                .find(|h| self.instances[h.instance as usize].device == device);
                            local
                                .or(base.first())
                                .map(|&h| Some(self.copy(h, inst, frag.rect)))
                        }
                    };
                    let mut terms = terms;
                    // Stable: program order within a device.
                    terms.sort_by_key(|h| self.instances[h.instance as usize].device);
                    let srcs = terms
                        .into_iter()
                        .map(|t| {
                            if self.instances[t.instance as usize].device == device {
                                t
                            } else {
                                let staging = self.new_instance(
                                    region,
                                    device,
                                    frag.rect,
                                    InstanceKind::Staging,
                                );
                                let op = self.copy(t, staging, frag.rect);
                                Holder {
                                    instance: staging,
                                    ready: Some(op),
                                }
                            }
                        })
                        .collect();
                    self.fold(srcs, inst, frag.rect, base)
                }
            };
            self.fragments[region.index()][f].state = State::Valid(vec![Holder {
                instance: inst,
                ready: Some(ready),
            }]);
            deps.push(ready);
        }
        Ok(())
    }

    /// A copy of `src`'s data in `rect` into `dst`.
    fn copy(&mut self, src: Holder, dst: InstanceId, rect: Rect) -> OpId {
        let mut dst_deps = Vec::new();
        self.write_hazards(dst, &rect, &mut dst_deps);
        dst_deps.sort_unstable();
        dst_deps.dedup();
        let op = self.push(
            OpKind::Copy {
                src: src.instance,
                dst,
                rect,
                dst_deps,
            },
            src.ready.into_iter().collect(),
        );
        self.uses[src.instance as usize].reads.push((rect, op));
        self.record_write(dst, rect, op);
        op
    }

    /// Sums `terms` into `dst[rect]`, on top of the value `dst` holds when `base` is `Some` (after
    /// the op it names, if any).
    fn fold(
        &mut self,
        terms: Vec<Holder>,
        dst: InstanceId,
        rect: Rect,
        base: Option<Option<OpId>>,
    ) -> OpId {
        let mut deps: Vec<OpId> = terms.iter().filter_map(|t| t.ready).collect();
        deps.extend(base.flatten());
        self.write_hazards(dst, &rect, &mut deps);
        let srcs: Vec<InstanceId> = terms.iter().map(|t| t.instance).collect();
        let op = self.push(
            OpKind::Fold {
                srcs: srcs.clone(),
                dst,
                rect,
                accumulate: base.is_some(),
            },
            deps,
        );
        for s in srcs {
            self.uses[s as usize].reads.push((rect, op));
        }
        self.record_write(dst, rect, op);
        op
    }

    fn write_hazards(&self, inst: InstanceId, rect: &Rect, deps: &mut Vec<OpId>) {
        let uses = &self.uses[inst as usize];
        for (r, op) in uses.writes.iter().chain(&uses.reads) {
            if r.overlaps(rect) {
                deps.push(*op);
            }
        }
    }

    /// Records a write; accesses it covers are dropped, as anything later that conflicts with them
    /// conflicts with this write, which already waits for them.
    fn record_write(&mut self, inst: InstanceId, rect: Rect, op: OpId) {
        let uses = &mut self.uses[inst as usize];
        uses.writes.retain(|(r, _)| !rect.contains(r));
        uses.reads.retain(|(r, _)| !rect.contains(r));
        uses.writes.push((rect, op));
    }

    /// Cuts the region's fragments along `rect`; returns the indices of those inside it.
    fn split(&mut self, region: RegionId, rect: &Rect) -> Vec<usize> {
        let frags = &mut self.fragments[region.index()];
        let mut inside = Vec::new();
        let mut i = 0;
        while i < frags.len() {
            let f = frags[i].rect;
            if rect.contains(&f) {
                inside.push(i);
            } else if f.overlaps(rect) {
                let state = frags[i].state.clone();
                frags[i].rect = f.intersect(rect);
                inside.push(i);
                for piece in f.subtract(rect) {
                    frags.push(Fragment {
                        rect: piece,
                        state: state.clone(),
                    });
                }
            }
            i += 1;
        }
        inside
    }
}

/// A holder on `device` if there is one, else the first (the writer).
fn holder_on(instances: &[Instance], holders: &[Holder], device: DeviceId) -> Holder {
    *holders
        .iter()
        .find(|h| instances[h.instance as usize].device == device)
        .unwrap_or(&holders[0])
}

/// Whether the persistent data of `after` covers exactly the placements `before` (the step leaves
/// things where the next step expects them), comparing instances by key.
pub fn same_placements(
    before: &[Placement],
    before_instances: &[Instance],
    after: &[Placement],
    after_instances: &[Instance],
) -> bool {
    let covered = |ps: &[Placement],
                   insts: &[Instance],
                   region: RegionId,
                   rect: &Rect,
                   key: &Instance|
     -> usize {
        ps.iter()
            .filter(|p| {
                p.region == region && p.instances.iter().any(|&i| insts[i as usize] == *key)
            })
            .map(|p| p.rect.intersect(rect).volume())
            .sum()
    };
    let all_in = |xs: &[Placement], xi: &[Instance], ys: &[Placement], yi: &[Instance]| {
        xs.iter().all(|p| {
            p.instances
                .iter()
                .all(|&i| covered(ys, yi, p.region, &p.rect, &xi[i as usize]) == p.rect.volume())
        })
    };
    all_in(before, before_instances, after, after_instances)
        && all_in(after, after_instances, before, before_instances)
}
