//! Fault injection in user space, applied on send (this machine's kernel has no `netem`): added
//! delay, message loss, and a forced disconnect. Wraps any `Transport`, so the same faults apply to
//! the QUIC transport and to the in-process one.

use legion_ops::rng::hash;
use legion_runtime::{SliceMessage, Transport};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct FaultConfig {
    /// Added to every delivered message.
    pub delay: Duration,
    /// Probability that a message is lost, decided per send index (see [`FaultConfig::drops`]).
    pub drop_probability: f64,
    pub seed: u64,
}

impl FaultConfig {
    /// Whether the `index`-th message sent through the wrapper is lost. A pure function of the seed
    /// and the index, so a test knows which messages to expect.
    pub fn drops(&self, index: u64) -> bool {
        let unit = (hash(&[self.seed, index]) >> 11) as f64 / (1u64 << 53) as f64;
        unit < self.drop_probability
    }
}

type OnDisconnect = Box<dyn FnOnce() + Send>;

pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    config: FaultConfig,
    /// Runs the delayed deliveries.
    runtime: tokio::runtime::Handle,
    sent: AtomicU64,
    dropped: AtomicU64,
    disconnected: AtomicBool,
    on_disconnect: Mutex<Option<OnDisconnect>>,
}

impl FaultyTransport {
    pub fn new(
        inner: Arc<dyn Transport>,
        config: FaultConfig,
        runtime: tokio::runtime::Handle,
    ) -> FaultyTransport {
        FaultyTransport {
            inner,
            config,
            runtime,
            sent: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            disconnected: AtomicBool::new(false),
            on_disconnect: Mutex::new(None),
        }
    }

    /// What a disconnect does besides dropping later sends, e.g. closing the QUIC connection so
    /// that the peer sees the link go down.
    pub fn on_disconnect(&self, f: impl FnOnce() + Send + 'static) {
        *self.on_disconnect.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(f));
    }

    /// Cuts the link: every later send is lost.
    pub fn disconnect(&self) {
        self.disconnected.store(true, Ordering::SeqCst);
        let hook = self
            .on_disconnect
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(hook) = hook {
            hook();
        }
    }

    /// Messages lost so far (by drop probability or after a disconnect).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::SeqCst)
    }
}

impl Transport for FaultyTransport {
    fn send(&self, msg: SliceMessage) {
        let index = self.sent.fetch_add(1, Ordering::SeqCst);
        if self.disconnected.load(Ordering::SeqCst) || self.config.drops(index) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
            tracing::debug!(
                index,
                step = msg.step,
                copy = msg.copy,
                "fault: slice dropped"
            );
            return;
        }
        if self.config.delay.is_zero() {
            self.inner.send(msg);
            return;
        }
        let (inner, delay) = (self.inner.clone(), self.config.delay);
        self.runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            inner.send(msg);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_decisions_follow_the_probability() {
        let never = FaultConfig::default();
        assert!((0..1000).all(|i| !never.drops(i)));
        let always = FaultConfig {
            drop_probability: 1.0,
            ..FaultConfig::default()
        };
        assert!((0..1000).all(|i| always.drops(i)));
        let half = FaultConfig {
            drop_probability: 0.5,
            seed: 7,
            ..FaultConfig::default()
        };
        let lost = (0..10_000).filter(|&i| half.drops(i)).count();
        assert!((4_500..5_500).contains(&lost), "{lost}");
    }
}
