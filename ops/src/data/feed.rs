//! Batches handed over by the caller one at a time, in training order (a Python iterable of
//! numpy batches): taken as they are, with no shuffle, transforms or sample skipping, checked
//! against the model's batch and read a few batches ahead on a thread of their own.

use super::{Batch, Batches, DataError, ImageShape};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A source of whole batches, in the order a run trains on them.
pub trait BatchFeed: Send + Sync {
    /// The next batch, or `None` where the feed has ended. Called from one thread at a time.
    fn next_batch(&self) -> Result<Option<FedBatch>, DataError>;

    /// A one-line description for logs and errors.
    fn describe(&self) -> String;

    /// Batches the feed holds in all, where it knows (a Python sequence's `len`).
    fn batches(&self) -> Option<u64> {
        None
    }
}

/// One batch of a [`BatchFeed`]: `N·C·H·W` values, sample-major (NCHW), and `N` labels.
#[derive(Clone, Debug, PartialEq)]
pub struct FedBatch {
    pub images: Vec<f32>,
    pub labels: Vec<u32>,
}

/// What each batch of a feed must be: the model's batch of its image shape and classes.
#[derive(Clone, Copy, Debug)]
pub struct FeedShape {
    pub batch: usize,
    pub image: ImageShape,
    pub classes: usize,
}

impl FeedShape {
    /// `fed` as the loader's [`Batch`] number `index` (from 0), or why it is not one.
    fn check(&self, index: u64, fed: FedBatch) -> Result<Batch, String> {
        let [c, h, w] = self.image;
        let per_sample = c * h * w;
        if fed.labels.len() != self.batch {
            return Err(format!(
                "{} labels, but the model's batch is {}",
                fed.labels.len(),
                self.batch
            ));
        }
        let expected = per_sample
            .checked_mul(self.batch)
            .ok_or("the batch's size overflows")?;
        if fed.images.len() != expected {
            return Err(format!(
                "{} image values, but {} samples of [C, H, W] {:?} are {expected}",
                fed.images.len(),
                self.batch,
                self.image
            ));
        }
        if let Some((i, &label)) = fed
            .labels
            .iter()
            .enumerate()
            .find(|&(_, &l)| l as usize >= self.classes)
        {
            return Err(format!(
                "sample {i} has label {label}, but the model has {} classes (labels 0..{})",
                self.classes, self.classes
            ));
        }
        if let Some(at) = fed.images.iter().position(|v| !v.is_finite()) {
            return Err(format!(
                "image value {at} (sample {}) is {}",
                at / per_sample,
                fed.images[at]
            ));
        }
        Ok(Batch {
            images: fed.images,
            bytes: None,
            unread: false,
            synthetic: None,
            labels: fed.labels,
            indices: (0..self.batch).collect(),
            epoch: 0,
            batch: index as usize,
            image: self.image,
        })
    }
}

/// The first `count` batches of `feed`, checked against `shape` and read up to `prefetch` ahead
/// on a thread of their own. A feed that ends before `count` is an error naming how many it gave.
pub fn read_ahead(
    feed: Arc<dyn BatchFeed>,
    shape: FeedShape,
    count: u64,
    prefetch: usize,
) -> Batches {
    let (sender, receiver) = crossbeam_channel::bounded(prefetch.max(1));
    let cancel = Arc::new(AtomicBool::new(false));
    let stop = Arc::clone(&cancel);
    let handle = std::thread::Builder::new()
        .name("legion-batch-feed".into())
        .spawn(move || {
            for index in 0..count {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let item = match feed.next_batch() {
                    Ok(Some(fed)) => {
                        shape
                            .check(index, fed)
                            .map_err(|reason| DataError::FeedBatch {
                                feed: feed.describe(),
                                batch: index,
                                reason,
                            })
                    }
                    Ok(None) => Err(DataError::FeedEnded {
                        feed: feed.describe(),
                        batches: index,
                        wanted: count,
                    }),
                    Err(e) => Err(e),
                };
                let failed = item.is_err();
                // A closed channel: the run has stopped reading.
                if sender.send(item).is_err() || failed {
                    return;
                }
            }
        })
        .expect("failed to spawn the batch feed thread");
    Batches {
        receiver: Some(receiver),
        handle: Some(handle),
        cancel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// `batches` batches of 2 samples of [1, 2, 2], sample values their batch number.
    struct Counting {
        batches: u64,
        given: Mutex<u64>,
        label: u32,
    }

    impl BatchFeed for Counting {
        fn next_batch(&self) -> Result<Option<FedBatch>, DataError> {
            let mut given = self.given.lock().unwrap();
            if *given == self.batches {
                return Ok(None);
            }
            *given += 1;
            Ok(Some(FedBatch {
                images: vec![*given as f32; 8],
                labels: vec![self.label, 0],
            }))
        }
        fn describe(&self) -> String {
            "a counting feed".into()
        }
    }

    const SHAPE: FeedShape = FeedShape {
        batch: 2,
        image: [1, 2, 2],
        classes: 3,
    };

    fn feed(batches: u64, label: u32) -> Arc<dyn BatchFeed> {
        Arc::new(Counting {
            batches,
            given: Mutex::new(0),
            label,
        })
    }

    #[test]
    fn a_feed_is_read_in_order_and_stops_at_the_count() {
        let got: Vec<Batch> = read_ahead(feed(5, 2), SHAPE, 3, 2)
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(got.len(), 3);
        for (i, b) in got.iter().enumerate() {
            assert_eq!((b.batch, b.images[0], b.labels[0]), (i, (i + 1) as f32, 2));
            assert_eq!(b.shape().dims(), [2, 1, 2, 2]);
        }
    }

    #[test]
    fn a_short_feed_and_a_wrong_batch_are_named() {
        let mut short = read_ahead(feed(1, 0), SHAPE, 3, 2);
        assert!(short.next().unwrap().is_ok());
        let e = short.next().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("a counting feed") && e.contains("after 1"),
            "{e}"
        );
        assert!(short.next().is_none(), "nothing after the error");

        let e = read_ahead(feed(2, 7), SHAPE, 2, 2)
            .next()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch 0") && e.contains("label 7"), "{e}");

        let wide = FeedShape {
            image: [1, 3, 3],
            ..SHAPE
        };
        let e = read_ahead(feed(2, 0), wide, 2, 2)
            .next()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("8 image values") && e.contains("18"), "{e}");
    }
}
