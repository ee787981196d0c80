//! What CUDA this process can use, found at run time.
//!
//! cudarc opens every library lazily and *panics* when one is missing, so nothing here calls into a
//! library before checking that it can be opened. The answer is either the GPUs, or one line that
//! says what is missing and what to do about it.

use cudarc::driver::{result as driver, sys as driver_sys};
use std::fmt;

/// One GPU the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    /// The driver's device ordinal.
    pub ordinal: usize,
    pub name: String,
    pub total_memory_bytes: usize,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub compute_capability: (i32, i32),
}

impl fmt::Display for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} (sm_{major}{minor}, {:.1} GiB)",
            self.ordinal,
            self.name,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// A CUDA library this crate opens at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Driver,
    Cublas,
    Cudnn,
    Nvrtc,
}

impl Library {
    /// The file the dynamic loader looks for (cudarc also tries versioned names such as `.so.13`).
    pub fn file_name(self) -> &'static str {
        match self {
            Library::Driver => "libcuda.so",
            Library::Cublas => "libcublas.so",
            Library::Cudnn => "libcudnn.so",
            Library::Nvrtc => "libnvrtc.so",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Library::Driver => "the CUDA driver library",
            Library::Cublas => "cuBLAS",
            Library::Cudnn => "cuDNN",
            Library::Nvrtc => "NVRTC (the CUDA runtime compiler)",
        }
    }

    /// Whether the dynamic loader can open the library.
    ///
    /// cudarc's checks open the library and close it again. That is safe for these top-level
    /// libraries: what must never be closed are the sub-libraries cuDNN opens itself
    /// (`libcudnn_cnn` …, see GPU-NOTES), and once cudarc has opened a library for use it holds it
    /// for the life of the process, so a check's close only drops the extra reference.
    pub fn is_present(self) -> bool {
        // SAFETY: these only try to dlopen the library by name; no symbol is called.
        unsafe {
            match self {
                Library::Driver => driver_sys::is_culib_present(),
                Library::Cublas => cudarc::cublas::sys::is_culib_present(),
                Library::Cudnn => cudarc::cudnn::sys::is_culib_present(),
                Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            }
        }
    }
}

impl fmt::Display for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.what(), self.file_name())
    }
}

/// Why CUDA cannot be used. Its message is one line a user can act on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "{library} not found: the dynamic loader searched the system folders and \
         LD_LIBRARY_PATH={search_path}; {hint}"
    )]
    MissingLibrary {
        library: Library,
        /// LD_LIBRARY_PATH as this process saw it.
        search_path: String,
        hint: &'static str,
    },
    #[error(
        "the CUDA driver failed to initialise (cuInit: {0}); check that the NVIDIA kernel module \
         is loaded and that this process may open /dev/nvidia*"
    )]
    DriverInit(String),
    #[error("the CUDA driver reports no GPU (CUDA_VISIBLE_DEVICES={0})")]
    NoDevices(String),
    #[error("the CUDA driver could not describe GPU {ordinal}: {error}")]
    DeviceQuery { ordinal: usize, error: String },
    #[error("NVRTC is present but failed: {0}")]
    Nvrtc(String),
}

impl ProbeError {
    /// The cause in a few words, for a line that only says why the CPU was chosen
    /// (`--device auto`); the full message says what to do about it.
    pub fn summary(&self) -> String {
        match self {
            ProbeError::MissingLibrary { library, .. } => format!("{library} not found"),
            ProbeError::DriverInit(_) => "the CUDA driver failed to initialise".to_string(),
            ProbeError::NoDevices(_) => "the CUDA driver reports no GPU".to_string(),
            ProbeError::DeviceQuery { ordinal, .. } => {
                format!("GPU {ordinal} could not be queried")
            }
            ProbeError::Nvrtc(_) => "NVRTC failed".to_string(),
        }
    }
}

fn env_or_unset(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "(unset)".to_string())
}

fn hint(library: Library) -> &'static str {
    match library {
        Library::Driver => {
            "install the NVIDIA driver, or add the folder holding libcuda.so (often \
             /usr/local/nvidia/lib64 or /usr/lib/x86_64-linux-gnu) to LD_LIBRARY_PATH"
        }
        Library::Cublas => {
            "install the CUDA 13 toolkit's cuBLAS and add its lib folder (e.g. \
             /usr/local/cuda-13.0/targets/x86_64-linux/lib) to LD_LIBRARY_PATH"
        }
        Library::Cudnn => {
            "install cuDNN 9 for CUDA 13 and add its lib folder to LD_LIBRARY_PATH (one copy \
             only: mixing two cuDNN installations fails at the first call)"
        }
        Library::Nvrtc => {
            "install NVRTC 13 (the CUDA 13 toolkit, or `pip install nvidia-cuda-nvrtc`) and add \
             the folder holding libnvrtc.so.13 to LD_LIBRARY_PATH"
        }
    }
}

