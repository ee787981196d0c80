//! Plans priced by what this machine measures: a run on several devices times the tiles its
//! search may choose before searching, keeps them in the cost cache, and a second run of the same
//! model measures nothing new; a cache file that cannot be read is named, ignored and rewritten;
//! a resumed run trains on with its checkpoint's plan unless asked to plan again.

use legion::costs::{CacheKey, CostCache, CostReport, Costs};
use legion::job::{JobEvent, Training};
use legion::ops::checkpoint;
use legion::{DeviceKind, Precision, SearchKind, TrainSummary, load_model};
use std::path::Path;

const DEVICES: usize = 2;

fn training(cache: &Path) -> Training {
    let graph = load_model("lenet5", 8, None, None).unwrap();
    Training::new(graph)
        .device(DeviceKind::Cpu)
        .devices(DEVICES)
        .steps(6)
        .cost_cache(cache)
}

/// The run's summary, its cost report and its warnings.
fn run(training: Training) -> (TrainSummary, CostReport, Vec<String>) {
    let mut warnings = Vec::new();
    let summary = training
        .run(|event| {
            if let JobEvent::Warning(w) = event {
                warnings.push(w.to_string());
            }
        })
        .unwrap();
    let costs = summary.plan.as_ref().unwrap().costs.clone().unwrap();
    (summary, costs, warnings)
}

#[test]
fn a_second_run_measures_nothing_new_and_a_corrupt_cache_is_named_and_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let (summary, first, warnings) = run(training(dir.path()));
    assert!(warnings.is_empty(), "{warnings:?}");
    let measuring = first.measuring.as_ref().unwrap();
    assert!(
        measuring.new_tiles > 0 && measuring.strategies_run > 0,
        "{first}"
    );
    let (measured, _, roofline) = first.priced.unwrap();
    assert!(measured > 0 && roofline == 0, "{first}");
    assert!(first.roofline_because.is_none(), "{first}");
    let file = CostCache::at(dir.path()).path(&CacheKey::cpu_devices(DEVICES, Precision::Fp32));
    assert_eq!(measuring.cache, file);
    // The training steps refreshed what they timed.
    let (tiles, added_to) = summary.costs_added.unwrap();
    assert!(tiles > 0);
    assert_eq!(added_to, file);

    let (_, second, _) = run(training(dir.path()));
    let again = second.measuring.as_ref().unwrap();
    assert_eq!((again.new_tiles, again.strategies_run), (0, 0), "{second}");
    assert!(second.to_string().contains("every tile from"), "{second}");
    assert_eq!(second.priced.unwrap().2, 0, "{second}");

    std::fs::write(&file, "{\"version\": 1, \"entries\": [{\"op\"").unwrap();
    let (_, third, warnings) = run(training(dir.path()));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(&file.display().to_string())
            && warnings[0].contains("not used, and this run rewrites it"),
        "{}",
        warnings[0]
    );
    assert_eq!(
        third.measuring.as_ref().unwrap().new_tiles,
        measuring.new_tiles,
        "measured afresh"
    );
    let read = CostCache::at(dir.path()).read(&CacheKey::cpu_devices(DEVICES, Precision::Fp32));
    assert!(read.refused.is_none() && !read.db.entries.is_empty());
}

#[test]
fn the_roofline_and_a_profile_file_are_said_and_measure_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_, roofline, _) = run(training(dir.path()).costs(Costs::Roofline));
    assert!(roofline.measuring.is_none() && roofline.priced.is_none());
    assert_eq!(
        roofline.to_string(),
        "costs: roofline; roofline because --costs roofline"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // A profile file prices the search as it is; the cache is neither read nor written.
    run(training(dir.path()));
    let key = CacheKey::cpu_devices(DEVICES, Precision::Fp32);
    let profile = dir.path().join("given.json");
    std::fs::copy(CostCache::at(dir.path()).path(&key), &profile).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let (summary, given, _) =
        run(training(elsewhere.path()).costs(Costs::Profile(profile.clone())));
    assert!(given.measuring.is_none(), "{given}");
    assert_eq!(given.choice, profile.display().to_string());
    assert!(given.priced.unwrap().0 > 0, "{given}");
    assert!(summary.costs_added.is_none());
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}

