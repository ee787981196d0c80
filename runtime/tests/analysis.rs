//! The dependence analysis on small hand-made programs: read-after-write, write-after-read,
//! reductions, halo copies, reads of unwritten data, the locality that `split_programs` relies on,
//! and `Rect::subtract`. Op ids and instance ids are those the analysis hands out in launch order, so
//! each test asserts the exact ops, dependences and rects it produces.

use legion_ops::partition::DeviceId;
use legion_ops::shape::MAX_DIMS;
use legion_ops::train::Sgd;
use legion_ops::{GraphBuilder, LayerId, Rect, Shape};
use legion_runtime::Buffer;
use legion_runtime::SerialMemory;
use legion_runtime::analysis::{
    Analysis, AnalysisError, Instance, InstanceId, InstanceKind, Op, OpId, OpKind, StepGraph,
};
use legion_runtime::program::{LocalOpKind, split_programs};
use legion_runtime::region::{DType, RegionId, RegionInfo, RegionKind, Regions};
use legion_runtime::task::{Privilege, Role, TaskKind, TaskSpec};
use legion_runtime::{ExecContext, StepInput};
use proptest::prelude::*;

use Privilege::{ReadOnly, ReadWrite, Reduce, WriteDiscard};

// ---- Building programs ----

/// Regions `RegionId(0), RegionId(1), …` from (kind, shape), named `r0`, `r1`, ….
fn regions(specs: &[(RegionKind, &[usize])]) -> Regions {
    Regions::from_infos(
        specs
            .iter()
            .enumerate()
            .map(|(i, &(kind, dims))| RegionInfo {
                name: format!("r{i}"),
                kind,
                shape: Shape::new(dims),
                dtype: match kind {
                    RegionKind::BnMoments | RegionKind::BnGradSums => DType::F64,
                    _ => DType::F32,
                },
            })
            .collect(),
    )
}

const A: RegionId = RegionId(0);
const B: RegionId = RegionId(1);
const C: RegionId = RegionId(2);
const D: RegionId = RegionId(3);

/// Elements `[lo, hi)` of a 1-d region of 8 elements.
fn span(lo: usize, hi: usize) -> Rect {
    Rect::new(&[lo], &[hi])
}

/// Rows `[lo, hi)` (axis h) of an NCHW region of shape `[1, 2, 8, 3]`.
const NCHW: [usize; 4] = [1, 2, 8, 3];
fn rows(lo: usize, hi: usize) -> Rect {
    Rect::new(&[0, 0, lo, 0], &[1, 2, hi, 3])
}

/// A task on `device` with requirements (region, rect, privilege); the analysis ignores roles and
/// the tile, so they are derived from the privileges.
fn task(device: DeviceId, reqs: &[(RegionId, Rect, Privilege)]) -> TaskSpec {
    let mut t = TaskSpec::new(TaskKind::Forward, LayerId(0), reqs[0].1, device);
    for &(region, rect, privilege) in reqs {
        let role = match privilege {
            ReadOnly => Role::Input(0),
            WriteDiscard | ReadWrite => Role::Output,
            Reduce => Role::InputGrad(0),
        };
        t.require(region, rect, privilege, role);
    }
    t
}

fn launch(a: &mut Analysis, device: DeviceId, reqs: &[(RegionId, Rect, Privilege)]) -> OpId {
    a.launch(task(device, reqs)).unwrap()
}

// ---- Inspecting the graph ----

/// The instances of task `op`, by requirement.
fn task_instances(g: &StepGraph, op: OpId) -> &[InstanceId] {
    match &g.ops[op as usize].kind {
        OpKind::Task { instances, .. } => instances,
        other => panic!("op {op} is not a task: {other:?}"),
    }
}

/// The instance of requirement `req` of task `op`.
fn inst_of(g: &StepGraph, op: OpId, req: usize) -> InstanceId {
    task_instances(g, op)[req]
}

const NO_DEPS: [OpId; 0] = [];

fn deps(g: &StepGraph, op: OpId) -> &[OpId] {
    &g.ops[op as usize].deps
}

