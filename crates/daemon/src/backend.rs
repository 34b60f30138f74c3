//! The GPU backend contract: what the daemon asks of the hardware. [`crate::nvml`] talks to real
//! GPUs through NVML; [`crate::fake`] simulates them for tests, `dev` and the simulator.

use better_compute_proto::v1::{DiagNvml, GpuHealth, GpusSection, Inventory};

/// Why the backend could not do something.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The backend is not there (no NVML library, no driver).
    #[error("GPU backend unavailable: {0}")]
    Unavailable(String),
    /// A call failed.
    #[error("GPU backend: {0}")]
    Failed(String),
    /// A `--gpus` value that does not parse.
    #[error("invalid --gpus value {value:?}: {why} (expected nvml, or fake:<count>x<model>-<memory>GB[,…] such as fake:8xH100-80GB)")]
    BadSpec {
        /// The value.
        value: String,
        /// What is wrong.
        why: String,
    },
}

/// How applying one GPU's part of the `gpus` section went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuApply {
    /// It already was, or now is, as desired.
    Converged,
    /// Not yet (busy, or waiting for something); the daemon tries again.
    Pending(String),
    /// It cannot be done; trying again will not help.
    Failed(String),
}

/// Whether an XID says the GPU is not fit (transient or fatal in the catalogue,
/// `better_compute_core::xid`); the control plane's health job decides what follows.
pub fn xid_is_critical(xid: u32) -> bool {
    better_compute_core::xid::classify(xid) != better_compute_core::xid::XidClass::Informational
}

/// Called by a backend when a health event (an XID) arrives, so the daemon reports it at once.
pub type HealthWake = std::sync::Arc<dyn Fn() + Send + Sync>;

/// A GPU backend. Calls may block (NVML does); the daemon runs them off its async threads.
pub trait GpuBackend: Send + Sync + 'static {
    /// `nvml` or `fake`.
    fn name(&self) -> &'static str;

    /// The GPUs (the host's vCPU, memory and disk are filled in by the daemon).
    fn inventory(&self) -> Result<Inventory, BackendError>;

    /// Each GPU's health: XID errors seen since the last call (none lost between calls), ECC
    /// counts, retired pages and remapped rows, NVLink errors, temperature, PCIe link, throttling.
    fn health(&self) -> Result<Vec<GpuHealth>, BackendError>;

    /// Calls `wake` whenever a health event arrives, from then on for the daemon's life, so an
    /// XID is reported as it happens rather than at the next heartbeat. A backend without events
    /// ignores it.
    fn watch_health(&self, _wake: HealthWake) {}

    /// Plans and applies the `gpus` section (mode and MIG layout per GPU); idempotent. `busy` are
    /// the GPUs an allocation holds now: their mode must not change under a workload.
    fn apply_gpus(&self, desired: &GpusSection, busy: &[String]) -> Result<Vec<(String, GpuApply)>, BackendError>;

    /// Runs diagnostics and returns the report.
    fn diag(&self, req: &DiagNvml) -> Result<serde_json::Value, BackendError>;

    /// Resets one GPU (nothing may be running on it: the daemon checks that no allocation holds
    /// it). A backend that cannot says so.
    fn reset(&self, _uuid: &str) -> Result<(), BackendError> {
        Err(BackendError::Failed("this backend cannot reset a GPU".into()))
    }
}

/// Opens the backend a `--gpus` value names: `nvml`, or `fake:…` (seeded by `seed`, so a node's
/// fake GPUs keep their uuids across restarts).
pub fn open(value: &str, seed: &str) -> Result<std::sync::Arc<dyn GpuBackend>, BackendError> {
    if value == "nvml" {
        return Ok(std::sync::Arc::new(crate::nvml::NvmlBackend::open()?));
    }
    Ok(std::sync::Arc::new(crate::fake::FakeGpus::parse(value, seed)?))
}