#[test]
fn a_resumed_run_trains_on_with_its_checkpoints_plan_unless_asked_to_replan() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("run.safetensors");
    let (first, _, _) = run(training(dir.path())
        .strategy(SearchKind::Model)
        .steps(3)
        .save(&saved));
    let model_plan = first.plan.unwrap().strategy;
    let metadata = checkpoint::load_metadata(&saved).unwrap();
    assert_eq!(metadata.get("strategy"), Some(&model_plan.to_json()));

    // Resumed under the default search: the checkpoint's model parallelism, no search, no cost.
    let summary = training(dir.path())
        .resume(&saved)
        .steps(5)
        .run(|_| {})
        .unwrap();
    let resumed = summary.plan.unwrap();
    assert_eq!(resumed.strategy, model_plan);
    assert!(resumed.costs.is_none(), "no search ran");

    // Asked to plan again: the search's own strategy, priced as the run says.
    let replanned = training(dir.path())
        .resume(&saved)
        .replan()
        .steps(5)
        .costs(Costs::Roofline)
        .run(|_| {})
        .unwrap()
        .plan
        .unwrap();
    let searched = training(dir.path())
        .costs(Costs::Roofline)
        .steps(1)
        .run(|_| {})
        .unwrap()
        .plan
        .unwrap();
    assert_eq!(replanned.strategy, searched.strategy);
    assert_ne!(replanned.strategy, model_plan);

    // Resumed on other devices, the checkpoint's plan does not fit: the error says what to do.
    let err = training(dir.path())
        .devices(3)
        .resume(&saved)
        .steps(5)
        .run(|_| {})
        .unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.contains("its run trained on 2 devices, this one has 3: give --replan"),
        "{err}"
    );
}

/// The largest difference of any tensor of `a` from `b`'s, relative to that tensor's largest
/// magnitude in `b`.
fn max_rel_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (checkpoint::load(a).unwrap(), checkpoint::load(b).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len());
    a.tensors
        .iter()
        .zip(&b.tensors)
        .map(|(x, y)| {
            let scale = y.data.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
            x.data
                .iter()
                .zip(&y.data)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()))
                / scale
        })
        .fold(0f32, f32::max)
}

#[test]
fn a_verified_run_keeps_the_fastest_candidate_and_trains_what_one_device_trains() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let steps = 18;
    let (summary, _, _) = run(training(dir.path())
        .devices(4)
        .steps(steps)
        .verify(3)
        .save(at("verified.safetensors")));
    let plan = summary.plan.unwrap();
    let v = plan
        .verification
        .clone()
        .expect("18 steps have room for the trials");
    assert!(v.candidates.len() >= 3, "{v}");
    assert_eq!(v.candidates[0].label, "optcnn");
    let labels: Vec<&str> = v.candidates.iter().map(|c| c.label.as_str()).collect();
    assert!(labels.contains(&"data") && labels.contains(&"owt"), "{v}");
    for c in &v.candidates {
        assert!(c.measured_ms > 0.0 && c.simulated_ms > 0.0, "{v}");
    }
    let fastest = (0..v.candidates.len())
        .min_by(|&a, &b| {
            v.candidates[a]
                .measured_ms
                .total_cmp(&v.candidates[b].measured_ms)
        })
        .unwrap();
    assert_eq!(v.kept, fastest, "{v}");
    let text = v.to_string();
    assert!(text.starts_with("verified on the devices"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.ends_with("  kept")).count(),
        1,
        "{text}"
    );
    // The plan the run reports and saves is the one it kept.
    let metadata = checkpoint::load_metadata(&at("verified.safetensors")).unwrap();
    assert_eq!(metadata["strategy"], plan.strategy.to_json());
    assert_eq!(summary.losses.len(), steps as usize);

    // The run switched strategy at least twice; it trained what one device trains, and what
    // the search's strategy trains alone.
    training(dir.path())
        .devices(1)
        .steps(steps)
        .save(at("one.safetensors"))
        .run(|_| {})
        .unwrap();
    training(dir.path())
        .devices(4)
        .steps(steps)
        .verify(0)
        .save(at("unverified.safetensors"))
        .run(|_| {})
        .unwrap();
    for other in ["one.safetensors", "unverified.safetensors"] {
        let diff = max_rel_diff(&at("verified.safetensors"), &at(other));
        assert!(diff <= 1e-4, "verified against {other}: {diff:e}");
    }
}

#[test]
fn a_run_too_short_for_its_trials_trains_the_search_strategy() {
    let dir = tempfile::tempdir().unwrap();
    // Priced by the roofline: a measured run's own steps refresh the costs the next one prices.
    let summary = training(dir.path())
        .devices(4)
        .steps(4)
        .costs(Costs::Roofline)
        .run(|_| {})
        .unwrap();
    let plan = summary.plan.unwrap();
    assert!(plan.verification.is_none());
    let searched = training(dir.path())
        .devices(4)
        .steps(1)
        .verify(0)
        .costs(Costs::Roofline)
        .run(|_| {})
        .unwrap()
        .plan
        .unwrap();
    assert_eq!(plan.strategy, searched.strategy);
}
