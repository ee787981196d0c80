//! A Python iterator of `(images, labels)` numpy batches as a [`BatchFeed`]: each batch taken
//! under the interpreter's lock on the feed's own thread (`legion_ops::data::read_ahead`), while
//! the run computes the one before.

use legion::ops::data::{BatchFeed, DataError, FedBatch};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyIterator;
use std::sync::Mutex;

pub struct PyFeed {
    iterator: Py<PyIterator>,
    /// Batches taken so far, to name the one at fault.
    taken: Mutex<u64>,
    len: Option<u64>,
    description: String,
}

impl PyFeed {
    /// Iterates `iterable` (its `len`, where it has one, is the feed's length).
    pub fn new(iterable: &Bound<'_, PyAny>) -> PyResult<PyFeed> {
        let len = iterable.len().ok().map(|n| n as u64);
        let description = format!("a Python {}", super::type_name(iterable));
        let iterator = iterable.try_iter()?.unbind();
        Ok(PyFeed {
            iterator,
            taken: Mutex::new(0),
            len,
            description,
        })
    }

    fn fail(&self, batch: u64, reason: String) -> DataError {
        DataError::FeedBatch {
            feed: self.description.clone(),
            batch,
            reason,
        }
    }
}

impl BatchFeed for PyFeed {
    fn next_batch(&self) -> Result<Option<FedBatch>, DataError> {
        let mut taken = self.taken.lock().expect("the feed's count");
        let batch = *taken;
        let fed = Python::attach(|py| -> Result<Option<FedBatch>, String> {
            let Some(item) = self.iterator.bind(py).clone().next() else {
                return Ok(None);
            };
            let item = item.map_err(|e| format!("the iterator raised {e}"))?;
            let (images, labels): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item
                .extract()
                .map_err(|_| "expected an (images, labels) pair".to_string())?;
            let images: PyReadonlyArrayDyn<'_, f32> = images.extract().map_err(|_| {
                format!(
                    "images: expected a float32 numpy array, got {}",
                    super::type_name(&images)
                )
            })?;
            let labels: PyReadonlyArrayDyn<'_, i64> = labels.extract().map_err(|_| {
                format!(
                    "labels: expected an int64 numpy array, got {}",
                    super::type_name(&labels)
                )
            })?;
            if images.ndim() != 4 || labels.ndim() != 1 {
                return Err(format!(
                    "images must be [N, C, H, W] and labels [N], got {:?} and {:?}",
                    images.shape(),
                    labels.shape()
                ));
            }
            let images = images
                .as_slice()
                .map_err(|_| "images: the array is not contiguous".to_string())?
                .to_vec();
            let labels = labels
                .as_slice()
                .map_err(|_| "labels: the array is not contiguous".to_string())?
                .iter()
                .enumerate()
                .map(|(i, &l)| u32::try_from(l).map_err(|_| format!("sample {i} has label {l}")))
                .collect::<Result<Vec<u32>, String>>()?;
            Ok(Some(FedBatch { images, labels }))
        })
        .map_err(|reason| self.fail(batch, reason))?;
        *taken += 1;
        Ok(fed)
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn batches(&self) -> Option<u64> {
        self.len
    }
}
