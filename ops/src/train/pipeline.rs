//! What a device adds around a step: the next batch staged while a step computes (checked to be
//! the batch its step is given), the loss read one step late, the step recorded once and
//! replayed.

use super::*;

/// A step enqueued whose stats are not read yet: its loss report (sent home), a marker behind
/// its work, and what the host measured of it so far.
pub(super) struct InFlight<B: Pipeline> {
    /// Counted from 1.
    pub(super) step: u64,
    pub(super) loss: Option<(B::Loss, usize)>,
    pub(super) end: B::Marker,
    pub(super) enqueue: f64,
    pub(super) stage: f64,
    /// A traced step's markers, timed once it has run.
    pub(super) spans: Option<Vec<MarkedSpan<B::Marker>>>,
}

/// A batch staged for a later step, with what identifies it: its labels, its length and a
/// sample of its values. Comparing all of a step's images (77 MB for AlexNet at 224) would cost
/// the step milliseconds, so the check is a sample: it tells a job's next batch from another
/// batch, and a caller that stages a batch with `next` must not change it before its step.
pub(super) struct Ahead<S> {
    pub(super) staged: S,
    pub(super) labels: Vec<u32>,
    pub(super) identity: BatchIdentity,
}

/// What tells a staged batch from another with the same labels.
// One or two per step, never moved in bulk: the size of the images' probe is no concern.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq)]
pub(super) enum BatchIdentity {
    /// Host images: their length and a sample of their values.
    Images { len: usize, probe: [u32; PROBES] },
    /// Synthetic samples: each one's noise state, a hash of the dataset's seed and the sample.
    Synthetic { noise_states: Vec<u64> },
}

/// Image values sampled from a staged batch, evenly spread over it.
pub(super) const PROBES: usize = 64;

/// The bits of [`PROBES`] image values spread evenly over a batch (the first and the last
/// included).
pub(super) fn probe_of(images: &[f32]) -> [u32; PROBES] {
    let n = images.len();
    std::array::from_fn(|k| match n {
        0 => 0,
        _ => images[k * (n - 1) / (PROBES - 1)].to_bits(),
    })
}

impl<S> Ahead<S> {
    pub(super) fn is_of(&self, batch: &BatchInput<'_>) -> bool {
        self.labels == batch.labels() && self.identity == batch.identity()
    }
}

