//! The cost tables the searches read agree with Eq. 1 computed straight from the geometry, in the
//! paper's space and in the larger one with reduction splits.

mod common;

use common::{FAMILIES, random_graph};
use legion_ops::Precision;
use legion_ops::rng::Rng;
use legion_planner::machine::{IntraTopology, NodeSpec};
use legion_planner::{
    CostModel, CostTables, DeviceSpec, Link, MachineModel, RooflineCost, SearchSpace,
};

fn machines() -> Vec<MachineModel> {
    vec![
        // one shared NIC per node
        MachineModel::preset("paper:8").unwrap(),
        MachineModel::preset("paper-pairs:8").unwrap(),
        // switch ports inside a node, a NIC per GPU across
        MachineModel::preset("dgx-h100:16").unwrap(),
        // a host bridge inside, two NICs per node of 3 (uneven)
        MachineModel::from_flags(2, 3, None, None)
            .unwrap()
            .with_intra_topology(IntraTopology::Bridge)
            .with_nics(2)
            .unwrap(),
        MachineModel::preset("paper:4").unwrap(),
        MachineModel::from_flags(4, 2, Some(50.0), Some(10.0)).unwrap(),
        MachineModel::from_flags(1, 8, None, None).unwrap(),
        // bf16: 2-byte activations in both kinds of t_x tables (factorized, shared lanes)
        MachineModel::from_flags(4, 2, Some(50.0), Some(10.0))
            .unwrap()
            .with_precision(Precision::Bf16),
        MachineModel::preset("paper:8")
            .unwrap()
            .with_precision(Precision::Bf16),
        // irregular: nodes of 3, and an override
        MachineModel::from_flags(2, 3, None, None).unwrap(),
        MachineModel::preset("paper:8")
            .unwrap()
            .with_link(1, 6, Link::from_gbit_per_s(7.0, 3.0))
            .unwrap(),
        // an override inside a node, and two device kinds: more classes of alike device blocks
        MachineModel::preset("paper:8")
            .unwrap()
            .with_link(4, 5, Link::from_gbit_per_s(7.0, 3.0))
            .unwrap(),
        MachineModel::new(
            "two-kinds",
            &[
                NodeSpec {
                    devices: 4,
                    device: DeviceSpec::p100(),
                },
                NodeSpec {
                    devices: 4,
                    device: DeviceSpec::local_cpu(),
                },
            ],
            Link::from_gbit_per_s(160.0, 5.0),
            Link::from_gbit_per_s(100.0, 10.0),
        )
        .unwrap(),
    ]
}

#[test]
fn tables_match_direct_evaluation() {
    let mut rng = Rng::new(11);
    let mut reduction_configs = 0;
    for machine in machines() {
        let provider = RooflineCost::new(&machine);
        for (f, family) in FAMILIES.iter().enumerate() {
            for seed in 0..3 {
                let g = random_graph(*family, seed * 10 + f as u64, 5);
                let model = CostModel::new(&g, &machine, &provider);
                let space = match seed {
                    0 => SearchSpace::Paper,
                    _ => SearchSpace::WithReductions,
                };
                let tables = CostTables::build_in(&model, space);
                for id in g.ids() {
                    let space = tables.space(id);
                    for (i, c) in space.configs().iter().enumerate() {
                        reduction_configs += usize::from(c.reduction() > 1);
                        assert_eq!(tables.compute(id)[i], model.compute_time(id, c), "{c}");
                        assert_eq!(tables.sync(id)[i], model.sync_time(id, c), "{c}");
                        let node = model.compute_time(id, c)
                            + model.sync_time(id, c)
                            + model.reduce_time(id, c);
                        assert_eq!(tables.node_cost(id)[i], node, "{c}");
                    }
                }
                for (e, edge) in model.edges().iter().enumerate() {
                    let table = tables.edge_table(e);
                    // edges of one class share the table the searches compute for the first
                    let class = tables.edge_class(e);
                    if class != e {
                        assert_eq!(tables.edge_table(class), table, "class of edge {e}");
                    }
                    let (src, dst) = (tables.space(edge.src), tables.space(edge.dst));
                    assert_eq!(table.len(), src.len() * dst.len());
                    for _ in 0..200 {
                        let (i, j) = (rng.below(src.len()), rng.below(dst.len()));
                        let direct = model.transfer_time(edge, &src.config(i), &dst.config(j));
                        let fast = table[i * dst.len() + j];
                        assert!(
                            (fast - direct).abs() <= 1e-12 * direct.max(1e-9),
                            "{} on {}: edge {}→{} configs {} @{} → {} @{}: table {fast} direct {direct}",
                            g.name,
                            machine.name(),
                            g.layer(edge.src).name,
                            g.layer(edge.dst).name,
                            src.config(i),
                            src.config(i).first_device(),
                            dst.config(j),
                            dst.config(j).first_device(),
                        );
                    }
                }
            }
        }
    }
    assert!(
        reduction_configs > 1000,
        "{reduction_configs} configs split a reduction"
    );
}
