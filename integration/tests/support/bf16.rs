//! The bf16 reference the bf16 equivalence tests hold every strategy to (CPU and GPU devices),
//! and its tolerance, derived from bf16 rounding (see `bf16_equivalence.rs`).

use super::*;

/// Half an ulp of bf16, relative: what storing a value in bf16 can move it by.
const BF16_HALF_ULP: f32 = 1.0 / 512.0;

/// Per tensor, `trained − init`.
fn updates(trained: &ParamStore, init: &ParamStore) -> Vec<Vec<f32>> {
    trained
        .values
        .iter()
        .zip(&init.values)
        .map(|(t, i)| t.iter().zip(i).map(|(t, i)| t - i).collect())
        .collect()
}

/// `init` with every value scaled by a random factor within 1 ± `relative`.
fn perturbed(init: &ParamStore, relative: f32) -> ParamStore {
    let mut out = init.clone();
    let mut rng = legion_ops::rng::Rng::new(3);
    for v in &mut out.values {
        for x in v.iter_mut() {
            *x *= 1.0 + relative * ((rng.next_u64() % 2001) as f32 / 1000.0 - 1.0);
        }
    }
    out
}

/// The one-device trainer in bf16 on the CPU after `STEPS` steps from `ParamStore::init(graph,
/// 7)`, and how far any run may be from it.
pub struct Bf16Reference {
    pub graph: Graph,
    pub init: ParamStore,
    trained: ParamStore,
    /// Per tensor, the reference's update.
    want: Vec<Vec<f32>>,
    /// Per tensor, relative to the update.
    tolerance: Vec<f32>,
    losses: Vec<f32>,
    loss_tolerance: Vec<f32>,
}

impl Bf16Reference {
    /// Trains the reference, derives the tolerance, and checks that the tolerance tells a wrong
    /// gradient apart (the same steps on rotated labels must break it on some tensor).
    pub fn train(graph: &Graph) -> Bf16Reference {
        let bf16 = Precision::Bf16;
        let init = ParamStore::init(graph, 7);
        let (trained, losses) = reference_run_in(graph, &init, bf16, STEPS);
        let want = updates(&trained, &init);
        let moved_init = perturbed(&init, BF16_HALF_ULP);
        let (moved, moved_losses) = reference_run_in(graph, &moved_init, bf16, STEPS);
        let tolerance: Vec<f32> = updates(&moved, &moved_init)
            .iter()
            .zip(&want)
            .map(|(m, w)| TOLERANCE.max(ROUNDING_FACTOR * relative_error(m, w)))
            .collect();
        // Per run, not per step: a strategy's extra roundings of the weight gradients (each
        // device's bf16 gradient before the f32 sum) move the next step's loss, which perturbing
        // the initial weights moves least; the largest step's sensitivity bounds every step.
        let loss_sensitivity = moved_losses
            .iter()
            .zip(&losses)
            .map(|(m, w)| (m - w).abs() / w.abs())
            .fold(0f32, f32::max);
        let loss_tolerance = vec![TOLERANCE.max(ROUNDING_FACTOR * loss_sensitivity); losses.len()];
        let mut wrong = trainer_in(graph, &init, bf16);
        for step in 0..STEPS {
            let (images, labels) = batch(graph, step);
            let rotated: Vec<u32> = labels.iter().map(|l| (l + 1) % 10).collect();
            wrong.step(&images, &rotated).unwrap();
        }
        let wrong = updates(&wrong.params().unwrap(), &init);
        assert!(
            wrong
                .iter()
                .zip(&want)
                .zip(&tolerance)
                .any(|((u, w), t)| relative_error(u, w) > *t),
            "{}: the bf16 tolerance does not tell a wrong gradient apart",
            graph.name
        );
        Bf16Reference {
            graph: graph.clone(),
            init,
            trained,
            want,
            tolerance,
            losses,
            loss_tolerance,
        }
    }

    /// Every way strategy `name`'s run (its weights after `STEPS` steps and its losses) is
    /// further from the reference than the tolerance allows; empty if none.
    pub fn check(&self, name: &str, trained: &ParamStore, losses: &[f32]) -> Vec<String> {
        let graph = &self.graph.name;
        let mut failures = Vec::new();
        for (step, (&loss, (&want, &tolerance))) in losses
            .iter()
            .zip(self.losses.iter().zip(&self.loss_tolerance))
            .enumerate()
        {
            if (loss - want).abs() > tolerance * want.abs() {
                failures.push(format!(
                    "{graph}/{name} step {step}: loss {loss} vs {want} (relative tolerance \
                     {tolerance:e})"
                ));
            }
        }
        let got = updates(trained, &self.init);
        for (slot, p) in self.trained.params.iter().enumerate() {
            let err = relative_error(&got[slot], &self.want[slot]);
            if err > self.tolerance[slot] {
                failures.push(format!(
                    "{graph}/{name}: {}'s update differs by {err:e} (tolerance {:e}, \
                     {ROUNDING_FACTOR}× what bf16 rounding of the initial weights moves it by)",
                    p.name, self.tolerance[slot],
                ));
            }
        }
        failures
    }
}
