//! A small model (conv, batch norm, ReLU, pooling, add, concat, dropout, dense, softmax
//! cross-entropy) trains
//! three steps on the GPU as it does on the CPU: the reference trainer (`legion_ops::train`) is
//! generic over the backend, so both runs are the same driver over different devices. The GPU
//! runs as `legion-rs train` runs one device: each step staging the next batch on a copy stream
//! (`Trainer::step_ahead`), buffers ordered by the backend's own events (`Sharing::WithinStreams`),
//! and here the `precise` convolution algorithms; the `fastest` ones are held to a looser bound
//! against those. Steps after the first are recorded as a CUDA graph and replayed (the trainer's
//! default); a test holds replayed steps to the enqueued ones bit for bit. A bf16 run
//! (`Math::Bf16`, mixed precision) is held to the fp32 run within a bound derived from bf16's
//! rounding.

use legion_cuda::{ConvAlgos, ConvEpilogue, Cuda, Math, Settings, Sharing};
use legion_ops::Precision;
use legion_ops::capture::{CaptureSetting, CaptureStatus};
use legion_ops::data::{Synthetic, SyntheticBatch};
use legion_ops::op::{BatchNorm, Conv2d, Dense, Pool2d};
use legion_ops::require::{Need, skip};
use legion_ops::rng::Rng;
use legion_ops::shape::Shape;
use legion_ops::train::{
    BatchInput, LossReadback, ParamStore, Sgd, StepStats, Trainer, TrainingState,
};
use legion_ops::{Graph, GraphBuilder};

fn tiny_model(batch: usize) -> Graph {
    let mut m = GraphBuilder::new("tiny");
    let x = m.input("data", Shape::nchw(batch, 3, 12, 12)).unwrap();
    let c1 = m.conv2d("conv1", x, Conv2d::new(8, 3).padding(1)).unwrap();
    let b1 = m
        .batch_norm("bn1", c1, BatchNorm::default().relu())
        .unwrap();
    let p1 = m.pool2d("pool1", b1, Pool2d::max(2)).unwrap();
    let c2 = m
        .conv2d("conv2", p1, Conv2d::new(6, 3).stride(2).padding(1).relu())
        .unwrap();
    // a branch, summed and concatenated, so that every op the zoo uses runs here
    let c2b = m.conv2d("conv2b", p1, Conv2d::new(6, 1).stride(2)).unwrap();
    let sum = m.add("sum", c2, c2b).unwrap();
    let cat = m.concat("cat", &[c2, sum]).unwrap();
    let b2 = m.batch_norm("bn2", cat, BatchNorm::default()).unwrap();
    let r2 = m.relu("relu2", b2).unwrap();
    let p2 = m
        .pool2d("pool2", r2, Pool2d::avg(3).stride(1).padding(1))
        .unwrap();
    let f = m.flatten("flat", p2).unwrap();
    let h = m.dense("fc1", f, Dense::new(16).relu()).unwrap();
    let h = m.dropout("drop", h, 0.25).unwrap();
    let o = m.dense("fc2", h, Dense::new(5)).unwrap();
    m.softmax_cross_entropy("loss", o).unwrap();
    m.finish()
}

fn batches(graph: &Graph, steps: usize) -> Vec<(Vec<f32>, Vec<u32>)> {
    let mut rng = Rng::new(77);
    let pixels = graph.layer(graph.input()).shape.numel();
    (0..steps)
        .map(|_| {
            let images = (0..pixels).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let labels = (0..graph.batch()).map(|_| rng.below(5) as u32).collect();
            (images, labels)
        })
        .collect()
}

const SEED: u64 = 11;

/// Per-step statistics and the final state of a run.
struct Trained {
    stats: Vec<StepStats>,
    state: TrainingState,
}

