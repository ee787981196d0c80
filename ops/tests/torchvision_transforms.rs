//! The recipes' geometry against torchvision's `transforms.v2` on real photographs: given the same
//! crop box and flip (or the same resize and centre crop), each output pixel is within a mean
//! absolute difference of 2/255 of torchvision's. The fixtures are torchvision's own outputs,
//! written by `integration/torchvision_transforms.py` (versions in `cases.json`); the JPEG cases
//! also hold the difference between two JPEG decoders (zune-jpeg here, libjpeg-turbo there).

use legion_ops::data::{Crop, Geometry, Transforms, render_crop};
use serde_json::Value;
use std::path::{Path, PathBuf};

const MAX_MEAN_ABS_DIFF: f64 = 2.0 / 255.0;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transforms")
}

fn rgb(path: &Path) -> image::RgbImage {
    image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_rgb8()
}

#[test]
fn crops_resizes_and_flips_match_torchvision_v2() {
    let cases: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 8, "the fixture holds every case");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let source = rgb(&fixtures().join(case["source"].as_str().unwrap()));
        let expected = rgb(&fixtures().join(case["expected"].as_str().unwrap()));
        let int = |key: &str| case[key].as_u64().unwrap() as f64;
        let size: Vec<usize> = case["size"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let (height, width) = (size[0], size[1]);
        let crop = match case["kind"].as_str().unwrap() {
            "resized_crop" => Crop {
                left: int("left"),
                top: int("top"),
                width: int("width"),
                height: int("height"),
                flip: case["flip"].as_bool().unwrap(),
                cut_first: true,
            },
            // `Resize(S)` then `CenterCrop(size)`: the model's image is size / S of the
            // resized shorter side.
            "resize_center_crop" => Transforms {
                geometry: Geometry::CenterCrop {
                    fraction: height.min(width) as f64 / int("resize"),
                },
                ..Transforms::EVAL
            }
            .crop(0, 0, 0, [source.width(), source.height()], [height, width]),
            kind => panic!("{name}: unknown kind {kind}"),
        };
        let mut out = vec![0.0f32; 3 * height * width];
        render_crop(
            source.as_raw(),
            [source.width(), source.height()],
            &crop,
            [3, height, width],
            &mut out,
        )
        .unwrap();
        assert_eq!(
            expected.dimensions(),
            (width as u32, height as u32),
            "{name}"
        );
        let plane = height * width;
        let mut total = 0.0f64;
        for (i, pixel) in expected.pixels().enumerate() {
            for c in 0..3 {
                total += (f64::from(out[c * plane + i]) - f64::from(pixel[c]) / 255.0).abs();
            }
        }
        let mad = total / (3 * plane) as f64;
        assert!(
            mad <= MAX_MEAN_ABS_DIFF,
            "{name}: mean absolute difference {:.2}/255 from torchvision",
            mad * 255.0
        );
        eprintln!("{name}: {:.3}/255", mad * 255.0);
    }
}
