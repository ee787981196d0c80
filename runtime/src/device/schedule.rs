//! The step scheduler of one device: which ops of its program may run, given what has run and what
//! has arrived from other devices. Pure logic, quinn-proto's way (no threads, no I/O, no clocks):
//! the device actor drives it for a CPU and a GPU device alike, and hands each op it makes ready
//! to the device's driver.
//!
//! An op waits for its local dependences; a `Recv` also waits for its slice. Slices may come
//! before their step starts here (the sender is ahead), twice (a broken or hostile peer), for no
//! receive of this device, or of the wrong type or length: the scheduler keeps the first kind,
//! refuses the next two, and lets the last one end its step with an error rather than hang or
//! write out of an instance's bounds.

use crate::analysis::OpId;
use crate::buffer::Buffer;
use crate::program::{DeviceProgram, LocalOpKind, Part};
use crate::region::DType;
use crate::transport::SliceData;
use std::collections::HashMap;
use std::sync::Arc;

/// A slice as it reaches a device.
pub(crate) struct Slice {
    pub step: u64,
    pub copy: OpId,
    pub data: SliceData,
}

/// What became of an arriving slice.
#[derive(Debug, PartialEq)]
pub(crate) enum Arrival {
    /// For a step that has not started here: kept until it does.
    Early,
    /// Counted towards its receive.
    Accepted,
    /// For a step this device has finished: dropped.
    Stale,
    /// A second slice of one copy in one step: dropped (counting it would complete the receive
    /// before its real data came).
    Duplicate,
    /// No receive of this device takes this copy: dropped.
    Unexpected,
    /// Not of the receive's element type and length: zeros of the right shape stand in, so that
    /// the step ends, with `error`.
    Misshapen { error: String },
}

/// A receive of this device's program: its op and the shape its slice must have.
#[derive(Clone, Copy)]
struct Receive {
    op: u32,
    dtype: DType,
    len: usize,
}

struct Running {
    part: Part,
    step: u64,
    /// Per op: the dependences (and, for a receive, the slice) it still waits for.
    waiting: Vec<u32>,
    /// Slices counted towards receives that have not been handed out yet.
    arrived: HashMap<OpId, SliceData>,
    done: usize,
}

pub(crate) struct Schedule {
    program: Arc<DeviceProgram>,
    receives: HashMap<OpId, Receive>,
    /// Per op, what it waits for when a run of its part starts: its dependences in its part
    /// (those of the other part ran in an earlier run), and a receive's slice.
    waits: Vec<u32>,
    running: Option<Running>,
    /// Per part, the last run that ended here: its slices for it or before it are stale. Each
    /// part numbers its runs on its own (training steps; inference's batches).
    ended: [Option<u64>; 2],
    /// Slices of runs not started here yet, with their part.
    early: Vec<(Part, Slice)>,
    /// Ops ready to run, a stack; kept across steps so that completing an op allocates nothing.
    ready: Vec<u32>,
}