/// Each step is given the next batch to stage, as a job gives it, except that step 0 is given
/// the last batch instead: step 1 must then drop that staged batch and stage its own.
fn train<B: legion_ops::backend::Pipeline>(
    mut trainer: Trainer<B>,
    data: &[(Vec<f32>, Vec<u32>)],
) -> Trained {
    let stats = (0..data.len())
        .map(|step| {
            let (images, labels) = &data[step];
            let next = match step {
                0 => data.last(),
                _ => data.get(step + 1),
            };
            let next = next.map(|(i, l)| (&i[..], &l[..]));
            trainer
                .step_ahead(images, labels, next)
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let state = trainer.state().unwrap_or_else(|e| panic!("{e}"));
    Trained { stats, state }
}

fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
    if scale > 0.0 { diff / scale } else { diff }
}

/// The starting weights, each moved by at most a few ulps (relative 1e-7).
fn perturbed_by_rounding(start: &TrainingState) -> TrainingState {
    let mut params = start.params.clone();
    let mut rng = Rng::new(3);
    for values in &mut params.values {
        for x in values.iter_mut() {
            *x *= 1.0 + 1e-7 * (rng.uniform(-1.0, 1.0));
        }
    }
    TrainingState::start(params)
}

/// A trainer on the GPU as `legion-rs train` runs one device (its own buffers ordered by the
/// backend's events), picking convolution algorithms by `conv_algos`; or why there is none.
fn gpu_trainer(
    conv_algos: ConvAlgos,
    graph: &Graph,
    start: TrainingState,
) -> Result<Trainer<Cuda>, String> {
    gpu_trainer_in(Math::StrictFp32, conv_algos, graph, start)
}

/// [`gpu_trainer`] computing in `math`.
fn gpu_trainer_in(
    math: Math,
    conv_algos: ConvAlgos,
    graph: &Graph,
    start: TrainingState,
) -> Result<Trainer<Cuda>, String> {
    gpu_trainer_with(
        Settings {
            math,
            conv_algos,
            sharing: Sharing::WithinStreams,
            ..Settings::default()
        },
        graph,
        start,
    )
}

/// [`gpu_trainer`] on a backend of `settings`.
fn gpu_trainer_with(
    settings: Settings,
    graph: &Graph,
    start: TrainingState,
) -> Result<Trainer<Cuda>, String> {
    let cuda = Cuda::with_settings(0, settings).map_err(|e| e.to_string())?;
    let stream = cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
    Ok(
        Trainer::resume_on(cuda, stream, graph.clone(), start, Sgd::default(), SEED)
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

#[test]
fn a_tiny_model_trains_three_steps_on_the_gpu_as_on_the_cpu() {
    let graph = tiny_model(4);
    let data = batches(&graph, 3);
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let on_gpu = match gpu_trainer(ConvAlgos::Precise, &graph, start.clone()) {
        Ok(trainer) => trainer,
        Err(reason) => {
            return skip(Need::Gpu, reason);
        }
    };
    let cpu = train(
        Trainer::resume(graph.clone(), start.clone(), Sgd::default(), SEED),
        &data,
    );
    // How far f32 rounding alone moves each tensor: the CPU run again from weights moved by a
    // few ulps. conv1's bias feeds batch norm, which removes its mean, so its gradient is a sum
    // that cancels to rounding noise: there only "within rounding" can be asked of another
    // summation order (the suite's rule, as in integration/tests/equivalence.rs).
    let rounded = train(
        Trainer::resume(
            graph.clone(),
            perturbed_by_rounding(&start),
            Sgd::default(),
            SEED,
        ),
        &data,
    );
    let gpu = train(on_gpu, &data);
    // Convolutions and GEMMs sum in another order than the CPU; three steps of SGD keep the
    // difference at rounding level: within relative 1e-4, or within ROUNDING_FACTOR times what
    // rounding alone moves the tensor by.
    const TOLERANCE: f64 = 1e-4;
    const ROUNDING_FACTOR: f64 = 10.0;
    let mut failures = Vec::new();
    for (step, (g, c)) in gpu.stats.iter().zip(&cpu.stats).enumerate() {
        let error = (g.loss as f64 - c.loss as f64).abs() / (c.loss as f64).abs().max(1e-12);
        if error > TOLERANCE || g.correct != c.correct {
            failures.push(format!(
                "step {step}: loss {} vs {}, correct {} vs {}",
                g.loss, c.loss, g.correct, c.correct
            ));
        }
    }
    let names = &cpu.state.params.params;
    let triples = [
        (
            "",
            &gpu.state.params.values,
            &cpu.state.params.values,
            &rounded.state.params.values,
        ),
        (
            "velocity of ",
            &gpu.state.momentum,
            &cpu.state.momentum,
            &rounded.state.momentum,
        ),
    ];
    for (what, gpu_values, cpu_values, rounded_values) in triples {
        for (slot, ((g, c), r)) in gpu_values
            .iter()
            .zip(cpu_values)
            .zip(rounded_values)
            .enumerate()
        {
            let error = relative_error(g, c);
            let allowed = TOLERANCE.max(ROUNDING_FACTOR * relative_error(r, c));
            if error > allowed {
                failures.push(format!(
                    "{what}{} ({slot}): relative error {error:.3e} (allowed {allowed:.3e})",
                    names[slot].name
                ));
            }
        }
    }
    println!("losses: GPU {:?}, CPU {:?}", gpu.stats, cpu.stats);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A step recorded as a CUDA graph and replayed trains exactly as its kernels enqueued one by one:
/// same losses, weights and momentum, bit for bit (the same kernels on the same data, dropout's
/// step read on the device), a traced step among the replays included.
#[test]
fn replayed_steps_train_exactly_as_enqueued_ones() {
    let graph = tiny_model(4);
    let data = batches(&graph, 6);
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let run = |setting: CaptureSetting| -> Result<(Trained, Vec<CaptureStatus>), String> {
        let mut trainer = gpu_trainer(ConvAlgos::Precise, &graph, start.clone())?;
        trainer.set_capture(setting);
        let mut statuses = Vec::new();
        let mut stats = Vec::new();
        for (step, (images, labels)) in data.iter().enumerate() {
            if step == 3 {
                trainer.trace_next_step();
            }
            let next = data.get(step + 1).map(|(i, l)| (&i[..], &l[..]));
            let stat = trainer.step_ahead(images, labels, next);
            stats.push(stat.unwrap_or_else(|e| panic!("step {step}: {e}")));
            statuses.push(trainer.capture_status());
        }
        let state = trainer.state().unwrap_or_else(|e| panic!("{e}"));
        Ok((Trained { stats, state }, statuses))
    };
    let (enqueued, statuses) = match run(CaptureSetting::Off) {
        Ok(run) => run,
        Err(reason) => return skip(Need::Gpu, reason),
    };
    assert!(statuses.iter().all(|s| *s == CaptureStatus::Off));
    let (replayed, statuses) = run(CaptureSetting::On).expect("a GPU was found above");
    for (step, status) in statuses.iter().enumerate() {
        let want = match step {
            0 => CaptureStatus::Warming,
            _ => CaptureStatus::Replaying,
        };
        assert_eq!(*status, want, "after step {step}");
    }
    let losses = |t: &Trained| -> Vec<(f32, usize)> {
        t.stats.iter().map(|s| (s.loss, s.correct)).collect()
    };
    assert_eq!(losses(&replayed), losses(&enqueued));
    assert_eq!(replayed.state, enqueued.state, "weights, momentum and step");
}

/// Convolutions wide enough for cuDNN's FFT and Winograd algorithms to compete.
/// Synthetic batches drawn by the GPU from their description (`Pipeline::stage_synthetic`, as
/// `train` on one GPU does) train bit for bit as the same batches drawn on the host and copied,
/// staged ahead, recorded and replayed.
#[test]
fn synthetic_batches_drawn_on_the_gpu_train_as_those_drawn_on_the_host() {
    let graph = tiny_model(4);
    let data = Synthetic::new(SEED, 40, 5, [3, 12, 12]).unwrap();
    let described: Vec<SyntheticBatch> = (0..5)
        .map(|k| {
            data.describe_batch(&[k, 9 + k, 20 + 3 * k, 39 - k])
                .unwrap()
        })
        .collect();
    let drawn: Vec<Vec<f32>> = described
        .iter()
        .map(|d| {
            let mut images = vec![0.0; d.len() * d.sample_len()];
            d.render(&mut images);
            images
        })
        .collect();
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let run = |on_device: bool| -> Result<Trained, String> {
        let mut trainer = gpu_trainer(ConvAlgos::Precise, &graph, start.clone())?;
        let mut stats = Vec::new();
        for step in 0..described.len() {
            let input = |k: usize| match on_device {
                true => BatchInput::Synthetic(&described[k]),
                false => BatchInput::Images {
                    images: &drawn[k],
                    labels: &described[k].labels,
                },
            };
            let next = (step + 1 < described.len()).then(|| input(step + 1));
            let read = trainer.step_batch(input(step), next);
            let read = read.unwrap_or_else(|e| panic!("step {step}: {e}"));
            stats.extend(read.map(|r| r.stats));
        }
        let last = trainer.finish().unwrap_or_else(|e| panic!("{e}"));
        stats.extend(last.map(|r| r.stats));
        let state = trainer.state().unwrap_or_else(|e| panic!("{e}"));
        Ok(Trained { stats, state })
    };
    let on_host = match run(false) {
        Ok(run) => run,
        Err(reason) => return skip(Need::Gpu, reason),
    };
    let on_device = run(true).expect("a GPU was found above");
    let losses = |t: &Trained| -> Vec<(f32, usize)> {
        t.stats.iter().map(|s| (s.loss, s.correct)).collect()
    };
    assert_eq!(losses(&on_device), losses(&on_host));
    assert_eq!(on_device.state, on_host.state, "weights, momentum and step");
}

/// Each step read back (its number, loss and correct count), and the states read mid-run and
/// at the end.
type ReadRun = (Vec<(u64, f32, usize)>, Vec<TrainingState>);

/// A step's loss read one step late (the trainer's default: the step returns once enqueued, and
/// its loss is read after the next step is enqueued, waiting on a marker behind it alone) is the
/// loss read at the step's end, and the run trains the same weights, bit for bit: over replayed
/// steps, batches drawn on the device and staged ahead, a traced step, a checkpoint read between
/// steps with a step in flight, and the last step's loss read by `finish`.
#[test]
fn losses_read_one_step_late_are_those_read_at_each_steps_end() {
    let graph = tiny_model(4);
    let data = Synthetic::new(SEED, 40, 5, [3, 12, 12]).unwrap();
    let described: Vec<SyntheticBatch> = (0..6)
        .map(|k| {
            data.describe_batch(&[k, 7 + k, 19 + 2 * k, 39 - k])
                .unwrap()
        })
        .collect();
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let run = |readback: LossReadback| -> Result<ReadRun, String> {
        let mut trainer = gpu_trainer(ConvAlgos::Precise, &graph, start.clone())?;
        trainer.set_loss_readback(readback);
        let (mut read, mut states) = (Vec::new(), Vec::new());
        for step in 0..described.len() {
            if step == 4 {
                trainer.trace_next_step();
            }
            let next = described.get(step + 1).map(BatchInput::Synthetic);
            let this = BatchInput::Synthetic(&described[step]);
            let back = trainer.step_batch(this, next);
            let back = back.unwrap_or_else(|e| panic!("step {step}: {e}"));
            read.extend(back.map(|r| (r.step, r.stats.loss, r.stats.correct)));
            if step == 2 {
                // A checkpoint between steps: every step enqueued is in the state.
                states.push(trainer.state().unwrap_or_else(|e| panic!("{e}")));
            }
        }
        let last = trainer.finish().unwrap_or_else(|e| panic!("{e}"));
        read.extend(last.map(|r| (r.step, r.stats.loss, r.stats.correct)));
        assert!(trainer.take_trace().is_some(), "the traced step's timeline");
        assert_eq!(trainer.capture_status(), CaptureStatus::Replaying);
        states.push(trainer.state().unwrap_or_else(|e| panic!("{e}")));
        Ok((read, states))
    };
    let at_end = match run(LossReadback::EveryStep) {
        Ok(run) => run,
        Err(reason) => return skip(Need::Gpu, reason),
    };
    let late = run(LossReadback::OneStepLate).expect("a GPU was found above");
    let steps: Vec<u64> = late.0.iter().map(|r| r.0).collect();
    assert_eq!(
        steps,
        (1..=6).collect::<Vec<u64>>(),
        "each step read once, in order"
    );
    assert_eq!(late.0, at_end.0, "losses and correct counts");
    assert_eq!(
        late.1, at_end.1,
        "weights, momentum and step, mid-run and at the end"
    );
}

fn wide_model(batch: usize) -> Graph {
    let mut m = GraphBuilder::new("wide");
    let x = m.input("data", Shape::nchw(batch, 16, 32, 32)).unwrap();
    let c1 = m
        .conv2d("conv1", x, Conv2d::new(64, 3).padding(1).relu())
        .unwrap();
    let c2 = m
        .conv2d("conv2", c1, Conv2d::new(64, 3).padding(1).relu())
        .unwrap();
    let c3 = m
        .conv2d("conv3", c2, Conv2d::new(64, 5).padding(2).relu())
        .unwrap();
    let p = m.pool2d("pool", c3, Pool2d::max(4)).unwrap();
    let f = m.flatten("flat", p).unwrap();
    let o = m.dense("fc", f, Dense::new(5)).unwrap();
    m.softmax_cross_entropy("loss", o).unwrap();
    m.finish()
}

/// `fastest` may pick FFT, Winograd or atomic-sum algorithms, which round differently from a
/// direct sum in fixed order: three steps with them stay within relative 1e-3 of the `precise`
/// run (measured on the lent H200: 2.2e-7 here, 1.1e-4 on LeNet-5), so a fast algorithm that
/// computes something else is still caught.
#[test]
fn the_fastest_convolution_algorithms_stay_within_a_bound_of_the_precise_ones() {
    let precise = Settings {
        conv_algos: ConvAlgos::Precise,
        sharing: Sharing::WithinStreams,
        ..Settings::default()
    };
    let fastest = Settings {
        conv_algos: ConvAlgos::Fastest,
        ..precise
    };
    wide_model_trains_alike(("precise", precise), ("fastest", fastest), 1e-3);
}

/// cuDNN's fused convolution (bias and ReLU inside it, the default) against the separate kernel,
/// both with the `precise` algorithms, three steps of a model whose convolutions all have a bias
/// and a ReLU: within the equivalence tests' 1e-4. The fused epilogue adds the bias to the
/// unrounded sum, so the two differ by the last bit of an output at most; a fused call that
/// dropped the bias or the ReLU, or wrote the wrong channels, is off by far more.
#[test]
fn the_fused_bias_and_relu_train_as_the_separate_kernel_does() {
    let separate = Settings {
        conv_algos: ConvAlgos::Precise,
        conv_epilogue: ConvEpilogue::Separate,
        sharing: Sharing::WithinStreams,
        ..Settings::default()
    };
    let fused = Settings {
        conv_epilogue: ConvEpilogue::Fused,
        ..separate
    };
    if wide_model_trains_alike(("separate", separate), ("fused", fused), 1e-4) {
        // ... and fused they were: a refused problem would run the separate kernel and pass.
        let (launched, refused) = legion_cuda::fused_epilogue_counts();
        println!("fused convolutions launched: {launched}, problems refused: {refused}");
        assert!(
            launched > 0 && refused == 0,
            "{launched} launched, {refused} refused"
        );
    }
}

/// Three steps of [`wide_model`] from one start on a GPU backend of each of two settings: every
/// parameter within relative `bound` of the other run's (each printed). Without a GPU it skips,
/// saying why, and returns false.
fn wide_model_trains_alike(a: (&str, Settings), b: (&str, Settings), bound: f64) -> bool {
    let graph = wide_model(16);
    let data = batches(&graph, 3);
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let mut runs = Vec::new();
    for settings in [a.1, b.1] {
        match gpu_trainer_with(settings, &graph, start.clone()) {
            Ok(trainer) => runs.push(train(trainer, &data)),
            Err(reason) => {
                skip(Need::Gpu, reason);
                return false;
            }
        }
    }
    let (first, second) = (&runs[0].state.params, &runs[1].state.params);
    let mut failures = Vec::new();
    for (slot, (y, x)) in second.values.iter().zip(&first.values).enumerate() {
        let error = relative_error(y, x);
        let name = &first.params[slot].name;
        println!("{name}: {} vs {} {error:.3e}", b.0, a.0);
        if error > bound {
            failures.push(format!(
                "{name}: relative error {error:.3e} (bound {bound:e})"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    true
}

/// Layers on the longest path from the input to the loss: how many stored roundings a value at
/// the end of the forward pass (or a gradient at the end of the backward pass) has been through.
fn depth(graph: &Graph) -> usize {
    let mut depth = vec![0usize; graph.layers().len()];
    for id in graph.ids() {
        let layer = graph.layer(id);
        depth[id.0] = 1 + layer.inputs.iter().map(|i| depth[i.0]).max().unwrap_or(0);
    }
    depth.into_iter().max().unwrap_or(0)
}

/// The bound a bf16 run is held to against the fp32 run from the same start. Every value
/// stored in bf16 is off by at most 2^-8 of itself (round to nearest: half an ulp of 8
/// significant bits, `BF16_RELATIVE_ROUNDING`); the products read bf16 operands but accumulate in
/// fp32, so they add no rounding of their own beyond the stored one. A weight's gradient is made
/// from activations stored once per layer on the way forward, gradients stored once per layer on
/// the way back, and the weight's working copy: at most 2·depth + 1 roundings, whose relative
/// errors add to first order. An update is a sum of such gradients (and the momentum a sum of
/// updates), so its relative error is bounded by theirs. Losses are computed from the bf16
/// logits: within depth roundings. A bf16 kernel that reads the wrong elements, a wrong layout
/// or a cast that does not round to bf16 is off by far more (order 1).
fn bf16_tolerance(graph: &Graph) -> f64 {
    let roundings = 2 * depth(graph) + 1;
    roundings as f64 * f64::from(legion_ops::precision::BF16_RELATIVE_ROUNDING)
}

/// Every tensor's change over the run: final − start, slot by slot.
fn changes(end: &[Vec<f32>], start: &[Vec<f32>]) -> Vec<Vec<f32>> {
    end.iter()
        .zip(start)
        .map(|(e, s)| e.iter().zip(s).map(|(a, b)| a - b).collect())
        .collect()
}

/// Three steps in bf16 (mixed precision) against the same three in fp32 on the GPU, both with the
/// `precise` algorithms: losses, the change of every weight and buffer (what training did: the
/// weights themselves barely move in three steps, so comparing them would prove nothing) and
/// the momentum within [`bf16_tolerance`]; and the checkpointed weights are fp32 masters that
/// kept the small updates bf16 could not hold.
#[test]
fn a_tiny_model_trains_in_bf16_as_in_fp32_within_bf16_rounding() {
    let graph = tiny_model(4);
    let data = batches(&graph, 3);
    let start = TrainingState::start(ParamStore::init(&graph, SEED));
    let fp32 = match gpu_trainer_in(Math::StrictFp32, ConvAlgos::Precise, &graph, start.clone()) {
        Ok(trainer) => train(trainer, &data),
        Err(reason) => return skip(Need::Gpu, reason),
    };
    let bf16 = match gpu_trainer_in(Math::Bf16, ConvAlgos::Precise, &graph, start.clone()) {
        Ok(trainer) => trainer,
        // a GPU before Ampere: refused at start, as the CLI refuses it
        Err(reason) if reason.contains("needs 8.0") => return skip(Need::Gpu, reason),
        Err(reason) => panic!("{reason}"),
    };
    let bf16 = train(bf16, &data);
    let tolerance = bf16_tolerance(&graph);
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for (step, (b, f)) in bf16.stats.iter().zip(&fp32.stats).enumerate() {
        let error = (b.loss as f64 - f.loss as f64).abs() / (f.loss as f64).abs().max(1e-12);
        worst = worst.max(error);
        if error > tolerance {
            failures.push(format!("step {step}: loss {} vs {}", b.loss, f.loss));
        }
    }
    let names = &fp32.state.params.params;
    let bf16_moves = changes(&bf16.state.params.values, &start.params.values);
    let fp32_moves = changes(&fp32.state.params.values, &start.params.values);
    let mut moved = 0;
    for (what, b_all, f_all) in [
        ("change of ", &bf16_moves, &fp32_moves),
        ("velocity of ", &bf16.state.momentum, &fp32.state.momentum),
    ] {
        for (slot, (b, f)) in b_all.iter().zip(f_all).enumerate() {
            if f.iter().all(|v| *v == 0.0) {
                continue;
            }
            moved += 1;
            let error = relative_error(b, f);
            worst = worst.max(error);
            println!("bf16 vs fp32, {what}{}: {error:.3e}", names[slot].name);
            if error > tolerance {
                failures.push(format!(
                    "{what}{} ({slot}): relative error {error:.3e} (bound {tolerance:.3e})",
                    names[slot].name
                ));
            }
        }
    }
    assert!(
        moved > 0,
        "nothing trained: the comparison would prove nothing"
    );
    // The masters keep what bf16 would round away: some weight that the products read through a
    // bf16 working copy (conv2d and dense) differs from every bf16 value.
    let fp32_only = (bf16.state.params.params.iter())
        .zip(&bf16.state.params.values)
        .filter(|(p, _)| Precision::Bf16.working_copy(&graph.layer(p.layer).op, p.index))
        .flat_map(|(_, values)| values)
        .any(|&w| legion_ops::precision::round_bf16(w) != w);
    assert!(
        fp32_only,
        "the checkpointed weights look rounded to bf16, not fp32 masters"
    );
    println!(
        "bf16 against fp32 over {} steps: worst relative error {worst:.3e}, bound {tolerance:.3e} \
         (depth {}); losses bf16 {:?}, fp32 {:?}",
        data.len(),
        depth(&graph),
        bf16.stats.iter().map(|s| s.loss).collect::<Vec<_>>(),
        fp32.stats.iter().map(|s| s.loss).collect::<Vec<_>>()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_bf16_bound_counts_the_roundings_on_the_longest_path() {
    // input → conv → flatten → loss: four layers, 2·4 + 1 roundings of 2^-8
    let mut m = GraphBuilder::new("line");
    let x = m.input("data", Shape::nchw(2, 1, 4, 4)).unwrap();
    let c = m.conv2d("conv", x, Conv2d::new(2, 4)).unwrap();
    let f = m.flatten("flat", c).unwrap();
    m.softmax_cross_entropy("loss", f).unwrap();
    let line = m.finish();
    assert_eq!(depth(&line), 4);
    assert_eq!(bf16_tolerance(&line), 9.0 / 256.0);
    // the tiny model's branch is counted along its longer arm
    assert!(depth(&tiny_model(4)) >= 15);
}