/// "task", "copy" or "fold" per op: the shape of the graph at a glance.
fn kinds(g: &StepGraph) -> Vec<&'static str> {
    g.ops
        .iter()
        .map(|op| match op.kind {
            OpKind::Task { .. } => "task",
            OpKind::Copy { .. } => "copy",
            OpKind::Fold { .. } => "fold",
        })
        .collect()
}

fn copy(src: InstanceId, dst: InstanceId, rect: Rect, deps: &[OpId], dst_deps: &[OpId]) -> Op {
    Op {
        kind: OpKind::Copy {
            src,
            dst,
            rect,
            dst_deps: dst_deps.to_vec(),
        },
        deps: deps.to_vec(),
    }
}

fn fold(srcs: &[InstanceId], dst: InstanceId, rect: Rect, accumulate: bool, deps: &[OpId]) -> Op {
    Op {
        kind: OpKind::Fold {
            srcs: srcs.to_vec(),
            dst,
            rect,
            accumulate,
        },
        deps: deps.to_vec(),
    }
}

fn instance(region: RegionId, device: DeviceId, rect: Rect, kind: InstanceKind) -> Instance {
    Instance {
        region,
        device,
        rect,
        kind,
    }
}

/// Runs the copies and folds of `g` (not its tasks) with the SerialMemory executor, from buffers
/// given by `fill`: stands in for the tasks' writes.
fn run_data_movement(
    g: &StepGraph,
    regions: &Regions,
    fill: impl FnOnce(&mut [Buffer]),
) -> SerialMemory {
    let moves = StepGraph {
        ops: g
            .ops
            .iter()
            .filter(|op| !matches!(op.kind, OpKind::Task { .. }))
            .cloned()
            .collect(),
        ..g.clone()
    };
    let mut mem = SerialMemory::new(&moves, regions);
    fill(&mut mem.buffers);
    // No task runs, so the context is never looked at; it only has to exist.
    let mut b = GraphBuilder::new("none");
    b.input("x", Shape::new(&[1])).unwrap();
    let graph = b.finish();
    let input = StepInput::whole(0, Vec::new(), Vec::new(), 0);
    let ctx = ExecContext {
        precision: legion_ops::Precision::Fp32,
        graph: &graph,
        seed: 0,
        sgd: Sgd::default(),
        input: &input,
    };
    mem.run(&moves, &ctx).unwrap();
    mem
}

// ---- 1. Read after write ----

#[test]
fn read_after_write_on_the_same_device_waits_for_the_writer_without_a_copy() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let w = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let r = launch(&mut a, 0, &[(A, span(0, 8), ReadOnly)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["task", "task"]);
    assert_eq!(deps(&g, w), NO_DEPS);
    assert_eq!(deps(&g, r), [w]);
    assert_eq!(inst_of(&g, r, 0), inst_of(&g, w, 0));
    assert_eq!(
        g.instances,
        [instance(A, 0, span(0, 8), InstanceKind::Normal)]
    );
}

#[test]
fn read_after_write_on_another_device_copies_once_from_the_writer() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let w = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let r = launch(&mut a, 1, &[(A, span(0, 8), ReadOnly)]);
    // A second reader there reuses the copy.
    let r2 = launch(&mut a, 1, &[(A, span(0, 8), ReadOnly)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["task", "copy", "task", "task"]);
    let (src, dst) = (inst_of(&g, w, 0), inst_of(&g, r, 0));
    assert_eq!(
        g.instances[dst as usize],
        instance(A, 1, span(0, 8), InstanceKind::Normal)
    );
    assert_eq!(g.ops[1], copy(src, dst, span(0, 8), &[w], &[]));
    assert_eq!(deps(&g, r), [1]);
    assert_eq!(deps(&g, r2), [1]);
    assert_eq!(inst_of(&g, r2, 0), dst);
    assert_eq!(g.remote_copies().count(), 1);
}

// ---- 2. Write after read ----

