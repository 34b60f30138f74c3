//! Converging a node on its NodeSpec, section by section, with an idempotent plan and apply:
//! `site` (recorded), `agent` (command lanes and their credits), `allocations` (which atoms each
//! allocation gets; an assignment that overlaps one already held is refused and reported failed),
//! and `gpus` (mode and MIG layout, through the backend; a GPU an allocation holds changes only
//! once it is free). The generation counts as applied only when no section is still pending.

use std::collections::{BTreeMap, HashMap};

use better_compute_proto::v1::{NodeSpec, SectionState, SectionStatus};

use crate::backend::{GpuApply, GpuBackend};

/// Lanes and credits when the spec names none.
pub const DEFAULT_LANES: &[(&str, u32)] = &[("default", 4), ("diag", 1), ("power", 1)];

/// What the node holds after converging.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// Command lanes and their credits.
    pub lanes: HashMap<String, u32>,
    /// Allocations held, by id.
    pub allocations: BTreeMap<String, Held>,
    /// Heartbeat interval.
    pub heartbeat_ms: u32,
}

impl Applied {
    /// Before any spec: the default lanes, nothing allocated.
    pub fn initial() -> Applied {
        Applied { lanes: DEFAULT_LANES.iter().map(|(n, c)| (n.to_string(), *c)).collect(), allocations: BTreeMap::new(), heartbeat_ms: 5_000 }
    }
}

/// An allocation the node holds: its atoms for its time range (RFC 3339 UTC, as the control plane
/// writes them, so they compare as strings; empty is unbounded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// Its atoms.
    pub atoms: Vec<String>,
    /// From.
    pub starts_at: String,
    /// Until.
    pub ends_at: String,
}

impl Held {
    fn of(a: &better_compute_proto::v1::Allocation) -> Held {
        Held { atoms: a.atoms.clone(), starts_at: a.starts_at.clone(), ends_at: a.ends_at.clone() }
    }

    /// Whether the two share hardware at the same time (bookings at different times do not
    /// overlap): the same atom, or a whole GPU (`<uuid>`) and one of its MIG instances
    /// (`<uuid>/mig<k>`) or slots (`<uuid>/s<k>`).
    fn overlaps(&self, other: &Held) -> Option<String> {
        let before = |a: &str, b: &str| a.is_empty() || b.is_empty() || a < b;
        let same_time = before(&self.starts_at, &other.ends_at) && before(&other.starts_at, &self.ends_at);
        if !same_time {
            return None;
        }
        let within = |part: &str, whole: &str| part.strip_prefix(whole).is_some_and(|rest| rest.starts_with('/'));
        self.atoms.iter().find(|x| other.atoms.iter().any(|y| x == &y || within(x, y) || within(y, x))).cloned()
    }
}

/// One pass's outcome.
#[derive(Debug, Clone)]
pub struct Convergence {
    /// Each section's state.
    pub sections: Vec<SectionStatus>,
    /// Whether every section converged or failed terminally.
    pub done: bool,
    /// What the node now holds.
    pub applied: Applied,
}

fn section(name: &str, state: SectionState, message: impl Into<String>) -> SectionStatus {
    SectionStatus { section: name.to_owned(), state: state as i32, message: message.into() }
}

fn owns(gpus: &[String], atom: &str) -> Option<String> {
    gpus.iter().find(|g| atom == g.as_str() || atom.strip_prefix(g.as_str()).is_some_and(|r| r.starts_with('/'))).cloned()
}

/// Converges `spec` from what is `held` now.
pub fn converge(spec: &NodeSpec, backend: &dyn GpuBackend, held: &Applied) -> Convergence {
    let mut sections = Vec::new();
    let mut applied = held.clone();

    sections.push(section("site", SectionState::Converged, ""));

    if let Some(agent) = &spec.agent {
        if !agent.lanes.is_empty() {
            applied.lanes = agent.lanes.iter().map(|l| (l.name.clone(), l.credits)).collect();
        }
        if agent.heartbeat_interval_ms > 0 {
            applied.heartbeat_ms = agent.heartbeat_interval_ms.clamp(500, 60_000);
        }
    }
    sections.push(section("agent", SectionState::Converged, ""));

    let local_gpus: Vec<String> = match backend.inventory() {
        Ok(inv) => inv.gpus.into_iter().map(|g| g.uuid).collect(),
        Err(e) => {
            sections.push(section("allocations", SectionState::Pending, e.to_string()));
            sections.push(section("gpus", SectionState::Pending, e.to_string()));
            return Convergence { sections, done: false, applied };
        }
    };

    // Allocations: keep those still wanted unchanged; release the rest; then take new ones unless
    // they overlap what is held.
    let wanted: BTreeMap<&str, &better_compute_proto::v1::Allocation> = spec
        .allocations
        .iter()
        .flat_map(|s| s.allocations.iter())
        .map(|a| (a.allocation_id.as_str(), a))
        .collect();
    applied.allocations.retain(|id, held| wanted.get(id.as_str()).is_some_and(|a| Held::of(a) == *held));
    let mut failures = Vec::new();
    for (id, a) in &wanted {
        if applied.allocations.contains_key(*id) {
            continue;
        }
        if let Some(bad) = a.atoms.iter().find(|atom| owns(&local_gpus, atom).is_none()) {
            failures.push(format!("allocation {id}: atom {bad} is not on this node"));
            continue;
        }
        let new = Held::of(a);
        let overlap = applied.allocations.iter().find_map(|(other, held)| new.overlaps(held).map(|x| (other.clone(), x)));
        if let Some((other, atom)) = overlap {
            failures.push(format!("allocation {id}: atom {atom} is already assigned to allocation {other} for an overlapping time"));
            continue;
        }
        applied.allocations.insert(id.to_string(), new);
    }
    sections.push(if failures.is_empty() {
        section("allocations", SectionState::Converged, "")
    } else {
        section("allocations", SectionState::Failed, failures.join("; "))
    });

    // GPUs: a GPU any held allocation uses is busy.
    let busy: Vec<String> = applied.allocations.values().flat_map(|h| &h.atoms).filter_map(|atom| owns(&local_gpus, atom)).collect();
    let gpus = match &spec.gpus {
        None => section("gpus", SectionState::Converged, ""),
        Some(g) => match backend.apply_gpus(g, &busy) {
            Err(e) => section("gpus", SectionState::Pending, e.to_string()),
            Ok(outcomes) => {
                let failed: Vec<String> =
                    outcomes.iter().filter_map(|(u, o)| if let GpuApply::Failed(m) = o { Some(format!("{u}: {m}")) } else { None }).collect();
                let pending: Vec<String> =
                    outcomes.iter().filter_map(|(u, o)| if let GpuApply::Pending(m) = o { Some(format!("{u}: {m}")) } else { None }).collect();
                if !pending.is_empty() {
                    section("gpus", SectionState::Pending, pending.join("; "))
                } else if !failed.is_empty() {
                    section("gpus", SectionState::Failed, failed.join("; "))
                } else {
                    section("gpus", SectionState::Converged, "")
                }
            }
        },
    };
    sections.push(gpus);
    let done = sections.iter().all(|s| s.state != SectionState::Pending as i32);
    Convergence { sections, done, applied }
}

