//! The Python package as a user gets it: its wheel built by maturin (from this workspace's build
//! of the crates beneath), installed into a fresh virtual environment, and its pytest tests run
//! there (`tests/*.py`).
//!
//! Needs maturin (`LEGION_MATURIN`, else `~/.cache/legion-rs/maturin-1.16.0/bin/maturin` where
//! `.ci/run` installs it, else `maturin` on the path) and a `python3` with venv; numpy and pytest
//! come from `LEGION_WHEELHOUSE` where set (`.ci/run` downloads them there), else from PyPI.
//! torch, for the tests against PyTorch, from `LEGION_TORCH_PATH` (a `pip install --target`
//! folder) where set. The cluster test starts its workers with the `legion-rs` binary this
//! workspace built beside this test (`LEGION_RS_BIN`). Without maturin or Python the test skips
//! with the reason, unless
//! `LEGION_REQUIRE` lists `python`; the pytest tests that need torch skip or fail the same way
//! by `torch`.

use legion_ops::require::{self, Need};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const MATURIN: &str = "maturin-1.16.0/bin/maturin";

/// The maturin to build with, or why there is none.
fn maturin() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("LEGION_MATURIN") {
        return Ok(path.into());
    }
    let cached = std::env::var_os("HOME")
        .map(|home| Path::new(&home).join(".cache/legion-rs").join(MATURIN));
    if let Some(cached) = cached.filter(|p| p.exists()) {
        return Ok(cached);
    }
    match Command::new("maturin").arg("--version").output() {
        Ok(out) if out.status.success() => Ok("maturin".into()),
        _ => Err(format!(
            "no maturin: not in LEGION_MATURIN, ~/.cache/legion-rs/{MATURIN} or on the path \
             (.ci/run installs it: pip install --target ~/.cache/legion-rs/maturin-1.16.0 \
             maturin==1.16.0)"
        )),
    }
}

/// Runs `cmd`, naming it and its output where it fails.
fn run(what: &str, cmd: &mut Command) -> Result<Output, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: {:?} did not start: {e}", cmd.get_program()))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out)
}

#[test]
fn the_wheel_installs_into_a_fresh_environment_and_its_tests_pass() {
    let maturin = match maturin() {
        Ok(m) => m,
        Err(reason) => return require::skip(Need::Python, reason),
    };
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = tempfile::tempdir().unwrap();
    let wheels = work.path().join("wheels");
    // The workspace's own profile for tests, so that the crates beneath are not built again.
    let built = run(
        "maturin build",
        Command::new(&maturin)
            .args(["build", "--quiet", "--profile", "dev", "--out"])
            .arg(&wheels)
            .arg("--manifest-path")
            .arg(crate_dir.join("Cargo.toml")),
    );
    if let Err(e) = built {
        return require::skip(Need::Python, e);
    }
    let wheel = std::fs::read_dir(&wheels)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("maturin wrote a wheel");
    let venv = work.path().join("venv");
    if let Err(e) = run(
        "python3 -m venv",
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
    ) {
        return require::skip(Need::Python, e);
    }
    let python = venv.join("bin/python");
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]);
    if let Some(wheelhouse) = std::env::var_os("LEGION_WHEELHOUSE") {
        pip.arg("--no-index").arg("--find-links").arg(wheelhouse);
    }
    pip.args(["numpy", "pytest"]).arg(&wheel);
    if let Err(e) = run("pip install", &mut pip) {
        return require::skip(Need::Python, e);
    }
    if let Some(torch) = std::env::var_os("LEGION_TORCH_PATH") {
        let out = run(
            "the environment's site-packages",
            Command::new(&python).args([
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ]),
        )
        .unwrap();
        let site = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        // Appended to the module path, after the environment's own numpy.
        std::fs::write(
            site.join("legion-torch.pth"),
            Path::new(&torch).as_os_str().as_encoded_bytes(),
        )
        .unwrap();
    }
    let mut pytest = Command::new(&python);
    // target/debug/deps/wheel-… → target/debug/legion-rs, built by the command line's tests.
    let exe = std::env::current_exe().unwrap();
    if let Some(binary) = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("legion-rs"))
    {
        pytest.env("LEGION_RS_BIN", binary);
    }
    let out = pytest
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(crate_dir.join("tests"))
        .current_dir(work.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "pytest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