impl Schedule {
    pub fn new(program: Arc<DeviceProgram>) -> Schedule {
        let receives: HashMap<OpId, Receive> = program
            .ops
            .iter()
            .enumerate()
            .filter_map(|(i, op)| match &op.kind {
                LocalOpKind::Recv { copy, dst, rect } => Some((
                    *copy,
                    Receive {
                        op: i as u32,
                        dtype: program.instances[*dst as usize].dtype,
                        len: rect.volume(),
                    },
                )),
                _ => None,
            })
            .collect();
        let mut waits: Vec<u32> = (0..program.ops.len() as u32)
            .map(|i| {
                let part = program.part_of(i);
                let deps = &program.ops[i as usize].deps;
                deps.iter().filter(|&&d| program.part_of(d) == part).count() as u32
            })
            .collect();
        for r in receives.values() {
            waits[r.op as usize] += 1;
        }
        Schedule {
            program,
            receives,
            waits,
            running: None,
            ended: [None; 2],
            early: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// The step running here, if any.
    pub fn step(&self) -> Option<u64> {
        self.running.as_ref().map(|r| r.step)
    }

    fn index(part: Part) -> usize {
        match part {
            Part::Step => 0,
            Part::Inference => 1,
        }
    }

    /// Starts step `step`: the ops without dependences are ready, and the slices that came early
    /// for it are counted now (their arrivals returned, in the order they came); early slices of
    /// steps before it are dropped as stale.
    pub fn start(&mut self, step: u64, part: Part) -> Vec<Arrival> {
        assert!(self.running.is_none(), "step {step} started inside a step");
        let waiting = self.waits.clone();
        self.ready.clear();
        self.ready.extend(
            self.program
                .part(part)
                .filter(|&i| waiting[i as usize] == 0),
        );
        self.running = Some(Running {
            part,
            step,
            waiting,
            arrived: HashMap::new(),
            done: 0,
        });
        let early = std::mem::take(&mut self.early);
        let mut arrivals = Vec::new();
        for (of, slice) in early {
            if of != part || slice.step > step {
                self.early.push((of, slice));
            } else {
                arrivals.push(self.arrive(slice));
            }
        }
        arrivals
    }

    /// Takes a slice from another device.
    pub fn arrive(&mut self, slice: Slice) -> Arrival {
        let Some(&receive) = self.receives.get(&slice.copy) else {
            return Arrival::Unexpected;
        };
        let part = self.program.part_of(receive.op);
        let Some(running) = self
            .running
            .as_mut()
            .filter(|r| r.part == part && r.step == slice.step)
        else {
            // The newest run of the part started here: slices up to it are for runs over.
            let newest = match &self.running {
                Some(r) if r.part == part => Some(r.step),
                _ => self.ended[Schedule::index(part)],
            };
            if newest.is_some_and(|s| slice.step <= s) {
                return Arrival::Stale;
            }
            self.early.push((part, slice));
            return Arrival::Early;
        };
        // A receive waits for its slice until it comes: with nothing left to wait for, the
        // slice came already (and may have been handed out).
        if running.arrived.contains_key(&slice.copy) || running.waiting[receive.op as usize] == 0 {
            return Arrival::Duplicate;
        }
        let (dtype, len) = slice.data.shape();
        let mut arrival = Arrival::Accepted;
        let data = if (dtype, len) == (receive.dtype, receive.len) {
            slice.data
        } else {
            arrival = Arrival::Misshapen {
                error: format!(
                    "copy {}: received {len} {dtype:?} values, expected {} {:?}",
                    slice.copy, receive.len, receive.dtype
                ),
            };
            SliceData::Host(Arc::new(Buffer::zeros(receive.dtype, receive.len)))
        };
        running.arrived.insert(slice.copy, data);
        let waiting = &mut running.waiting[receive.op as usize];
        *waiting -= 1;
        if *waiting == 0 {
            self.ready.push(receive.op);
        }
        arrival
    }

    /// The next ready op: each op once per step, after every op it depends on completed.
    pub fn pop_ready(&mut self) -> Option<u32> {
        self.ready.pop()
    }

    /// The slice of receive `op`, once the op is ready (taken: it goes to the driver).
    pub fn take_slice(&mut self, op: u32) -> Option<SliceData> {
        let LocalOpKind::Recv { copy, .. } = &self.program.ops[op as usize].kind else {
            return None;
        };
        self.running.as_mut()?.arrived.remove(copy)
    }

    /// Op `op` is done (or, on an in-order stream, queued behind everything it depends on): its
    /// dependents may become ready.
    pub fn complete(&mut self, op: u32) {
        let running = self
            .running
            .as_mut()
            .expect("an op completed outside a step");
        running.done += 1;
        for &d in &self.program.dependents[op as usize] {
            if self.program.part_of(d) != running.part {
                continue;
            }
            let waiting = &mut running.waiting[d as usize];
            *waiting -= 1;
            if *waiting == 0 {
                self.ready.push(d);
            }
        }
    }

    /// Whether every op of the running step has completed.
    pub fn all_done(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(|r| r.done == self.program.part(r.part).len())
    }

    /// Ends the running step; slices of later steps stay kept.
    pub fn end(&mut self) {
        if let Some(running) = self.running.take() {
            self.ended[Schedule::index(running.part)] = Some(running.step);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{LocalInstance, LocalOp};
    use legion_ops::Rect;

    /// A program of one device: `0` copies instance 0 into 1; `1` receives copy 7 into instance
    /// 2 after op 0; `2` sends instance 2 onwards after op 1; `3` receives copy 9 (no deps).
    fn program() -> Arc<DeviceProgram> {
        let rect = Rect::new(&[0], &[4]);
        let instance = |global| LocalInstance {
            global,
            rect,
            dtype: DType::F32,
        };
        let op = |kind, deps: Vec<u32>| LocalOp {
            kind,
            global: 0,
            deps,
        };
        let ops = vec![
            op(
                LocalOpKind::Copy {
                    src: 0,
                    dst: 1,
                    rect,
                },
                vec![],
            ),
            op(
                LocalOpKind::Recv {
                    copy: 7,
                    dst: 2,
                    rect,
                },
                vec![0],
            ),
            op(
                LocalOpKind::Send {
                    copy: 8,
                    src: 2,
                    rect,
                    to: 1,
                },
                vec![1],
            ),
            op(
                LocalOpKind::Recv {
                    copy: 9,
                    dst: 1,
                    rect,
                },
                vec![],
            ),
        ];
        let mut dependents = vec![Vec::new(); ops.len()];
        for (i, o) in ops.iter().enumerate() {
            for &d in &o.deps {
                dependents[d as usize].push(i as u32);
            }
        }
        Arc::new(DeviceProgram {
            precision: legion_ops::Precision::Fp32,
            device: 0,
            instances: vec![instance(0), instance(1), instance(2)],
            inference_from: ops.len() as u32,
            ops,
            dependents,
        })
    }

    fn slice(step: u64, copy: OpId, len: usize) -> Slice {
        Slice {
            step,
            copy,
            data: SliceData::Host(Arc::new(Buffer::F32(vec![1.0; len]))),
        }
    }

    fn drain(s: &mut Schedule) -> Vec<u32> {
        std::iter::from_fn(|| s.pop_ready()).collect()
    }

    #[test]
    fn ops_become_ready_after_their_dependences_and_receives_after_their_slice() {
        let mut s = Schedule::new(program());
        assert!(s.start(1, Part::Step).is_empty());
        assert_eq!(drain(&mut s), [0]);
        s.complete(0);
        // The receive has its dependence but not its slice.
        assert!(drain(&mut s).is_empty());
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Accepted);
        assert_eq!(drain(&mut s), [1]);
        assert!(s.take_slice(1).is_some());
        s.complete(1);
        assert_eq!(drain(&mut s), [2]);
        s.complete(2);
        assert!(!s.all_done());
        assert_eq!(s.arrive(slice(1, 9, 4)), Arrival::Accepted);
        assert_eq!(drain(&mut s), [3]);
        s.complete(3);
        assert!(s.all_done());
    }

    #[test]
    fn a_slice_before_its_step_is_counted_when_the_step_starts() {
        let mut s = Schedule::new(program());
        assert_eq!(s.arrive(slice(1, 9, 4)), Arrival::Early);
        assert_eq!(s.arrive(slice(2, 9, 4)), Arrival::Early);
        assert_eq!(s.start(1, Part::Step), [Arrival::Accepted]);
        let mut ready = drain(&mut s);
        ready.sort_unstable();
        assert_eq!(ready, [0, 3]);
        // The next step's slice waits for its step; a running step's own copy comes once.
        for op in [0, 3] {
            s.complete(op);
        }
        s.arrive(slice(1, 7, 4));
        for op in [1, 2] {
            assert_eq!(drain(&mut s), [op]);
            s.complete(op);
        }
        assert!(s.all_done());
        s.end();
        assert_eq!(s.start(2, Part::Step), [Arrival::Accepted]);
    }

    #[test]
    fn a_duplicate_slice_is_refused_and_does_not_complete_its_receive_early() {
        let mut s = Schedule::new(program());
        s.start(1, Part::Step);
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Accepted);
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Duplicate);
        // The receive still waits for op 0: the second slice did not count for it.
        assert_eq!(drain(&mut s), [0]);
        s.complete(0);
        assert_eq!(drain(&mut s), [1]);
        s.take_slice(1);
        s.complete(1);
        // Nor once the receive has run.
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Duplicate);
        assert_eq!(drain(&mut s), [2]);
    }

