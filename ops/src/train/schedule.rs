//! Learning-rate schedules: the rate of every step as a pure function of the step, so a run
//! resumed from a checkpoint (which holds its step) continues the same sequence of rates, and
//! every device of a step updates with the same one.
//!
//! The forms are PyTorch's, stepped once per training step: `StepLR` (the rate times `gamma`
//! every `every` steps), `CosineAnnealingLR` (from the base rate down to `min_lr` over the steps
//! after the warm-up) and a linear warm-up as `LinearLR` from `base / warmup` (the rate of step
//! `t < warmup` is `base · (t + 1) / warmup`).

use std::f64::consts::PI;
use std::fmt;

/// How the rate falls after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    Constant,
    /// Times `gamma` every `every` steps.
    Step {
        every: u64,
        gamma: f32,
    },
    /// Half a cosine from the base rate to `min_lr` at the last step.
    Cosine {
        min_lr: f32,
    },
}

/// A learning-rate schedule over a run of `total` steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Steps of linear warm-up, from `base / warmup` up to `base`.
    pub warmup: u64,
    pub decay: Decay,
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::CONSTANT
    }
}

impl LrSchedule {
    /// The base rate at every step.
    pub const CONSTANT: LrSchedule = LrSchedule {
        warmup: 0,
        decay: Decay::Constant,
    };

    /// Whether every step has the base rate.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && self.decay == Decay::Constant
    }

    /// Refuses a schedule no run could follow: a step decay of no steps, a factor or floor out of
    /// range, a warm-up as long as the run.
    pub fn check(&self, base: f32, total: u64) -> Result<(), String> {
        match self.decay {
            Decay::Step { every: 0, .. } => return Err("a step decay every 0 steps".into()),
            Decay::Step { gamma, .. } if !(gamma > 0.0 && gamma <= 1.0) => {
                return Err(format!("a step decay's gamma is in (0, 1], not {gamma}"));
            }
            Decay::Cosine { min_lr } if !(min_lr >= 0.0 && min_lr <= base) => {
                return Err(format!(
                    "a cosine's final rate is between 0 and the base rate {base}, not {min_lr}"
                ));
            }
            _ => {}
        }
        if self.warmup > 0 && self.warmup >= total {
            return Err(format!(
                "a warm-up of {} steps leaves none of the run's {total} after it",
                self.warmup
            ));
        }
        Ok(())
    }

    /// The rate of step `step` (counted from 0) of a run of `total` steps with base rate `base`.
    pub fn lr(&self, base: f32, step: u64, total: u64) -> f32 {
        if step < self.warmup {
            return (f64::from(base) * (step + 1) as f64 / self.warmup as f64) as f32;
        }
        let after = step - self.warmup;
        match self.decay {
            Decay::Constant => base,
            Decay::Step { every, gamma } => {
                (f64::from(base) * f64::from(gamma).powi((after / every) as i32)) as f32
            }
            Decay::Cosine { min_lr } => {
                let span = total.saturating_sub(self.warmup).max(1) as f64;
                let (base, min) = (f64::from(base), f64::from(min_lr));
                (min + (base - min) * (1.0 + (PI * after as f64 / span).cos()) / 2.0) as f32
            }
        }
    }
}

