//! Helpers shared by the planner's integration tests.
#![allow(dead_code)]

use legion_ops::Graph;

/// The zoo model `name` at its defaults and batch `batch`.
pub fn zoo(name: &str, batch: usize) -> Graph {
    zoo_at(name, batch, None)
}

/// The zoo model `name` at batch `batch` and, where given, input size `image`.
pub fn zoo_at(name: &str, batch: usize, image: Option<usize>) -> Graph {
    let z = legion_ops::zoo::find(name).unwrap();
    let mut config = z.default_config(batch);
    if let Some(image) = image {
        config.image_size = image;
    }
    z.build(&config).unwrap()
}