impl<B: Pipeline> Trainer<B> {
    /// [`Trainer::step_ahead`] for batches held either way (synthetic batches described for the
    /// device to draw, as well as host images), returning once the step is enqueued, with the
    /// stats read back meanwhile: read every step, this step's; read one step late (the
    /// default), the previous step's, or none after a [`Trainer::finish`] (or at the first
    /// step). Steps are read in order, each once; a step that fails to enqueue leaves the one in
    /// flight to read. A failure of the device's work is reported by the read that waits for it
    /// or a later one.
    pub fn step_batch(
        &mut self,
        batch: BatchInput<'_>,
        next: Option<BatchInput<'_>>,
    ) -> Result<Option<Readout>, KernelError> {
        let labels = batch.labels();
        check_labels(&self.graph, labels)?;
        let started = std::time::Instant::now();
        let expected = self.graph.layer(self.graph.input()).shape.numel();
        assert_eq!(
            batch.images_len(),
            expected,
            "batch images do not match the input shape"
        );
        let images = batch.host_images();
        let traced = std::mem::take(&mut self.trace_next);
        let run = self.capture.plan(traced);
        let (b, stream) = (&self.backend, &mut self.stream);
        let pass = Pass::new(
            &self.graph,
            &self.params,
            &self.first,
            self.sgd,
            images,
            labels,
            self.seed,
            self.step,
        )
        .traced(traced);
        let before = pass.mark(b, stream)?;
        let staged = match (self.ahead.take(), batch) {
            (Some(ahead), _) if ahead.is_of(&batch) => ahead.staged,
            (_, BatchInput::Images { images, labels }) => b.stage_batch(stream, images, labels)?,
            (_, BatchInput::Synthetic(synthetic)) => b.stage_synthetic(stream, synthetic)?,
        };
        let taken = b.take_staged(stream, staged)?;
        pass.record(b, stream, before, || "data.wait".into(), "copy")?;
        // A step recorded or replayed reads its images where the recording does: they move there
        // (a device copy), and the staged buffer goes back at once.
        let mut staged_images = None;
        let mut fresh_fixed = None;
        if run == StepRun::Enqueued {
            staged_images = Some(taken);
        } else {
            let rect = self.graph.layer(self.graph.input()).shape.full_rect();
            let fixed = match (run, self.capture.recording_mut()) {
                (StepRun::Replay, Some(recorded)) => &mut recorded.images,
                _ => fresh_fixed.insert(b.alloc(stream, DType::F32, expected)?),
            };
            let from = In { rect, mem: &taken };
            let moved = b.fix_step(stream, self.step, from, Out { rect, mem: fixed });
            b.recycle_staged(stream, taken);
            moved?;
        }
        // The next batch goes into the other host buffers on another thread while this one
        // enqueues the step; its copies are enqueued once both are done.
        let next = next.filter(|n| {
            self.prefetch
                && n.images_len() == expected
                && check_labels(&self.graph, n.labels()).is_ok()
        });
        // A synthetic batch is described, not filled: its device buffers are taken now, and it
        // is drawn (on a GPU, by the device) once the step is enqueued.
        let mut host_next = match next {
            Some(BatchInput::Images {
                images: i,
                labels: l,
            }) => Some((b.begin_stage(stream, i.len(), l.len())?, i, l)),
            _ => None,
        };
        let synthetic_next = match next {
            Some(BatchInput::Synthetic(synthetic)) => {
                Some((b.begin_synthetic(stream, synthetic)?, synthetic))
            }
            _ => None,
        };
        let (weights, velocity) = (&mut self.weights, &mut self.velocity);
        let working = &mut self.working;
        let (params, first) = (&self.params, &self.first);
        // Enqueues the step's kernels on the images: the loss, with the samples it averages over.
        // Every buffer the step allocates is dropped before this returns (freed in stream order
        // after its last reader; while recording, within the recording).
        let mut enqueue = |stream: &mut B::Stream, images: &B::Buffer| {
            let (acts, loss, saved) = pass.forward(b, stream, weights, working, images)?;
            let grads = pass.backward(b, stream, weights, working, &acts, &saved)?;
            for (slot, grad) in grads.into_iter().enumerate() {
                let Some(grad) = grad else { continue };
                let p = &params[slot];
                let rect = p.spec.shape.full_rect();
                let param = (slot - first[p.layer.0]) as u8;
                let operands = vec![
                    read(Role::ParamGrad(param), rect, &grad),
                    write(Role::Param(param), rect, &mut weights[slot]),
                    write(Role::Velocity(param), rect, &mut velocity[slot]),
                ];
                pass.run(b, stream, p.layer, rect, Phase::Update { param }, operands)?;
                if let Some(copy) = &mut working[slot] {
                    cast_over(b, stream, rect, &weights[slot], copy);
                }
            }
            Ok::<_, KernelError>(loss)
        };
        let recording = self.capture.recording();
        let (staged_ref, fixed_ref) = (staged_images.as_ref(), fresh_fixed.as_ref());
        let mut work = |stream: &mut B::Stream| -> (Result<_, KernelError>, CaptureEvent<_>) {
            match run {
                StepRun::Enqueued => {
                    let images = staged_ref.expect("an enqueued step reads its staged images");
                    (enqueue(stream, images), CaptureEvent::Unchanged)
                }
                StepRun::Replay => {
                    let recorded = recording.expect("a replay is planned with a recording");
                    match b.replay(stream, &recorded.graph) {
                        Ok(losses) => (
                            Ok(losses.into_iter().last().zip(recorded.loss_samples)),
                            CaptureEvent::Unchanged,
                        ),
                        Err(e) => {
                            let why = format!("replaying the recorded step failed: {e}");
                            (Err(e), CaptureEvent::GaveUp(why))
                        }
                    }
                }
                StepRun::Record => {
                    let images = fixed_ref.expect("a recorded step has its fixed images");
                    let recorded = b.begin_capture(stream).and_then(|()| {
                        // The loss kernels report into the stream's own totals while recording:
                        // replays read them (the report enqueued here is empty).
                        let samples = enqueue(stream, images).map(|loss| loss.map(|(_, n)| n));
                        samples.and_then(|loss_samples| {
                            let graph = b.end_capture(stream)?;
                            Ok((graph, loss_samples))
                        })
                    });
                    let (graph, loss_samples) = match recorded {
                        Ok(recorded) => recorded,
                        Err(e) => {
                            // The step runs as enqueued after all.
                            b.abandon_capture(stream);
                            let why = format!("recording the step failed: {e}");
                            return (enqueue(stream, images), CaptureEvent::GaveUp(why));
                        }
                    };
                    match b.replay(stream, &graph) {
                        Ok(losses) => (
                            Ok(losses.into_iter().last().zip(loss_samples)),
                            CaptureEvent::Recorded(graph, loss_samples),
                        ),
                        Err(e) => {
                            let why = format!("launching the recorded step failed: {e}");
                            (Err(e), CaptureEvent::GaveUp(why))
                        }
                    }
                }
            }
        };
        let (enqueued, filled) = std::thread::scope(|scope| {
            let filler = match &mut host_next {
                Some((host, i, l)) => {
                    let slices = B::host_slices(host)?;
                    Some(scope.spawn(move || fill_host_batch(slices, i, l)))
                }
                None => None,
            };
            let enqueued = work(stream);
            let filled = std::time::Instant::now();
            if let Some(filler) = filler
                && let Err(panic) = filler.join()
            {
                std::panic::resume_unwind(panic);
            }
            Ok::<_, KernelError>((enqueued, filled))
        })?;
        let (loss, event) = enqueued;
        let ran_enqueued = match event {
            CaptureEvent::Unchanged => run == StepRun::Enqueued,
            CaptureEvent::Recorded(graph, loss_samples) => {
                let images = fresh_fixed
                    .take()
                    .expect("a recorded step has its fixed images");
                self.capture.recorded(Recorded {
                    graph,
                    images,
                    loss_samples,
                });
                false
            }
            CaptureEvent::GaveUp(why) => {
                self.capture.give_up(why);
                run == StepRun::Record
            }
        };
        let (b, stream) = (&self.backend, &mut self.stream);
        if let Some(images) = staged_images {
            b.recycle_staged(stream, images);
        }
        // Dropped in stream order after the step's last reader.
        drop(fresh_fixed);
        let loss = loss?;
        let enqueued = filled;
        if let Some((host, i, l)) = host_next {
            self.ahead = Some(Ahead {
                staged: b.finish_stage(stream, host)?,
                labels: l.to_vec(),
                identity: BatchIdentity::Images {
                    len: i.len(),
                    probe: probe_of(i),
                },
            });
        } else if let Some((host, synthetic)) = synthetic_next {
            self.ahead = Some(Ahead {
                staged: b.finish_synthetic(stream, host, synthetic)?,
                labels: synthetic.labels.clone(),
                identity: BatchInput::Synthetic(synthetic).identity(),
            });
        }
        let staged = std::time::Instant::now();
        // The report moves to host memory behind the step's work, and a marker goes behind it:
        // reading the step then waits for this step alone, not for the one enqueued after it.
        let loss = match loss {
            Some((loss, samples)) => Some((b.send_loss_home(stream, loss)?, samples)),
            None => None,
        };
        let end = b.mark(stream)?;
        // Counted once enqueued: the next step's plan is made before this one is read back.
        if ran_enqueued {
            self.capture.ran_enqueued(traced);
        }
        self.step += 1;
        let this_step = InFlight {
            step: self.step,
            loss,
            end,
            enqueue: (enqueued - started).as_secs_f64(),
            stage: (staged - enqueued).as_secs_f64(),
            spans: pass.spans.map(RefCell::into_inner),
        };
        match settle(self.readback, &mut self.in_flight, this_step) {
            Some(step) => self.read_back(step).map(Some),
            None => Ok(None),
        }
    }

