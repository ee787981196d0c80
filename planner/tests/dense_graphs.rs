//! Graphs whose layers read many earlier ones (DenseNet): Algorithm 1's eliminations leave a large
//! residual graph, which the search still solves, within a lower bound it reports, and never
//! worse than the strategies it knows.

mod support;
use support::zoo_at;

use legion_ops::op::{BatchNorm, Conv2d, Dense};
use legion_ops::{Graph, GraphBuilder, Shape};
use legion_planner::progress::{Phase, Progress};
use legion_planner::search::{self, Optimality, SearchKind, exhaustive, optcnn, optcnn_within};
use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost};
use std::sync::Mutex;

/// DenseNet-121 at 32×32 plans on 2, 4 and 16 devices: a strategy at least as cheap as data
/// parallelism and OWT, whose Eq. 1 the tables and the model agree on, within its stated bound.
#[test]
fn densenet_plans_on_2_4_and_16_devices() {
    for (preset, batch) in [("paper:2", 8), ("paper:4", 8), ("paper", 32)] {
        let machine = MachineModel::preset(preset).unwrap();
        let provider = RooflineCost::new(&machine);
        let graph = zoo_at("densenet121", batch, Some(32));
        let model = CostModel::new(&graph, &machine, &provider);
        let tables = CostTables::build(&model);
        let r = optcnn(&tables).unwrap_or_else(|e| panic!("{preset}: {e}"));
        let repriced = model.total(&tables.configs(&r.indices));
        assert!(
            (repriced - r.cost).abs() <= 1e-9 * r.cost,
            "{preset}: Eq. 1 {repriced} vs the search's {}",
            r.cost
        );
        for kind in [SearchKind::Data, SearchKind::Owt] {
            let baseline = search::run(kind, &tables, 0).unwrap().1.total;
            assert!(
                r.cost <= baseline * (1.0 + 1e-12),
                "{preset}: optcnn {} above {kind} {baseline}",
                r.cost
            );
        }
        assert!(r.residual_nodes > 2, "{preset}: a dense block stays");
        if let Optimality::Bounded {
            lower_bound,
            layers,
        } = &r.optimality
        {
            assert!(*lower_bound <= r.cost && *lower_bound > 0.0, "{preset}");
            assert_eq!(layers.len(), r.residual_nodes, "{preset}");
        }
    }
}

/// Two small dense blocks: every layer reads the concatenation of the block's input and every
/// earlier layer's output.
fn dense_blocks(batch: usize) -> Graph {
    let mut m = GraphBuilder::new("dense_blocks");
    let mut x = m.input("x", Shape::nchw(batch, 3, 8, 8)).unwrap();
    for block in 0..2 {
        let mut features = vec![x];
        for layer in 0..3 {
            let name = format!("b{block}.l{layer}");
            let input = match features.as_slice() {
                [one] => *one,
                many => m.concat(&format!("{name}.cat"), many).unwrap(),
            };
            let y = m
                .batch_norm(&format!("{name}.bn"), input, BatchNorm::default().relu())
                .unwrap();
            let conv = Conv2d::new(4, 3).padding(1).no_bias();
            features.push(m.conv2d(&format!("{name}.conv"), y, conv).unwrap());
        }
        x = m.concat(&format!("b{block}.cat"), &features).unwrap();
    }
    let x = m.global_avg_pool("pool", x).unwrap();
    let x = m.flatten("flatten", x).unwrap();
    let x = m.dense("fc", x, Dense::new(5)).unwrap();
    m.softmax_cross_entropy("loss", x).unwrap();
    m.finish()
}

/// With no budget to enumerate, the residual graph's strategy comes from local search: its lower
/// bound and its cost bracket the exhaustive search's optimum, and with a budget it is that
/// optimum.
#[test]
fn the_bound_brackets_the_exhaustive_optimum() {
    for devices in [2, 4] {
        let machine = MachineModel::from_flags(1, devices, None, None).unwrap();
        let provider = RooflineCost::new(&machine);
        for batch in [4, 16] {
            let graph = dense_blocks(batch);
            let model = CostModel::new(&graph, &machine, &provider);
            let tables = CostTables::build(&model);
            let optimum = exhaustive(&tables, 50_000_000).unwrap().cost;
            let what = format!("{devices} devices, batch {batch}");
            let exact = optcnn(&tables).unwrap();
            assert!(
                (exact.cost - optimum).abs() <= 1e-9 * optimum,
                "{what}: {} vs {optimum}",
                exact.cost
            );
            let bounded = optcnn_within(&tables, 0).unwrap();
            let lower = match &bounded.optimality {
                Optimality::Exact => bounded.cost,
                Optimality::Bounded { lower_bound, .. } => *lower_bound,
            };
            assert!(
                lower <= optimum * (1.0 + 1e-9) && optimum <= bounded.cost * (1.0 + 1e-9),
                "{what}: {lower} ≤ {optimum} ≤ {}",
                bounded.cost
            );
            let repriced = model.total(&tables.configs(&bounded.indices));
            assert!(
                (repriced - bounded.cost).abs() <= 1e-9 * bounded.cost,
                "{what}"
            );
        }
    }
}

#[derive(Default)]
struct Recorded(Mutex<Vec<(Phase, u64, u64)>>);

impl Progress for Recorded {
    fn update(&self, phase: Phase, done: u64, total: u64) {
        self.0.lock().unwrap().push((phase, done, total));
    }
}

/// A plan reports its phases in order, each counting up to at most its total.
#[test]
fn a_plan_reports_its_phases() {
    let machine = MachineModel::preset("paper:4").unwrap();
    let provider = RooflineCost::new(&machine);
    let graph = dense_blocks(8);
    let recorded = Recorded::default();
    let model = CostModel::new(&graph, &machine, &provider).with_progress(&recorded);
    let tables = CostTables::build(&model);
    optcnn(&tables).unwrap();
    let seen = recorded.0.into_inner().unwrap();
    let phases: Vec<Phase> = seen.iter().map(|s| s.0).fold(Vec::new(), |mut phases, p| {
        if phases.last() != Some(&p) {
            phases.push(p);
        }
        phases
    });
    assert_eq!(phases[..2], [Phase::NodeCosts, Phase::Eliminations]);
    for (phase, done, total) in &seen {
        assert!(done <= total, "{phase}: {done} of {total}");
    }
    let layers = graph.layers().len() as u64;
    assert!(
        seen.iter()
            .filter(|s| s.0 == Phase::NodeCosts)
            .all(|s| s.2 == layers)
    );
}