#[test]
fn write_after_read_waits_for_readers_of_the_same_instance_only() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let w1 = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let r = launch(&mut a, 0, &[(A, span(0, 8), ReadOnly)]);
    // Another device's instance: no hazard with `r`.
    let w_other = launch(&mut a, 1, &[(A, span(0, 8), WriteDiscard)]);
    let w2 = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["task"; 4]);
    assert_eq!(deps(&g, r), [w1]);
    assert_eq!(deps(&g, w_other), NO_DEPS);
    assert_ne!(inst_of(&g, w_other, 0), inst_of(&g, w1, 0));
    assert_eq!(deps(&g, w2), [w1, r]);
}

#[test]
fn write_after_read_waits_for_a_copy_reading_the_instance() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let w1 = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let r1 = launch(&mut a, 1, &[(A, span(0, 8), ReadOnly)]); // copy 1 reads w1's instance
    let w2 = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    // Bringing w2's value to device 1 overwrites the instance r1 read: the copy's destination
    // side waits for r1 (and for the earlier copy into it), its source side for w2.
    let r2 = launch(&mut a, 1, &[(A, span(0, 8), ReadOnly)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["task", "copy", "task", "task", "copy", "task"]);
    let (i0, i1) = (inst_of(&g, w1, 0), inst_of(&g, r1, 0));
    assert_eq!(g.ops[1], copy(i0, i1, span(0, 8), &[w1], &[]));
    assert_eq!(deps(&g, w2), [w1, 1]);
    assert_eq!(g.ops[4], copy(i0, i1, span(0, 8), &[w2], &[1, r1]));
    assert_eq!(deps(&g, r2), [4]);
}

#[test]
fn hazards_are_per_rect_within_an_instance() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let w = launch(&mut a, 0, &[(A, span(0, 8), WriteDiscard)]);
    let r1 = launch(&mut a, 1, &[(A, span(0, 4), ReadOnly)]); // copy 1 reads [0, 4) of w's
    let w1 = launch(&mut a, 1, &[(A, span(4, 8), WriteDiscard)]);
    let r0 = launch(&mut a, 0, &[(A, span(0, 8), ReadOnly)]);
    let rw = launch(&mut a, 0, &[(A, span(0, 8), ReadWrite)]);
    let g = a.finish();

    assert_eq!(
        kinds(&g),
        ["task", "copy", "task", "task", "copy", "task", "task"]
    );
    let i0 = inst_of(&g, w, 0);
    assert_eq!(
        g.ops[1],
        copy(i0, inst_of(&g, r1, 0), span(0, 4), &[w], &[])
    );
    assert_eq!(deps(&g, r1), [1]);
    // Bringing [4, 8) back into w's instance overwrites what w wrote there, but not the rows
    // copy 1 read: it waits for w only.
    assert_eq!(
        g.ops[4],
        copy(inst_of(&g, w1, 0), i0, span(4, 8), &[w1], &[w])
    );
    assert_eq!(deps(&g, r0), [w, 4]);
    // The read-write waits for everything that touched the instance.
    assert_eq!(inst_of(&g, rw, 0), i0);
    assert_eq!(deps(&g, rw), [w, 1, 4, r0]);
}

// ---- 3. Reductions ----

/// Terms whose f32 sum depends on the order they are added in.
const TERMS: [f32; 4] = [1.0, 1.0e8, -1.0e8, 1.0];

