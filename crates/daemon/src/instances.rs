//! Converging the `instances` section (vps-host nodes): every instance it names exists as a VM,
//! running or stopped as asked, on an allocation this node holds; every other VM is deleted, disk
//! and all. What the machine then has is reported with the spec status.

use better_compute_proto::v1::{InstanceObserved, NodeSpec, SectionState, SectionStatus};

use crate::converge::Applied;
use crate::hypervisor::{Hypervisor, HypervisorError, VmPower, VmSpec};

/// The section's outcome and what the machine has (`None` when the spec has no `instances`
/// section: not a vps-host node).
pub fn converge(spec: &NodeSpec, hv: Option<&dyn Hypervisor>, held: &Applied) -> Option<(SectionStatus, Vec<InstanceObserved>)> {
    let section = spec.instances.as_ref()?;
    let status = |state: SectionState, message: String| SectionStatus { section: "instances".into(), state: state as i32, message };
    let Some(hv) = hv else {
        let why = "this daemon runs no hypervisor: start it with --hypervisor qemu (or fake)".to_owned();
        let failed = section.instances.iter().map(|i| InstanceObserved { instance_id: i.instance_id.clone(), state: "failed".into(), message: why.clone(), ..Default::default() }).collect();
        return Some((status(if section.instances.is_empty() { SectionState::Converged } else { SectionState::Failed }, why), failed));
    };
    let allocations = spec.allocations.iter().flat_map(|a| &a.allocations);
    let (mut refused, mut pending) = (Vec::<(String, String)>::new(), Vec::<String>::new());
    for i in &section.instances {
        // A VM only on an allocation this node holds: its atoms are not anyone else's.
        let Some(a) = allocations.clone().find(|a| a.allocation_id == i.allocation_id && held.allocations.contains_key(&a.allocation_id)) else {
            refused.push((i.instance_id.clone(), format!("allocation {} is not held on this node", i.allocation_id)));
            continue;
        };
        let vm = VmSpec {
            instance_id: i.instance_id.clone(),
            allocation_id: a.allocation_id.clone(),
            vcpu: a.vcpu,
            memory_mib: a.memory_mib,
            disk_gib: a.disk_gib,
            image: i.image.clone(),
            ssh_public_keys: i.ssh_public_keys.clone(),
            user_data: i.user_data.clone(),
            atoms: a.atoms.clone(),
        };
        match hv.ensure(&vm, i.running, i.reboot_count) {
            Ok(()) => {}
            Err(HypervisorError::Refused(m)) => refused.push((i.instance_id.clone(), m)),
            Err(e) => pending.push(format!("{}: {e}", i.instance_id)),
        }
    }
    let vms = match hv.list() {
        Ok(v) => v,
        Err(e) => return Some((status(SectionState::Pending, e.to_string()), Vec::new())),
    };
    for vm in vms.iter().filter(|v| !section.instances.iter().any(|i| i.instance_id == v.instance_id)) {
        if let Err(e) = hv.delete(&vm.instance_id) {
            pending.push(format!("{}: cannot delete: {e}", vm.instance_id));
        }
    }
    let vms = hv.list().unwrap_or(vms);
    let mut observed: Vec<InstanceObserved> = vms
        .iter()
        .map(|v| InstanceObserved {
            instance_id: v.instance_id.clone(),
            state: if v.power == VmPower::Running { "running" } else { "stopped" }.into(),
            message: String::new(),
            address: v.address.clone(),
            host_key_fingerprint: v.host_key_fingerprint.clone(),
            reboot_count: v.reboot_count,
        })
        .collect();
    for (id, why) in &refused {
        observed.retain(|o| &o.instance_id != id);
        observed.push(InstanceObserved { instance_id: id.clone(), state: "failed".into(), message: why.clone(), ..Default::default() });
    }
    observed.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
    let st = if !pending.is_empty() {
        status(SectionState::Pending, pending.join("; "))
    } else if !refused.is_empty() {
        status(SectionState::Failed, refused.iter().map(|(i, m)| format!("{i}: {m}")).collect::<Vec<_>>().join("; "))
    } else {
        status(SectionState::Converged, String::new())
    };
    Some((st, observed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::converge::Held;
    use crate::hypervisor::FakeHypervisor;
    use better_compute_proto::v1::{Allocation, AllocationsSection, Instance, InstancesSection};

    fn spec(instances: Vec<Instance>) -> NodeSpec {
        let alloc = |id: &str, atom: &str| Allocation { allocation_id: id.into(), atoms: vec![atom.into()], vcpu: 4, memory_mib: 4096, disk_gib: 20, ..Default::default() };
        NodeSpec {
            allocations: Some(AllocationsSection { allocations: vec![alloc("res_a", "GPU-1"), alloc("res_b", "GPU-2/mig0")] }),
            instances: Some(InstancesSection { instances }),
            ..Default::default()
        }
    }

    fn instance(id: &str, alloc: &str, running: bool) -> Instance {
        Instance { instance_id: id.into(), allocation_id: alloc.into(), running, image: "debian-12".into(), ..Default::default() }
    }

    fn held(ids: &[&str]) -> Applied {
        let mut a = Applied::initial();
        for id in ids {
            a.allocations.insert(id.to_string(), Held::default());
        }
        a
    }

    #[test]
    fn the_host_runs_exactly_the_named_vms_on_allocations_it_holds_and_deletes_the_rest() {
        let hv = FakeHypervisor::new(None);
        let held = held(&["res_a", "res_b"]);
        let (st, obs) = converge(&spec(vec![instance("ins_1", "res_a", true), instance("ins_2", "res_b", true), instance("ins_3", "res_x", true)]), Some(&hv), &held).unwrap();
        assert_eq!(st.state, SectionState::Failed as i32, "{st:?}");
        let states: Vec<(&str, &str)> = obs.iter().map(|o| (o.instance_id.as_str(), o.state.as_str())).collect();
        assert_eq!(states, [("ins_1", "running"), ("ins_2", "failed"), ("ins_3", "failed")], "a MIG atom without vGPU, and an allocation not held, are refused");
        assert!(obs[2].message.contains("not held"), "{:?}", obs[2]);
        // Stopped, then gone: the VM not named any more is deleted.
        let (st, obs) = converge(&spec(vec![instance("ins_1", "res_a", false)]), Some(&hv), &held).unwrap();
        assert_eq!((st.state, obs.len(), obs[0].state.as_str()), (SectionState::Converged as i32, 1, "stopped"));
        let (_, obs) = converge(&spec(vec![]), Some(&hv), &held).unwrap();
        assert_eq!((obs.len(), hv.list().unwrap().len()), (0, 0));
        // No section, nothing to say; no hypervisor, every instance failed with the reason.
        assert!(converge(&NodeSpec::default(), Some(&hv), &held).is_none());
        let (st, obs) = converge(&spec(vec![instance("ins_1", "res_a", true)]), None, &held).unwrap();
        assert_eq!((st.state, obs.len(), obs[0].state.as_str()), (SectionState::Failed as i32, 1, "failed"));
    }
}
