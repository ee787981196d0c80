//! The overhead probe's empty tasks run to completion through real device actors on both paths
//! (inline on the actor, and through the compute pool), independent or chained.

use legion_ops::train::Sgd;
use legion_ops::{LayerId, zoo};
use legion_runtime::StepInput;
use legion_runtime::program::{EmptyDispatch, EmptyShape, Part, empty_program};
use std::sync::Arc;

#[test]
fn empty_programs_finish_every_step() {
    let z = zoo::find("lenet5").unwrap();
    let graph = Arc::new(z.build(&z.default_config(1)).unwrap());
    let runtime = legion_runtime::device_runtime();
    for dispatch in [EmptyDispatch::Inline, EmptyDispatch::Pool] {
        for shape in [EmptyShape::Independent, EmptyShape::Chain] {
            let programs: Vec<_> = (0..2)
                .map(|d| Arc::new(empty_program(d, 500, shape, dispatch, LayerId(0))))
                .collect();
            assert_eq!(
                programs[0].ops.iter().all(|o| o.touches_no_data()),
                dispatch == EmptyDispatch::Inline
            );
            let actors = runtime.block_on(async {
                legion_runtime::spawn_devices(&programs, &graph, 0, Sgd::default())
            });
            for step in 0..3 {
                let input = Arc::new(StepInput::whole(step, Vec::new(), Vec::new(), 0));
                let reports = runtime
                    .block_on(legion_runtime::run_step(
                        &actors,
                        Part::Step,
                        step,
                        input,
                        true,
                    ))
                    .unwrap();
                for r in &reports {
                    assert_eq!(r.error, None);
                    // Traced: one event per task, each task once.
                    let mut ops: Vec<u32> = r.events.iter().map(|e| e.op).collect();
                    ops.sort_unstable();
                    assert_eq!(ops, (0..500).collect::<Vec<_>>());
                }
            }
            for a in &actors {
                a.kill();
            }
        }
    }
}
