//! The XID catalogue: what an NVIDIA driver's XID error says about the GPU, and so what the
//! `health` job does about it.
//!
//! Source: NVIDIA, "XID Errors" (GPU deployment and management documentation,
//! <https://docs.nvidia.com/deploy/xid-errors/index.html>), whose catalogue lists for each XID its
//! likely causes (user application, driver, thermal, hardware) and the recovery it needs (restart
//! the application, reset the GPU, reboot, or replace the board). The classes here follow it:
//!
//! - **informational**: caused by the application or recorded for later (a page fault in user
//!   code, a page retirement being recorded); the GPU is fine;
//! - **transient**: the GPU needs a check and usually a reset (a micro-controller halt, an
//!   uncontained ECC error, an NVLink or GSP error); it leaves placement, is checked with
//!   `diag.nvml`, and comes back after clean checks;
//! - **fatal**: hardware (the GPU fell off the bus, page retirement or row remapping failed); it is
//!   quarantined until an operator decides.
//!
//! An XID not listed is treated as transient: checked, never ignored and never condemned unseen.

/// What an XID says about the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XidClass {
    /// The application's doing, or a record; the GPU is fine.
    Informational,
    /// Recoverable, usually by a GPU reset: check it before it takes work again.
    Transient,
    /// Hardware: quarantine it.
    Fatal,
}

impl XidClass {
    /// `informational`, `transient` or `fatal`.
    pub fn as_str(self) -> &'static str {
        match self {
            XidClass::Informational => "informational",
            XidClass::Transient => "transient",
            XidClass::Fatal => "fatal",
        }
    }
}

/// The catalogue: XID, class, and NVIDIA's short description.
pub const XIDS: &[(u32, XidClass, &str)] = &[
    (13, XidClass::Informational, "Graphics Engine Exception (usually the application)"),
    (31, XidClass::Informational, "GPU memory page fault (usually the application)"),
    (32, XidClass::Transient, "Invalid or corrupted push buffer stream"),
    (38, XidClass::Transient, "Driver firmware error"),
    (43, XidClass::Informational, "GPU stopped processing (the application)"),
    (45, XidClass::Informational, "Preemptive cleanup, due to previous errors"),
    (48, XidClass::Transient, "Double Bit ECC Error: the page is retired or the row remapped at the next reset"),
    (56, XidClass::Transient, "Display engine error"),
    (57, XidClass::Transient, "Error programming video memory interface"),
    (58, XidClass::Transient, "Unstable video memory interface detected"),
    (61, XidClass::Transient, "Internal micro-controller breakpoint/warning"),
    (62, XidClass::Transient, "Internal micro-controller halt"),
    (63, XidClass::Informational, "ECC page retirement or row remapping recording event"),
    (64, XidClass::Fatal, "ECC page retirement or row remapper recording failure"),
    (68, XidClass::Transient, "NVDEC0 Exception"),
    (69, XidClass::Transient, "Graphics Engine class error"),
    (74, XidClass::Transient, "NVLink Error"),
    (79, XidClass::Fatal, "GPU has fallen off the bus"),
    (92, XidClass::Informational, "High single-bit ECC error rate"),
    (94, XidClass::Transient, "Contained ECC error"),
    (95, XidClass::Transient, "Uncontained ECC error"),
    (119, XidClass::Transient, "GSP RPC Timeout"),
    (120, XidClass::Transient, "GSP Error"),
    (121, XidClass::Transient, "C2C Link Error"),
    (140, XidClass::Transient, "Unrecovered ECC Error"),
    (154, XidClass::Informational, "GPU Recovery Action Changed"),
];

/// The class of `xid` (transient when the catalogue does not list it).
pub fn classify(xid: u32) -> XidClass {
    XIDS.iter().find(|(x, _, _)| *x == xid).map_or(XidClass::Transient, |(_, c, _)| *c)
}

/// NVIDIA's description of `xid`, or `unlisted XID`.
pub fn describe(xid: u32) -> &'static str {
    XIDS.iter().find(|(x, _, _)| *x == xid).map_or("unlisted XID", |(_, _, d)| d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_classifies_the_xids_an_operator_meets_most() {
        assert_eq!(classify(79), XidClass::Fatal, "fallen off the bus");
        assert_eq!(classify(64), XidClass::Fatal);
        assert_eq!(classify(48), XidClass::Transient);
        assert_eq!(classify(13), XidClass::Informational, "the application's own fault");
        assert_eq!(classify(99_999), XidClass::Transient, "unlisted: checked, not ignored");
        let mut seen = std::collections::HashSet::new();
        assert!(XIDS.iter().all(|(x, _, d)| seen.insert(*x) && !d.is_empty()), "each XID once, described");
        assert_eq!(seen.len(), XIDS.len());
    }
}
