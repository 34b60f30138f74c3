//! GPU modes (whole, MIG with its profiles, time-sliced, MPS) and the atoms each exposes: the
//! vocabulary the inventory, the placer and the daemon share.

use crate::Error;
use serde::{Deserialize, Serialize};

/// How a GPU is shared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum GpuMode {
    /// The whole GPU is one atom.
    Exclusive,
    /// MIG: one atom per instance of the layout, e.g. `["3g.40gb", "3g.40gb"]`.
    Mig {
        /// Instance profiles, in order.
        layout: Vec<String>,
    },
    /// Time-slicing: `slots` atoms `<uuid>/s<k>`.
    TimeSlice {
        /// How many slots.
        slots: u16,
    },
    /// MPS: `slots` atoms `<uuid>/s<k>`.
    Mps {
        /// How many slots.
        slots: u16,
    },
}

/// Most MIG compute slices a GPU has.
pub const MIG_SLICES: u32 = 7;
/// Most slots a shared GPU may be cut into.
pub const MAX_SLOTS: u16 = 48;

/// The atom kinds: a whole GPU, a MIG instance, a shared slot.
pub const ATOM_KINDS: [&str; 3] = ["gpu", "mig", "slot"];

/// Parses a MIG profile `<slices>g.<memory>gb` into (compute slices, memory in GiB).
pub fn parse_mig_profile(profile: &str) -> Option<(u32, u32)> {
    let (g, mem) = profile.split_once("g.")?;
    let mem = mem.strip_suffix("gb")?;
    let g: u32 = g.parse().ok()?;
    let mem: u32 = mem.parse().ok()?;
    ([1, 2, 3, 4, 7].contains(&g) && (1..=192).contains(&mem)).then_some((g, mem))
}

impl GpuMode {
    /// The stored mode name.
    pub fn name(&self) -> &'static str {
        match self {
            GpuMode::Exclusive => "exclusive",
            GpuMode::Mig { .. } => "mig",
            GpuMode::TimeSlice { .. } => "time-slice",
            GpuMode::Mps { .. } => "mps",
        }
    }

    /// Checks the mode against a GPU with `memory_mib` of memory.
    pub fn validate(&self, memory_mib: i32) -> Result<(), Error> {
        match self {
            GpuMode::Exclusive => Ok(()),
            GpuMode::Mig { layout } => {
                if layout.is_empty() {
                    return Err(Error::invalid_argument("mig layout must name at least one instance profile"));
                }
                let mut slices = 0;
                for p in layout {
                    let (g, mem) = parse_mig_profile(p).ok_or_else(|| {
                        Error::invalid_argument(format!("mig layout: {p:?} is not a MIG profile like \"3g.40gb\""))
                    })?;
                    if mem as i64 * 1024 > memory_mib as i64 {
                        return Err(Error::invalid_argument(format!("mig layout: {p} needs more memory than the GPU has")));
                    }
                    slices += g;
                }
                if slices > MIG_SLICES {
                    return Err(Error::invalid_argument(format!(
                        "mig layout uses {slices} compute slices; a GPU has {MIG_SLICES}"
                    )));
                }
                Ok(())
            }
            GpuMode::TimeSlice { slots } | GpuMode::Mps { slots } => {
                if *slots == 0 || *slots > MAX_SLOTS {
                    return Err(Error::invalid_argument(format!("slots must be between 1 and {MAX_SLOTS}")));
                }
                Ok(())
            }
        }
    }

    /// The MIG layout column.
    pub fn mig_layout(&self) -> Vec<String> {
        match self {
            GpuMode::Mig { layout } => layout.clone(),
            _ => Vec::new(),
        }
    }

    /// The slots column.
    pub fn slots(&self) -> i16 {
        match self {
            GpuMode::TimeSlice { slots } | GpuMode::Mps { slots } => *slots as i16,
            _ => 0,
        }
    }

    /// The child atoms of a GPU `uuid` in this mode: (id, kind, index, profile, memory MiB).
    pub fn child_atoms(&self, uuid: &str, memory_mib: i32) -> Vec<ChildAtom> {
        match self {
            GpuMode::Exclusive => Vec::new(),
            GpuMode::Mig { layout } => layout
                .iter()
                .enumerate()
                .map(|(k, p)| ChildAtom {
                    id: format!("{uuid}/mig{k}"),
                    kind: "mig",
                    index: k as i16,
                    profile: Some(p.clone()),
                    memory_mib: parse_mig_profile(p).map(|(_, m)| m as i32 * 1024).unwrap_or(1024),
                })
                .collect(),
            GpuMode::TimeSlice { slots } | GpuMode::Mps { slots } => (0..*slots)
                .map(|k| ChildAtom {
                    id: format!("{uuid}/s{k}"),
                    kind: "slot",
                    index: k as i16,
                    profile: None,
                    memory_mib: (memory_mib / *slots as i32).max(1),
                })
                .collect(),
        }
    }
}

/// An atom that is a child of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildAtom {
    /// `<uuid>/mig<k>` or `<uuid>/s<k>`.
    pub id: String,
    /// `mig` or `slot`.
    pub kind: &'static str,
    /// Its position.
    pub index: i16,
    /// Its MIG profile.
    pub profile: Option<String>,
    /// Its memory.
    pub memory_mib: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_layouts_are_checked_against_the_gpus_slices_and_memory() {
        let gpu = 81_920;
        assert!(GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }.validate(gpu).is_ok());
        assert!(GpuMode::Mig { layout: vec!["4g.40gb".into(), "4g.40gb".into()] }.validate(gpu).is_err());
        assert!(GpuMode::Mig { layout: vec!["7g.160gb".into()] }.validate(gpu).is_err());
        assert!(GpuMode::Mig { layout: vec!["big".into()] }.validate(gpu).is_err());
        assert!(GpuMode::Mig { layout: vec![] }.validate(gpu).is_err());
        assert!(GpuMode::TimeSlice { slots: 0 }.validate(gpu).is_err());
    }

    #[test]
    fn children_are_named_after_the_gpu() {
        let atoms = GpuMode::TimeSlice { slots: 2 }.child_atoms("GPU-1", 80_000);
        assert_eq!(atoms.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(), ["GPU-1/s0", "GPU-1/s1"]);
        let mig = GpuMode::Mig { layout: vec!["1g.10gb".into()] }.child_atoms("GPU-1", 80_000);
        assert_eq!((mig[0].id.as_str(), mig[0].memory_mib), ("GPU-1/mig0", 10_240));
        assert!(GpuMode::Exclusive.child_atoms("GPU-1", 1).is_empty());
    }
}
