//! Whole-step capture: which training steps of one device run their kernels as they are enqueued,
//! which one is recorded, which replay the recording, and why capture was given up.
//!
//! A step of AlexNet on a GPU is some 150 kernel launches and copies. Enqueued one by one, each
//! costs the host microseconds and can leave the GPU a gap; recorded once (a CUDA graph, what
//! Legion calls tracing) the whole step is one launch. A step can be recorded when it is the same
//! program every time: the same kernels on the same buffers, with what changes between steps
//! (the batch, the step number dropout draws from, the loss totals) read from device memory at
//! fixed addresses (`Pipeline::fix_step`).
//!
//! The policy is pure, so that it is tested here; [`crate::train::Trainer`] drives a backend with
//! it. The first step runs as enqueued (a GPU backend times convolution algorithms and grows its
//! workspace the first time it meets a problem, which a recording must not), the next untraced
//! step is recorded and run, and later ones replay it. A traced step runs as enqueued, since it
//! times each kernel between markers. Where recording fails, the reason is kept, the step runs
//! as enqueued, and so do all later ones.

/// Whether a trainer records its step and replays it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureSetting {
    /// Record the step once it has run as enqueued, then replay it (the default).
    #[default]
    On,
    /// Enqueue every step's kernels one by one (to measure what capture saves).
    Off,
}

/// How one step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepRun {
    /// Its kernels enqueued one by one.
    Enqueued,
    /// Its kernels recorded, then the recording launched.
    Record,
    /// The recording launched.
    Replay,
}

/// A recorded step, and the buffer it reads the batch's images from (it lives as long as the
/// recording, so that a replay never reads memory that was freed).
pub struct Recorded<G, M> {
    pub graph: G,
    pub images: M,
    /// The number of values the step's loss averages over, when it has one.
    pub loss_samples: Option<usize>,
}

/// Where capture stands, as a user is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    Off,
    /// No step has been recorded yet.
    Warming,
    /// Steps replay the recording.
    Replaying,
    /// Recording failed; every step runs as enqueued.
    GaveUp(String),
    /// The engine does not record its steps, for this reason.
    NotApplied(String),
}

impl std::fmt::Display for CaptureStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaptureStatus::Off => write!(f, "off"),
            CaptureStatus::Warming => write!(f, "on, nothing recorded yet"),
            CaptureStatus::Replaying => write!(f, "on, steps replay the recorded step"),
            CaptureStatus::GaveUp(why) => write!(f, "given up ({why}): steps run as enqueued"),
            CaptureStatus::NotApplied(why) => write!(f, "not applied ({why})"),
        }
    }
}

/// One device's capture state.
pub struct StepCapture<G, M> {
    state: State<G, M>,
}

enum State<G, M> {
    Off,
    /// `enqueued`: untraced steps run as enqueued that succeeded.
    Warming {
        enqueued: u64,
    },
    Ready(Recorded<G, M>),
    GaveUp(String),
}

impl<G, M> StepCapture<G, M> {
    pub fn new(setting: CaptureSetting) -> StepCapture<G, M> {
        StepCapture {
            state: match setting {
                CaptureSetting::On => State::Warming { enqueued: 0 },
                CaptureSetting::Off => State::Off,
            },
        }
    }

    /// Turns capture on or off. Off drops the recording; on again records afresh.
    pub fn set(&mut self, setting: CaptureSetting) {
        let on = !matches!(self.state, State::Off);
        match (setting, on) {
            (CaptureSetting::Off, _) => self.state = State::Off,
            (CaptureSetting::On, false) => self.state = State::Warming { enqueued: 0 },
            (CaptureSetting::On, true) => {}
        }
    }

    /// How the next step runs; `traced`: its kernels are to be timed one by one.
    pub fn plan(&self, traced: bool) -> StepRun {
        match &self.state {
            _ if traced => StepRun::Enqueued,
            State::Off | State::GaveUp(_) => StepRun::Enqueued,
            State::Warming { enqueued: 0 } => StepRun::Enqueued,
            State::Warming { .. } => StepRun::Record,
            State::Ready(_) => StepRun::Replay,
        }
    }

    /// A step ran as enqueued and was enqueued without error (`traced` or not). What the warm-up
    /// is for (timing the convolution algorithms, growing cuDNN's workspace) happens as the step
    /// is enqueued, so it counts before its loss is read back (a step later, by default); a
    /// failure of its device work is reported by that read.
    pub fn ran_enqueued(&mut self, traced: bool) {
        if let State::Warming { enqueued } = &mut self.state
            && !traced
        {
            *enqueued += 1;
        }
    }