    #[test]
    fn a_slice_of_the_wrong_size_or_type_stands_in_zeros_and_fails_the_step() {
        let mut s = Schedule::new(program());
        s.start(1, Part::Step);
        let Arrival::Misshapen { error } = s.arrive(slice(1, 9, 3)) else {
            panic!("a short slice accepted")
        };
        assert_eq!(error, "copy 9: received 3 F32 values, expected 4 F32");
        assert!(drain(&mut s).contains(&3));
        let Some(SliceData::Host(zeros)) = s.take_slice(3) else {
            panic!("no stand-in")
        };
        assert_eq!(*zeros, Buffer::F32(vec![0.0; 4]));
        let f64s = Slice {
            step: 1,
            copy: 7,
            data: SliceData::Host(Arc::new(Buffer::F64(vec![1.0; 4]))),
        };
        assert!(matches!(s.arrive(f64s), Arrival::Misshapen { .. }));
    }

    #[test]
    fn slices_for_no_receive_or_a_finished_step_are_dropped() {
        let mut s = Schedule::new(program());
        s.start(3, Part::Step);
        assert_eq!(s.arrive(slice(3, 8, 4)), Arrival::Unexpected);
        assert_eq!(s.arrive(slice(2, 7, 4)), Arrival::Stale);
        s.end();
        // Between steps: the ended step's slices are stale, the next one's early.
        assert_eq!(s.arrive(slice(3, 7, 4)), Arrival::Stale);
        assert_eq!(s.arrive(slice(4, 7, 4)), Arrival::Early);
        assert_eq!(s.start(4, Part::Step), [Arrival::Accepted]);
    }

