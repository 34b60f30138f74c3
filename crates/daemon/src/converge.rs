//! Converging a node on its NodeSpec, section by section, with an idempotent plan and apply:
//! `site` (recorded), `agent` (command lanes and their credits), `allocations` (which atoms each
//! allocation gets; an assignment that overlaps one already held is refused and reported failed),
//! and `gpus` (mode and MIG layout, through the backend; a GPU an allocation holds changes only
//! once it is free). The generation counts as applied only when no section is still pending.
//!
//! A GPU that holds allocations keeps the layout they were placed on: each pass first restores it
//! (the last layout applied to the GPU, journaled, or else the desired one) when the hardware lost
//! it, as a MIG layout or time-slicing is after a reboot or with fake GPUs after a daemon restart.
//! Restoring an unchanged layout is a no-op; a layout that cannot be restored is reported failed.

use std::collections::{BTreeMap, HashMap};

use better_compute_proto::v1::{Gpu, GpuMode, GpusSection, NodeSpec, SectionState, SectionStatus};

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
    /// The layout last applied to each GPU (its `gpus` section entry), by uuid; the daemon
    /// journals it, so a restart knows what its allocations were placed on.
    pub layouts: BTreeMap<String, Gpu>,
}

impl Applied {
    /// Whether an allocation held here uses `gpu` (the GPU itself or one of its atoms).
    pub fn holds_gpu(&self, gpu: &str) -> bool {
        let gpus = [gpu.to_owned()];
        self.allocations.values().flat_map(|h| &h.atoms).any(|a| owns(&gpus, a).is_some())
    }

    /// Before any spec: the default lanes, nothing allocated, no layout known.
    pub fn initial() -> Applied {
        Applied {
            lanes: DEFAULT_LANES.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            allocations: BTreeMap::new(),
            heartbeat_ms: 5_000,
            layouts: BTreeMap::new(),
        }
    }
}