#[cfg(test)]
mod tests {
    use super::*;
    use better_compute_proto::v1::{Allocation, AllocationsSection};

    fn alloc(id: &str, atoms: &[&str]) -> Allocation {
        Allocation { allocation_id: id.into(), atoms: atoms.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn an_assignment_overlapping_a_held_one_is_refused_and_the_section_fails() {
        let f = crate::fake::FakeGpus::parse("fake:2xH100-80GB", "n").unwrap();
        let u = f.uuids();
        let spec = |allocs: Vec<Allocation>| NodeSpec { allocations: Some(AllocationsSection { allocations: allocs }), ..Default::default() };
        let first = converge(&spec(vec![alloc("a", &[&u[0]])]), &f, &Applied::initial());
        assert!(first.done);
        assert_eq!(first.applied.allocations.len(), 1);
        // b claims the GPU a holds: refused, reported failed (terminal, so the generation still counts).
        let second = converge(&spec(vec![alloc("a", &[&u[0]]), alloc("b", &[&u[0], &u[1]])]), &f, &first.applied);
        assert!(second.done);
        let s = second.sections.iter().find(|s| s.section == "allocations").unwrap();
        assert_eq!(s.state, SectionState::Failed as i32);
        assert!(s.message.contains("already assigned to allocation a"), "{}", s.message);
        assert_eq!(second.applied.allocations.keys().collect::<Vec<_>>(), ["a"]);
        // The same GPU for a later time is no overlap.
        let mut later = alloc("c", &[&u[0]]);
        later.starts_at = "2031-01-01T00:00:00Z".into();
        let mut now = alloc("a", &[&u[0]]);
        now.ends_at = "2030-01-01T00:00:00Z".into();
        let timed = converge(&spec(vec![now, later]), &f, &Applied::initial());
        assert_eq!(timed.applied.allocations.keys().collect::<Vec<_>>(), ["a", "c"]);
        // Once a is gone, b fits.
        let third = converge(&spec(vec![alloc("b", &[&u[0], &u[1]])]), &f, &second.applied);
        assert_eq!(third.applied.allocations.keys().collect::<Vec<_>>(), ["b"]);
        assert!(third.sections.iter().all(|s| s.state == SectionState::Converged as i32));
    }

    #[test]
    fn a_whole_gpu_overlaps_its_mig_instances_and_slots_but_not_another_gpus() {
        let held = |atoms: &[&str]| Held { atoms: atoms.iter().map(|s| s.to_string()).collect(), ..Default::default() };
        let mut checked = 0;
        for (a, b, overlap) in [
            (&["GPU-1"][..], &["GPU-1"][..], true),
            (&["GPU-1"], &["GPU-1/mig0"], true),
            (&["GPU-1/s2"], &["GPU-1"], true),
            (&["GPU-1/mig0"], &["GPU-1/mig1"], false),
            (&["GPU-1/s0"], &["GPU-1/s1"], false),
            (&["GPU-1"], &["GPU-10"], false),
            (&["GPU-1"], &["GPU-10/s0"], false),
            (&["GPU-2", "GPU-1/mig3"], &["GPU-1"], true),
        ] {
            assert_eq!(held(a).overlaps(&held(b)).is_some(), overlap, "{a:?} vs {b:?}");
            assert_eq!(held(b).overlaps(&held(a)).is_some(), overlap, "{b:?} vs {a:?}");
            checked += 1;
        }
        assert_eq!(checked, 8);
    }

    #[test]
    fn a_pending_gpu_change_keeps_the_generation_from_counting_as_applied() {
        let f = crate::fake::FakeGpus::parse("fake:1xH100-80GB", "n").unwrap();
        let u = f.uuids()[0].clone();
        let mig = better_compute_proto::v1::GpusSection {
            gpus: vec![better_compute_proto::v1::Gpu { uuid: u.clone(), mode: 2, mig_layout: vec!["7g.80gb".into()], ..Default::default() }],
        };
        let spec = NodeSpec { gpus: Some(mig), allocations: Some(AllocationsSection { allocations: vec![alloc("a", &[&u])] }), ..Default::default() };
        let c = converge(&spec, &f, &Applied::initial());
        assert!(!c.done, "{:?}", c.sections);
    }
}