impl fmt::Display for LrSchedule {
    /// As the command line writes it (`cosine`, `step:30:0.1`), with `+warmup:N`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.decay {
            Decay::Constant => f.write_str("constant")?,
            Decay::Step { every, gamma } => write!(f, "step:{every}:{gamma}")?,
            Decay::Cosine { min_lr: 0.0 } => f.write_str("cosine")?,
            Decay::Cosine { min_lr } => write!(f, "cosine:{min_lr}")?,
        }
        if self.warmup > 0 {
            write!(f, "+warmup:{}", self.warmup)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for LrSchedule {
    type Err = String;

    /// `constant`, `step:EVERY:GAMMA`, `cosine` or `cosine:MIN_LR`, each optionally followed by
    /// `+warmup:STEPS`.
    fn from_str(text: &str) -> Result<LrSchedule, String> {
        let (decay, warmup) = match text.split_once('+') {
            Some((decay, warmup)) => {
                let steps = warmup
                    .strip_prefix("warmup:")
                    .and_then(|n| n.parse::<u64>().ok())
                    .ok_or_else(|| format!("`{warmup}`: expected warmup:STEPS"))?;
                (decay, steps)
            }
            None => (text, 0),
        };
        let parts: Vec<&str> = decay.split(':').collect();
        let number = |s: &str, what: &str| {
            s.parse::<f64>()
                .map_err(|e| format!("`{text}`: {what} `{s}`: {e}"))
        };
        let decay = match parts[..] {
            ["constant"] => Decay::Constant,
            ["cosine"] => Decay::Cosine { min_lr: 0.0 },
            ["cosine", min] => Decay::Cosine {
                min_lr: number(min, "the final rate")? as f32,
            },
            ["step", every, gamma] => Decay::Step {
                every: every
                    .parse()
                    .map_err(|e| format!("`{text}`: steps `{every}`: {e}"))?,
                gamma: number(gamma, "gamma")? as f32,
            },
            _ => {
                return Err(format!(
                    "`{text}`: expected constant, step:EVERY:GAMMA, cosine or cosine:MIN_LR, \
                     each with an optional +warmup:STEPS"
                ));
            }
        };
        Ok(LrSchedule { warmup, decay })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_as_pytorchs_linear_lr_and_cosine_annealing() {
        let s: LrSchedule = "cosine+warmup:4".parse().unwrap();
        let lr: Vec<f32> = (0..12).map(|t| s.lr(0.1, t, 12)).collect();
        // LinearLR(start_factor=1/4, total_iters=3): 0.025, 0.05, 0.075, then the base.
        for (t, want) in [0.025, 0.05, 0.075, 0.1].into_iter().enumerate() {
            assert!((lr[t] - want).abs() < 1e-7, "{t}: {lr:?}");
        }
        // CosineAnnealingLR(T_max=8) after it: 0.1·(1 + cos(π·k/8))/2 at its k-th step.
        for k in 0..8 {
            let want = 0.1 * (1.0 + (PI * k as f64 / 8.0).cos()) / 2.0;
            assert!((f64::from(lr[4 + k]) - want).abs() < 1e-7, "{k}: {lr:?}");
        }
        assert!(lr.windows(2).skip(4).all(|w| w[1] < w[0]), "{lr:?}");
    }

    #[test]
    fn step_decay_and_the_constant_rate() {
        let s: LrSchedule = "step:3:0.1".parse().unwrap();
        let lr: Vec<f32> = (0..7).map(|t| s.lr(1.0, t, 7)).collect();
        assert_eq!(&lr[..3], &[1.0; 3]);
        assert!(lr[3..6].iter().all(|&v| (v - 0.1).abs() < 1e-7), "{lr:?}");
        assert!((lr[6] - 0.01).abs() < 1e-8, "{lr:?}");
        assert!(LrSchedule::CONSTANT.is_constant());
        assert_eq!(LrSchedule::CONSTANT.lr(0.3, 99, 100), 0.3);
    }

    #[test]
    fn schedules_read_back_as_written_and_bad_ones_say_why() {
        for text in [
            "constant",
            "cosine",
            "cosine:0.001+warmup:5",
            "step:30:0.1+warmup:2",
        ] {
            assert_eq!(text.parse::<LrSchedule>().unwrap().to_string(), text);
        }
        assert!(
            "linear"
                .parse::<LrSchedule>()
                .unwrap_err()
                .contains("expected")
        );
        assert!("cosine+warm:3".parse::<LrSchedule>().is_err());
        let s: LrSchedule = "step:0:0.5".parse().unwrap();
        assert!(s.check(0.1, 10).unwrap_err().contains("every 0"));
        let s: LrSchedule = "cosine+warmup:10".parse().unwrap();
        assert!(s.check(0.1, 10).unwrap_err().contains("warm-up"));
        let s: LrSchedule = "cosine:0.5".parse().unwrap();
        assert!(s.check(0.1, 10).is_err());
    }
}