/// Whether `atom` exists on its GPU laid out as `layout`: the whole GPU in exclusive mode, MIG
/// instance `k` of a MIG layout with more than `k`, slot `k` of a shared GPU with more than `k`.
fn layout_has(layout: &Gpu, atom: &str) -> bool {
    let Some(rest) = atom.strip_prefix(layout.uuid.as_str()) else { return false };
    let index = |r: &str, prefix: &str| r.strip_prefix(prefix).and_then(|k| k.parse::<usize>().ok());
    match GpuMode::try_from(layout.mode).unwrap_or(GpuMode::Unspecified) {
        GpuMode::Exclusive | GpuMode::Unspecified => rest.is_empty(),
        GpuMode::Mig => index(rest, "/mig").is_some_and(|k| k < layout.mig_layout.len()),
        GpuMode::TimeSlice | GpuMode::Mps => index(rest, "/s").is_some_and(|k| k < layout.slots as usize),
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
#[allow(clippy::too_many_lines, reason = "one section after another, in the order the daemon reports them")]
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

    // GPUs: a GPU any held allocation uses is busy; the atoms held on each.
    let mut held_atoms: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for atom in applied.allocations.values().flat_map(|h| &h.atoms) {
        if let Some(gpu) = owns(&local_gpus, atom) {
            held_atoms.entry(gpu).or_default().push(atom.clone());
        }
    }
    let busy: Vec<String> = held_atoms.keys().cloned().collect();
    let desired: BTreeMap<&str, &Gpu> = spec.gpus.iter().flat_map(|g| &g.gpus).map(|g| (g.uuid.as_str(), g)).collect();
    // First, each busy GPU gets back the layout its allocations were placed on, if the hardware
    // lost it: the last one applied, or else the desired one, whichever has every atom they hold.
    let mut unrestored = Vec::new();
    for (gpu, atoms) in &held_atoms {
        let target = [applied.layouts.get(gpu), desired.get(gpu.as_str()).copied()]
            .into_iter()
            .flatten()
            .find(|l| atoms.iter().all(|a| layout_has(l, a)))
            .cloned();
        let Some(target) = target else { continue }; // placed on another layout: the hardware keeps what it has
        match backend.apply_gpus(&GpusSection { gpus: vec![target.clone()] }, &[]) {
            Ok(outcomes) => match outcomes.into_iter().next() {
                Some((_, GpuApply::Converged)) => {
                    applied.layouts.insert(gpu.clone(), target);
                }
                Some((_, GpuApply::Pending(m) | GpuApply::Failed(m))) => {
                    unrestored.push(format!("{gpu}: its allocations' layout is not on the hardware and cannot be restored: {m}"))
                }
                None => unrestored.push(format!("{gpu}: the backend said nothing of restoring its layout")),
            },
            Err(e) => unrestored.push(format!("{gpu}: its allocations' layout cannot be restored: {e}")),
        }
    }
    let gpus = match &spec.gpus {
        None if unrestored.is_empty() => section("gpus", SectionState::Converged, ""),
        None => section("gpus", SectionState::Failed, unrestored.join("; ")),
        Some(g) => match backend.apply_gpus(g, &busy) {
            Err(e) => section("gpus", SectionState::Pending, e.to_string()),
            Ok(outcomes) => {
                for (uuid, o) in &outcomes {
                    if *o == GpuApply::Converged && let Some(d) = desired.get(uuid.as_str()) {
                        applied.layouts.insert(uuid.clone(), (*d).clone());
                    }
                }
                let failed: Vec<String> = unrestored
                    .into_iter()
                    .chain(outcomes.iter().filter_map(|(u, o)| if let GpuApply::Failed(m) = o { Some(format!("{u}: {m}")) } else { None }))
                    .collect();
                let pending: Vec<String> =
                    outcomes.iter().filter_map(|(u, o)| if let GpuApply::Pending(m) = o { Some(format!("{u}: {m}")) } else { None }).collect();
                if !pending.is_empty() {
                    section("gpus", SectionState::Pending, pending.into_iter().chain(failed).collect::<Vec<_>>().join("; "))
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
    fn an_allocation_holds_a_gpu_through_the_gpu_or_any_atom_of_it() {
        let mut a = Applied::initial();
        a.allocations.insert("r1".into(), Held { atoms: vec!["GPU-a/mig-1".into()], starts_at: String::new(), ends_at: String::new() });
        a.allocations.insert("r2".into(), Held { atoms: vec!["GPU-b".into()], starts_at: String::new(), ends_at: String::new() });
        assert!(a.holds_gpu("GPU-a"));
        assert!(a.holds_gpu("GPU-b"));
        assert!(!a.holds_gpu("GPU-c"));
        assert!(!a.holds_gpu("GPU-a/mig"), "an atom is not a GPU");
        assert!(!a.holds_gpu("GPU"), "a prefix is not a GPU");
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

    fn gpu(uuid: &str, mode: GpuMode, mig_layout: &[&str], slots: u32) -> Gpu {
        Gpu { uuid: uuid.into(), index: 0, mode: mode as i32, mig_layout: mig_layout.iter().map(|s| s.to_string()).collect(), slots }
    }

    fn state_of(c: &Convergence, name: &str) -> (i32, String) {
        let s = c.sections.iter().find(|s| s.section == name).unwrap();
        (s.state, s.message.clone())
    }

    /// Whether `backend` has `layout` now: applying it to a GPU marked busy changes nothing.
    fn has(backend: &dyn GpuBackend, layout: &Gpu) -> bool {
        let out = backend.apply_gpus(&GpusSection { gpus: vec![layout.clone()] }, std::slice::from_ref(&layout.uuid)).unwrap();
        out == vec![(layout.uuid.clone(), GpuApply::Converged)]
    }

    /// GPUs whose layout never changes (as NVML's, which the daemon does not reconfigure).
    struct Frozen(crate::fake::FakeGpus);

    impl GpuBackend for Frozen {
        fn name(&self) -> &'static str {
            "frozen"
        }
        fn inventory(&self) -> Result<better_compute_proto::v1::Inventory, crate::backend::BackendError> {
            self.0.inventory()
        }
        fn health(&self) -> Result<Vec<better_compute_proto::v1::GpuHealth>, crate::backend::BackendError> {
            self.0.health()
        }
        fn apply_gpus(&self, desired: &GpusSection, _busy: &[String]) -> Result<Vec<(String, GpuApply)>, crate::backend::BackendError> {
            let all = self.0.uuids();
            Ok(self.0.apply_gpus(desired, &all)?.into_iter().map(|(u, o)| match o {
                GpuApply::Pending(_) => (u, GpuApply::Failed("this backend cannot change a layout".into())),
                o => (u, o),
            }).collect())
        }
        fn diag(&self, req: &better_compute_proto::v1::DiagNvml) -> Result<serde_json::Value, crate::backend::BackendError> {
            self.0.diag(req)
        }
    }

    #[test]
    fn a_gpu_holding_allocations_gets_its_layout_back_after_a_restart_and_the_truth_is_reported_when_it_cannot() {
        let fresh = || crate::fake::FakeGpus::parse("fake:1xH100-80GB", "n").unwrap();
        let u = fresh().uuids()[0].clone();
        let mig = gpu(&u, GpuMode::Mig, &["3g.40gb", "3g.40gb"], 0);
        let shared = gpu(&u, GpuMode::TimeSlice, &[], 4);
        let spec = |layout: &Gpu, atom: &str| NodeSpec {
            gpus: Some(GpusSection { gpus: vec![layout.clone()] }),
            allocations: Some(AllocationsSection { allocations: vec![alloc("a", &[atom])] }),
            ..Default::default()
        };
        let mut checked = 0;
        for (layout, atom) in [(&mig, format!("{u}/mig1")), (&shared, format!("{u}/s2"))] {
            let before = fresh();
            let first = converge(&spec(layout, &atom), &before, &Applied::initial());
            assert!(first.done && has(&before, layout), "{:?}", first.sections);
            assert_eq!(first.applied.layouts.get(&u), Some(layout));
            // The daemon restarts on hardware that lost the layout (a new fake is exclusive), with
            // its journal (the layouts) or without it (the desired layout has the atoms too).
            for journaled in [true, false] {
                let after = fresh();
                assert!(!has(&after, layout));
                let held = Applied { layouts: if journaled { first.applied.layouts.clone() } else { BTreeMap::new() }, ..Applied::initial() };
                let c = converge(&spec(layout, &atom), &after, &held);
                assert!(c.done, "journaled {journaled}: {:?}", c.sections);
                assert_eq!(state_of(&c, "gpus").0, SectionState::Converged as i32);
                assert!(has(&after, layout), "journaled {journaled}: the layout was not restored");
                checked += 1;
            }
        }
        // The desired layout moved on while the GPU was held: the journaled one is restored, and
        // the change still waits for the GPU to be free.
        let before = fresh();
        let atom = format!("{u}/mig1");
        let first = converge(&spec(&mig, &atom), &before, &Applied::initial());
        let after = fresh();
        let exclusive = gpu(&u, GpuMode::Exclusive, &[], 0);
        let c = converge(&spec(&exclusive, &atom), &after, &Applied { layouts: first.applied.layouts.clone(), ..Applied::initial() });
        assert!(!c.done);
        assert_eq!(state_of(&c, "gpus").0, SectionState::Pending as i32);
        assert!(has(&after, &mig), "the allocation's layout was not restored");
        // Hardware that cannot be changed back is reported, not called converged.
        let frozen = Frozen(fresh());
        let c = converge(&spec(&mig, &atom), &frozen, &Applied { layouts: first.applied.layouts.clone(), ..Applied::initial() });
        let (state, message) = state_of(&c, "gpus");
        assert_eq!(state, SectionState::Failed as i32, "{message}");
        assert!(message.contains("cannot be restored"), "{message}");
        checked += 2;
        assert_eq!(checked, 6);
    }
}