#[test]
fn reductions_do_not_serialize_and_fold_in_ascending_device_order() {
    let regions = regions(&[(RegionKind::Gradient, &[8])]);
    let mut a = Analysis::new(&regions);
    // Launched out of device order: the fold must still sum device 0, 1, 2, 3.
    let order: [DeviceId; 4] = [2, 0, 3, 1];
    let reducers: Vec<OpId> = order
        .iter()
        .map(|&d| launch(&mut a, d, &[(A, span(0, 8), Reduce)]))
        .collect();
    let r = launch(&mut a, 0, &[(A, span(0, 8), ReadOnly)]);
    let g = a.finish();

    assert_eq!(
        kinds(&g),
        [
            "task", "task", "task", "task", "copy", "copy", "copy", "fold", "task"
        ]
    );
    for (&d, &t) in order.iter().zip(&reducers) {
        assert_eq!(deps(&g, t), NO_DEPS);
        let term = g.instances[inst_of(&g, t, 0) as usize];
        assert_eq!(term, instance(A, d, span(0, 8), InstanceKind::Reduction));
    }
    let reducer_of = |d: DeviceId| reducers[order.iter().position(|&o| o == d).unwrap()];
    let term_of = |d: DeviceId| inst_of(&g, reducer_of(d), 0);

    // Remote terms (devices 1, 2, 3, in that order) into staging instances on device 0.
    let mut staging = Vec::new();
    for (op, d) in (4..7).zip(1..4) {
        let OpKind::Copy { dst, .. } = g.ops[op as usize].kind else {
            unreachable!()
        };
        assert_eq!(
            g.instances[dst as usize],
            instance(A, 0, span(0, 8), InstanceKind::Staging)
        );
        assert_eq!(
            g.ops[op as usize],
            copy(term_of(d), dst, span(0, 8), &[reducer_of(d)], &[])
        );
        staging.push(dst);
    }
    let out = inst_of(&g, r, 0);
    assert_eq!(
        g.instances[out as usize],
        instance(A, 0, span(0, 8), InstanceKind::Normal)
    );
    let srcs = [term_of(0), staging[0], staging[1], staging[2]];
    assert_eq!(
        g.ops[7],
        fold(&srcs, out, span(0, 8), false, &[reducer_of(0), 4, 5, 6])
    );
    assert_eq!(deps(&g, r), [7]);

    // The executor sums in that order: ((1 + 1e8) - 1e8) + 1 = 1 in f32 (exactly 2 in reals,
    // and 0 in launch order, so the order is visible).
    let mem = run_data_movement(&g, &regions, |buffers| {
        for (&d, &t) in order.iter().zip(&reducers) {
            let values = (0..8).map(|i| TERMS[d] * (1 + i % 2) as f32).collect();
            buffers[inst_of(&g, t, 0) as usize] = Buffer::F32(values);
        }
    });
    let ascending = |scale: f32| TERMS.iter().fold(0.0f32, |s, t| s + t * scale);
    let launch_order = order.iter().fold(0.0f32, |s, &d| s + TERMS[d]);
    assert_ne!(
        ascending(1.0),
        launch_order,
        "the terms do not tell orders apart"
    );
    let expected: Vec<f32> = (0..8).map(|i| ascending((1 + i % 2) as f32)).collect();
    assert_eq!(mem.buffers[out as usize], Buffer::F32(expected));
}