/// `Ok` when `library` can be opened, otherwise the error naming it.
pub fn require(library: Library) -> Result<(), ProbeError> {
    if library.is_present() {
        Ok(())
    } else {
        Err(ProbeError::MissingLibrary {
            library,
            search_path: env_or_unset("LD_LIBRARY_PATH"),
            hint: hint(library),
        })
    }
}

fn describe(ordinal: usize) -> Result<CudaDevice, ProbeError> {
    let query = |error: driver::DriverError| ProbeError::DeviceQuery {
        ordinal,
        error: error.to_string(),
    };
    let device = driver::device::get(ordinal as i32).map_err(query)?;
    let name = driver::device::get_name(device).map_err(query)?;
    // SAFETY: `device` is a handle the driver just returned.
    let (total_memory_bytes, major, minor) = unsafe {
        use driver_sys::CUdevice_attribute::*;
        (
            driver::device::total_mem(device).map_err(query)?,
            driver::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .map_err(query)?,
            driver::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                .map_err(query)?,
        )
    };
    Ok(CudaDevice {
        ordinal,
        name,
        total_memory_bytes,
        compute_capability: (major, minor),
    })
}

/// The GPUs this process can train on, with every library the backend needs present; or the first
/// thing missing, in the order a user would fix them (driver, GPUs, then the libraries).
pub fn probe() -> Result<Vec<CudaDevice>, ProbeError> {
    require(Library::Driver)?;
    driver::init().map_err(|e| {
        // A driver with no GPU visible fails its initialisation rather than counting zero.
        if e.0 == driver_sys::CUresult::CUDA_ERROR_NO_DEVICE {
            ProbeError::NoDevices(env_or_unset("CUDA_VISIBLE_DEVICES"))
        } else {
            ProbeError::DriverInit(e.to_string())
        }
    })?;
    let count = driver::device::get_count().map_err(|e| ProbeError::DriverInit(e.to_string()))?;
    if count <= 0 {
        return Err(ProbeError::NoDevices(env_or_unset("CUDA_VISIBLE_DEVICES")));
    }
    let devices = (0..count as usize)
        .map(describe)
        .collect::<Result<Vec<_>, _>>()?;
    for library in [Library::Cublas, Library::Cudnn, Library::Nvrtc] {
        require(library)?;
    }
    Ok(devices)
}

/// The NVRTC version as `(major, minor)`, once [`Library::Nvrtc`] is known to be present.
pub fn nvrtc_version() -> Result<(i32, i32), ProbeError> {
    require(Library::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); the call only writes the two integers.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    match status {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
        other => Err(ProbeError::Nvrtc(format!("nvrtcVersion: {other:?}"))),
    }
}

/// The CUDA driver's, cuDNN's and NVRTC's versions in one line (`CUDA driver 13.0, cuDNN
/// 9.13.0, NVRTC 13.0`), once [`probe`] has found them; what the profiles measured on a GPU record.
pub fn software_versions() -> Result<String, ProbeError> {
    require(Library::Driver)?;
    require(Library::Cudnn)?;
    let mut driver = 0;
    // SAFETY: the library is present; the call only writes the integer.
    let status = unsafe { driver_sys::cuDriverGetVersion(&mut driver) };
    if status != driver_sys::CUresult::CUDA_SUCCESS {
        return Err(ProbeError::DriverInit(format!(
            "cuDriverGetVersion: {status:?}"
        )));
    }
    let cudnn = cudarc::cudnn::result::get_version();
    let (nvrtc_major, nvrtc_minor) = nvrtc_version()?;
    Ok(format!(
        "CUDA driver {}.{}, cuDNN {}.{}.{}, NVRTC {nvrtc_major}.{nvrtc_minor}",
        driver / 1000,
        driver % 1000 / 10,
        cudnn / 10000,
        cudnn % 10000 / 100,
        cudnn % 100
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_what_is_missing_in_one_line() {
        match probe() {
            Ok(devices) => {
                assert!(!devices.is_empty());
                for device in &devices {
                    println!("found {device}");
                }
            }
            Err(error) => {
                let message = error.to_string();
                println!("probe: {message}");
                assert!(!message.contains('\n'), "{message}");
                if !Library::Driver.is_present() {
                    assert!(
                        matches!(
                            error,
                            ProbeError::MissingLibrary {
                                library: Library::Driver,
                                ..
                            }
                        ),
                        "{error:?}"
                    );
                    assert!(message.contains("libcuda.so"), "{message}");
                    assert!(message.contains("LD_LIBRARY_PATH="), "{message}");
                }
            }
        }
    }

    #[test]
    fn missing_libraries_are_named_with_a_remedy() {
        for library in [
            Library::Driver,
            Library::Cublas,
            Library::Cudnn,
            Library::Nvrtc,
        ] {
            match require(library) {
                Ok(()) => println!("{library} present"),
                Err(error) => {
                    let message = error.to_string();
                    assert!(message.contains(library.file_name()), "{message}");
                    assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                }
            }
        }
    }
}
