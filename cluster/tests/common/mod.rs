//! Helpers shared by the integration tests that run the `legion-rs` binary.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

pub fn legion(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .output()
        .expect("legion-rs runs")
}

pub fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "legion-rs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every tensor of checkpoint `a` equals `b`'s within relative error 1e-4 (of the tensor's largest
/// magnitude).
pub fn assert_same_tensors(a: &Path, b: &Path) {
    let a = legion_ops::checkpoint::load(a).unwrap();
    let b = legion_ops::checkpoint::load(b).unwrap();
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        let scale = y.data.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let diff = x
            .data
            .iter()
            .zip(&y.data)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff / scale <= 1e-4,
            "{} differs by {:e}",
            x.name,
            diff / scale
        );
    }
}