#[test]
fn reductions_on_top_of_a_value_accumulate_onto_it() {
    let regions = regions(&[(RegionKind::Gradient, &[8])]);
    let mut a = Analysis::new(&regions);
    let w = launch(&mut a, 1, &[(A, span(0, 8), WriteDiscard)]);
    let t = launch(&mut a, 0, &[(A, span(0, 8), Reduce)]);
    let r = launch(&mut a, 0, &[(A, span(0, 8), ReadOnly)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["task", "task", "copy", "fold", "task"]);
    assert_eq!(deps(&g, t), NO_DEPS);
    let out = inst_of(&g, r, 0);
    // The base is copied into the reader's instance, then the term added on top.
    assert_eq!(
        g.ops[2],
        copy(inst_of(&g, w, 0), out, span(0, 8), &[w], &[])
    );
    assert_eq!(
        g.ops[3],
        fold(&[inst_of(&g, t, 0)], out, span(0, 8), true, &[t, 2])
    );
    assert_eq!(deps(&g, r), [3]);
}

// ---- 4. Halos ----

/// Two tiles of rows [0, 4) and [4, 8) written on devices 0 and 1, then conv-like readers of rows
/// [0, 5) on device 0 and [3, 8) on device 1.
fn halo_program(a: &mut Analysis, x: RegionId) -> [OpId; 4] {
    let w0 = launch(a, 0, &[(x, rows(0, 4), WriteDiscard)]);
    let w1 = launch(a, 1, &[(x, rows(4, 8), WriteDiscard)]);
    let r0 = launch(a, 0, &[(x, rows(0, 5), ReadOnly)]);
    let r1 = launch(a, 1, &[(x, rows(3, 8), ReadOnly)]);
    [w0, w1, r0, r1]
}

#[test]
fn halo_reads_copy_exactly_the_missing_rows() {
    let regions = regions(&[(RegionKind::Activation, &NCHW)]);
    let mut a = Analysis::new(&regions);
    let [w0, w1, r0, r1] = halo_program(&mut a, A);
    let g = a.finish();

    assert_eq!(w0, 0);
    assert_eq!(w1, 1);
    assert_eq!(r0, 4);
    assert_eq!(r1, 8);
    assert_eq!(
        kinds(&g),
        [
            "task", "task", "copy", "copy", "task", "copy", "copy", "copy", "task"
        ]
    );
    let (tile0, tile1) = (inst_of(&g, w0, 0), inst_of(&g, w1, 0));
    let (halo0, halo1) = (inst_of(&g, r0, 0), inst_of(&g, r1, 0));
    assert_eq!(
        [tile0, tile1, halo0, halo1].map(|i| g.instances[i as usize]),
        [
            instance(A, 0, rows(0, 4), InstanceKind::Normal),
            instance(A, 1, rows(4, 8), InstanceKind::Normal),
            instance(A, 0, rows(0, 5), InstanceKind::Normal),
            instance(A, 1, rows(3, 8), InstanceKind::Normal),
        ]
    );

    // Device 0: its own rows locally, row 4 from device 1.
    assert_eq!(g.ops[2], copy(tile0, halo0, rows(0, 4), &[w0], &[]));
    assert_eq!(g.ops[3], copy(tile1, halo0, rows(4, 5), &[w1], &[]));
    assert_eq!(deps(&g, r0), [2, 3]);
    // Device 1: row 3 from device 0's writer, then its own rows, in the two fragments that the
    // first read left them in ([4, 5) and [5, 8)).
    assert_eq!(g.ops[5], copy(tile0, halo1, rows(3, 4), &[w0], &[]));
    assert_eq!(g.ops[6], copy(tile1, halo1, rows(4, 5), &[w1], &[]));
    assert_eq!(g.ops[7], copy(tile1, halo1, rows(5, 8), &[w1], &[]));
    assert_eq!(deps(&g, r1), [5, 6, 7]);

    let remote: Vec<(DeviceId, DeviceId, Rect)> = g
        .remote_copies()
        .map(|(_, s, d, rect)| (s.device, d.device, rect))
        .collect();
    assert_eq!(remote, [(1, 0, rows(4, 5)), (0, 1, rows(3, 4))]);
    // One row of 2 × 3 f32 each way.
    assert_eq!(g.remote_bytes(&regions), 2 * 2 * 3 * 4);
}

// ---- 5. Reads of data nothing wrote ----

#[test]
fn reading_unwritten_activations_is_an_error() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let reader = task(0, &[(A, span(2, 6), ReadOnly)]);
    assert_eq!(
        a.launch(reader.clone()),
        Err(AnalysisError::ReadBeforeWrite {
            task: reader.to_string(),
            region: "r0".into(),
            rect: span(2, 6).to_string(),
        })
    );

    // Partly written is not enough either.
    let mut a = Analysis::new(&regions);
    launch(&mut a, 0, &[(A, span(0, 4), WriteDiscard)]);
    let reader = task(0, &[(A, span(0, 8), ReadOnly)]);
    assert!(matches!(
        a.launch(reader),
        Err(AnalysisError::ReadBeforeWrite { .. })
    ));
}