    #[test]
    fn a_run_of_one_part_runs_its_ops_only_and_counts_the_other_parts_as_done() {
        // Ops 0 and 1 are the step; 2 (after 1) and 3 are inference.
        let mut program = Arc::unwrap_or_clone(program());
        program.inference_from = 2;
        let mut s = Schedule::new(Arc::new(program));
        assert_eq!(s.arrive(slice(1, 9, 4)), Arrival::Early);
        assert!(s.start(1, Part::Step).is_empty());
        assert_eq!(drain(&mut s), [0]);
        s.complete(0);
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Accepted);
        assert_eq!(drain(&mut s), [1]);
        s.complete(1);
        // Op 2 depends on op 1 but is inference's: the step ends without it.
        assert!(drain(&mut s).is_empty());
        assert!(s.all_done());
        s.end();
        // Inference numbers its runs on its own; its early slice counts now.
        assert_eq!(s.start(1, Part::Inference), [Arrival::Accepted]);
        let mut ready = drain(&mut s);
        ready.sort_unstable();
        assert_eq!(ready, [2, 3]);
        for op in [2, 3] {
            s.complete(op);
        }
        assert!(s.all_done());
        s.end();
        assert_eq!(s.arrive(slice(1, 9, 4)), Arrival::Stale);
        assert_eq!(s.arrive(slice(1, 7, 4)), Arrival::Stale);
        assert_eq!(s.arrive(slice(2, 7, 4)), Arrival::Early);
    }
}