    /// Waits for a step's work (its marker), then reads its stats and its trace.
    pub(super) fn read_back(&mut self, step: InFlight<B>) -> Result<Readout, KernelError> {
        let waiting = std::time::Instant::now();
        self.backend.wait_for(&mut self.stream, &step.end)?;
        let host = Some(HostTiming {
            enqueue: step.enqueue,
            stage: step.stage,
            wait: waiting.elapsed().as_secs_f64(),
        });
        if let Some(spans) = step.spans {
            self.trace = Some(timeline(&self.backend, spans)?);
        }
        let (loss, correct) = match step.loss {
            Some((loss, samples)) => {
                let sums = self.backend.read_loss(loss);
                ((sums.loss_sum / samples as f64) as f32, sums.correct)
            }
            // A graph without a loss layer trains nothing to report.
            None => (0.0, 0),
        };
        Ok(Readout {
            step: step.step,
            stats: StepStats {
                loss,
                correct,
                host,
            },
        })
    }
}

/// Which step is read once `enqueued` is: itself, read every step; read one step late, the
/// one in flight before it (none at the first step), `enqueued` taking its place.
pub(super) fn settle<T>(
    readback: LossReadback,
    in_flight: &mut Option<T>,
    enqueued: T,
) -> Option<T> {
    match readback {
        LossReadback::EveryStep => {
            debug_assert!(in_flight.is_none(), "read every step: none left in flight");
            Some(enqueued)
        }
        LossReadback::OneStepLate => in_flight.replace(enqueued),
    }
}

/// What became of capture in a step.
pub(super) enum CaptureEvent<G> {
    Unchanged,
    /// The step was recorded (the graph, and the samples its loss averages over).
    Recorded(G, Option<usize>),
    GaveUp(String),
}