#[test]
fn reading_unwritten_gradients_reads_zeros() {
    let regions = regions(&[(RegionKind::Gradient, &[8])]);
    let mut a = Analysis::new(&regions);
    let r = launch(&mut a, 1, &[(A, span(2, 6), ReadOnly)]);
    let g = a.finish();

    assert_eq!(kinds(&g), ["fold", "task"]);
    let out = inst_of(&g, r, 0);
    assert_eq!(
        g.instances[out as usize],
        instance(A, 1, span(2, 6), InstanceKind::Normal)
    );
    assert_eq!(g.ops[0], fold(&[], out, span(2, 6), false, &[]));
    assert_eq!(deps(&g, r), [0]);

    let mem = run_data_movement(&g, &regions, |buffers| {
        buffers[out as usize] = Buffer::F32(vec![7.0; 4]);
    });
    assert_eq!(mem.buffers[out as usize], Buffer::F32(vec![0.0; 4]));
}

#[test]
fn out_of_bounds_requirements_are_rejected() {
    let regions = regions(&[(RegionKind::Activation, &[8])]);
    let mut a = Analysis::new(&regions);
    let t = task(0, &[(A, span(4, 9), WriteDiscard)]);
    assert_eq!(
        a.launch(t.clone()),
        Err(AnalysisError::OutOfBounds {
            task: t.to_string(),
            region: "r0".into(),
            rect: span(4, 9).to_string(),
            shape: vec![8],
        })
    );
}

// ---- 6. Locality ----

/// A forward and backward pass of a conv-like layer split in two along h: halos forward, halo
/// gradients reduced backward, a parameter gradient reduced from both devices, an update on the
/// parameter's owner and a broadcast of the new value.
fn two_device_step(a: &mut Analysis) {
    let (x, gx, p, gp) = (A, B, C, D);
    a.place(p, span(0, 4), &[0, 1]);
    halo_program(a, x);
    let tiles = [(0, rows(0, 4), rows(0, 5)), (1, rows(4, 8), rows(3, 8))];
    for (d, _, halo) in tiles {
        let reqs = [
            (x, halo, ReadOnly),
            (p, span(0, 4), ReadOnly),
            (gx, halo, Reduce),
            (gp, span(0, 4), Reduce),
        ];
        launch(a, d, &reqs);
    }
    // The producer's backward, reading its tile's input gradient.
    for (d, tile, _) in tiles {
        launch(a, d, &[(gx, tile, ReadOnly)]);
    }
    launch(
        a,
        0,
        &[(gp, span(0, 4), ReadOnly), (p, span(0, 4), ReadWrite)],
    );
    a.prefetch(p, span(0, 4), 1).unwrap();
    // The next forward pass overwrites device 0's tile, which device 1's halo copy read.
    launch(
        a,
        0,
        &[(x, rows(0, 4), WriteDiscard), (p, span(0, 4), ReadOnly)],
    );
}

fn two_device_regions() -> Regions {
    regions(&[
        (RegionKind::Activation, &NCHW),
        (RegionKind::Gradient, &NCHW),
        (RegionKind::Param, &[4]),
        (RegionKind::ParamGrad, &[4]),
    ])
}

/// The devices an op has a part on: a copy's source and destination, else the one it runs on.
fn sides(g: &StepGraph, op: OpId) -> (DeviceId, DeviceId) {
    match g.ops[op as usize].kind {
        OpKind::Copy { src, dst, .. } => (
            g.instances[src as usize].device,
            g.instances[dst as usize].device,
        ),
        _ => (g.device(op), g.device(op)),
    }
}