    /// The step planned as [`StepRun::Record`] was recorded.
    pub fn recorded(&mut self, recorded: Recorded<G, M>) {
        if let State::Warming { .. } = self.state {
            self.state = State::Ready(recorded);
        }
    }

    /// Recording or replaying failed: from now on every step runs as enqueued.
    pub fn give_up(&mut self, why: String) {
        if !matches!(self.state, State::Off) {
            self.state = State::GaveUp(why);
        }
    }

    /// The recording, once there is one.
    pub fn recording(&self) -> Option<&Recorded<G, M>> {
        match &self.state {
            State::Ready(recorded) => Some(recorded),
            _ => None,
        }
    }

    /// The recording, to write the next replay's images into.
    pub fn recording_mut(&mut self) -> Option<&mut Recorded<G, M>> {
        match &mut self.state {
            State::Ready(recorded) => Some(recorded),
            _ => None,
        }
    }

    pub fn status(&self) -> CaptureStatus {
        match &self.state {
            State::Off => CaptureStatus::Off,
            State::Warming { .. } => CaptureStatus::Warming,
            State::Ready(_) => CaptureStatus::Replaying,
            State::GaveUp(why) => CaptureStatus::GaveUp(why.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded() -> Recorded<&'static str, Vec<f32>> {
        Recorded {
            graph: "step",
            images: vec![0.0; 4],
            loss_samples: Some(8),
        }
    }

    #[test]
    fn the_first_untraced_step_runs_enqueued_the_second_is_recorded_and_later_ones_replay() {
        let mut c = StepCapture::new(CaptureSetting::On);
        assert_eq!(c.status(), CaptureStatus::Warming);
        assert_eq!(c.plan(true), StepRun::Enqueued);
        // A traced step runs enqueued and does not count as the warm-up.
        c.ran_enqueued(true);
        assert_eq!(c.plan(false), StepRun::Enqueued);
        c.ran_enqueued(false);
        assert_eq!(c.plan(false), StepRun::Record);
        c.recorded(recorded());
        assert_eq!(c.status(), CaptureStatus::Replaying);
        assert_eq!(c.plan(false), StepRun::Replay);
        assert_eq!(c.recording().unwrap().loss_samples, Some(8));
        // A traced step among replays runs enqueued; the recording stays.
        assert_eq!(c.plan(true), StepRun::Enqueued);
        c.ran_enqueued(true);
        assert_eq!(c.plan(false), StepRun::Replay);
    }

    #[test]
    fn a_failed_step_does_not_count_as_the_warm_up() {
        let c = StepCapture::<(), ()>::new(CaptureSetting::On);
        // `ran_enqueued` is called only for steps enqueued without error: none here.
        assert_eq!(c.plan(false), StepRun::Enqueued);
    }

    #[test]
    fn giving_up_keeps_the_reason_and_runs_every_later_step_enqueued() {
        let mut c = StepCapture::new(CaptureSetting::On);
        c.ran_enqueued(false);
        assert_eq!(c.plan(false), StepRun::Record);
        c.give_up("cuBLAS allocated while recording".into());
        assert_eq!(
            c.status(),
            CaptureStatus::GaveUp("cuBLAS allocated while recording".into())
        );
        for traced in [false, true, false] {
            assert_eq!(c.plan(traced), StepRun::Enqueued);
        }
        assert!(c.recording().is_none());
        // A late recording (after giving up) is not taken.
        c.recorded(recorded());
        assert_eq!(c.plan(false), StepRun::Enqueued);
        assert!(c.status().to_string().contains("cuBLAS allocated"));
    }

    #[test]
    fn off_never_records_and_on_again_starts_over() {
        let mut c = StepCapture::new(CaptureSetting::Off);
        c.ran_enqueued(false);
        c.ran_enqueued(false);
        assert_eq!(c.plan(false), StepRun::Enqueued);
        c.give_up("ignored while off".into());
        assert_eq!(c.status(), CaptureStatus::Off);
        c.set(CaptureSetting::On);
        assert_eq!(c.plan(false), StepRun::Enqueued, "warms up first");
        c.ran_enqueued(false);
        c.recorded(recorded());
        assert_eq!(c.plan(false), StepRun::Replay);
        c.set(CaptureSetting::On);
        assert_eq!(
            c.plan(false),
            StepRun::Replay,
            "on while on keeps the recording"
        );
        c.set(CaptureSetting::Off);
        assert!(c.recording().is_none(), "off drops the recording");
        assert_eq!(c.plan(false), StepRun::Enqueued);
    }
}