#[test]
fn every_dependence_is_on_an_earlier_op_of_the_same_device() {
    let regions = two_device_regions();
    let mut a = Analysis::new(&regions);
    two_device_step(&mut a);
    let g = a.finish();

    let on = |dep: OpId, device: DeviceId| {
        let (s, d) = sides(&g, dep);
        s == device || d == device
    };
    for (i, op) in g.ops.iter().enumerate() {
        let i = i as OpId;
        let (src_side, dst_side) = sides(&g, i);
        for &d in &op.deps {
            assert!(d < i, "op {i} depends on later op {d}");
            assert!(on(d, src_side), "op {i} on {src_side} depends on op {d}");
        }
        if let OpKind::Copy { dst_deps, .. } = &op.kind {
            for &d in dst_deps {
                assert!(d < i, "copy {i} depends on later op {d}");
                assert!(on(d, dst_side), "copy {i} into {dst_side} waits for op {d}");
            }
        }
    }

    let programs = split_programs(&g, &regions, 2);
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for p in &programs {
        for (i, op) in p.ops.iter().enumerate() {
            assert!(
                op.deps.iter().all(|&d| (d as usize) < i),
                "device {}: op {i} depends on {:?}",
                p.device,
                op.deps
            );
            match op.kind {
                LocalOpKind::Send { copy, rect, to, .. } => sends.push((copy, p.device, to, rect)),
                LocalOpKind::Recv { copy, rect, .. } => recvs.push((copy, p.device, rect)),
                _ => {}
            }
        }
        for (i, ds) in p.dependents.iter().enumerate() {
            assert!(
                ds.iter()
                    .all(|&d| p.ops[d as usize].deps.contains(&(i as u32)))
            );
        }
    }
    sends.sort_by_key(|s| s.0);
    recvs.sort_by_key(|r| r.0);
    let remote: Vec<(OpId, DeviceId, DeviceId, Rect)> = g
        .remote_copies()
        .map(|(op, s, d, rect)| (op, s.device, d.device, rect))
        .collect();
    assert_eq!(sends, remote);
    let recv_sides: Vec<(OpId, DeviceId, Rect)> = remote
        .iter()
        .map(|&(op, _, to, rect)| (op, to, rect))
        .collect();
    assert_eq!(recvs, recv_sides);

    // The last task's write into device 0's tile waits for the send of its halo row to device 1.
    let last = g.ops.len() as OpId - 1;
    let halo_send = remote
        .iter()
        .find(|&&(_, s, _, rect)| s == 0 && rect == rows(3, 4))
        .unwrap()
        .0;
    assert!(deps(&g, last).contains(&halo_send));
    let p0 = &programs[0];
    let local_last = p0.ops.len() - 1;
    assert_eq!(p0.ops[local_last].global, last);
    let local_send = p0.ops.iter().position(|o| o.global == halo_send).unwrap() as u32;
    assert!(p0.ops[local_last].deps.contains(&local_send));
}

// ---- 7. subtract ----

fn rect_in(ndim: usize) -> impl Strategy<Value = Rect> {
    prop::collection::vec((0usize..6, 1usize..6), ndim).prop_map(|axes| {
        let lo: Vec<usize> = axes.iter().map(|&(lo, _)| lo).collect();
        let hi: Vec<usize> = axes.iter().map(|&(lo, len)| lo + len).collect();
        Rect::new(&lo, &hi)
    })
}

fn rect_pair() -> impl Strategy<Value = (Rect, Rect)> {
    (1..=MAX_DIMS).prop_flat_map(|n| (rect_in(n), rect_in(n)))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5AB7_12AC),
        ..ProptestConfig::default()
    })]

    #[test]
    fn subtract_tiles_a_minus_b((a, b) in rect_pair()) {
        let pieces = a.subtract(&b);
        prop_assert!(pieces.len() <= 2 * a.ndim());
        for (i, p) in pieces.iter().enumerate() {
            prop_assert!(!p.is_empty(), "empty piece {:?}", p);
            prop_assert!(a.contains(p), "{:?} outside {:?}", p, a);
            prop_assert!(!p.overlaps(&b), "{:?} overlaps {:?}", p, b);
            for q in &pieces[i + 1..] {
                prop_assert!(!p.overlaps(q), "{:?} overlaps {:?}", p, q);
            }
        }
        let volume: usize = pieces.iter().map(Rect::volume).sum();
        prop_assert_eq!(volume, a.volume() - a.intersect(&b).volume());
    }
}

#[test]
fn subtract_cuts_a_halo_row_out_of_a_tile() {
    assert_eq!(rows(0, 8).subtract(&rows(3, 5)), [rows(0, 3), rows(5, 8)]);
    assert_eq!(rows(0, 4).subtract(&rows(4, 8)), [rows(0, 4)]);
    assert_eq!(rows(3, 5).subtract(&rows(0, 8)), [] as [Rect; 0]);
}
