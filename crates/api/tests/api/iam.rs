//! IAM through the API, against a model of the rule built independently of the server.

use super::*;

/// The IAM rule, modelled independently of the server: which `(permission, scope)` grants a set
/// of bindings confers, and whether one set covers another.
mod iam_model {
    use std::collections::{BTreeMap, BTreeSet};

    /// `(kind, id)`: `("fleet", "")`, `("tenant", ten)`, `("site", s)`, `("pool", p)`, `("node", n)`.
    pub type Scope = (&'static str, String);

    pub fn tenant_perm(p: &str) -> bool {
        ["compute:reservations:", "compute:instances:", "compute:webhooks:", "iam:identities:", "iam:bindings:"].iter().any(|x| p.starts_with(x))
            || p == "compute:quotas:read"
            || p == "compute:usage:read"
            || p == "compute:audit:read"
    }

    fn applies(p: &str, kind: &str) -> bool {
        if kind == "tenant" { tenant_perm(p) } else { !tenant_perm(p) || p == "compute:quotas:read" || p == "compute:usage:read" || p == "compute:audit:read" }
    }

    pub struct World {
        pub roles: BTreeMap<String, Vec<String>>,
        pub tenant: String,
        /// Each inventory scope with the scopes that cover it, itself included.
        pub paths: BTreeMap<Scope, Vec<Scope>>,
    }

    impl World {
        pub fn grants(&self, bindings: &[(String, Scope)]) -> BTreeSet<(String, Scope)> {
            let mut out = BTreeSet::new();
            for (role, scope) in bindings {
                for p in &self.roles[role] {
                    if applies(p, scope.0) {
                        out.insert((p.clone(), scope.clone()));
                    }
                }
            }
            out
        }

        pub fn has(&self, grants: &BTreeSet<(String, Scope)>, p: &str, at: &Scope) -> bool {
            let covering: Vec<Scope> = if at.0 == "tenant" { vec![at.clone()] } else { self.paths[at].clone() };
            covering.iter().any(|s| grants.contains(&(p.to_owned(), s.clone())))
        }

        pub fn dominates(&self, actor: &BTreeSet<(String, Scope)>, target: &BTreeSet<(String, Scope)>) -> bool {
            target.iter().all(|(p, s)| self.has(actor, p, s))
        }

        pub fn holds_role(&self, actor: &BTreeSet<(String, Scope)>, role: &str, at: &Scope) -> bool {
            self.roles[role].iter().all(|p| {
                let scope = if applies(p, at.0) {
                    at.clone()
                } else if tenant_perm(p) {
                    ("tenant", self.tenant.clone())
                } else {
                    ("fleet", String::new())
                };
                self.has(actor, p, &scope)
            })
        }
    }
}

/// Expected HTTP status of a decision: 200 when allowed, else the refusal's.
fn expect(allowed: bool, refused: u16) -> u16 {
    if allowed { 200 } else { refused }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "a test: one loop over every role, scope and IAM method, asserting as it goes")]
async fn every_iam_method_refuses_acting_on_an_identity_mightier_than_the_caller_for_every_role_and_scope() {
    use iam_model::{Scope, World};
    let api = Api::start().await;
    let roles: Vec<(String, Vec<String>)> = api.ok(&api.op, "roles.list", json!({})).await["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_owned(), r["permissions"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect()))
        .collect();
    assert_eq!(roles.len(), 6, "the built-in roles: {roles:?}");
    let names: Vec<String> = roles.iter().map(|r| r.0.clone()).collect();
    let site = api.ok(&api.op, "pools.get", json!({"poolId": api.pool})).await["siteId"].as_str().unwrap().to_owned();
    let mut db = api.h.db().connect().await;
    let tx = db.transaction().await.unwrap();
    let made = better_compute_iam::bootstrap::tenant_with_admin(&tx, "matrix", "root", false).await.unwrap();
    let ten = made.tenant.id.clone();
    let fleet: Scope = ("fleet", String::new());
    let (s_site, s_pool, s_node): (Scope, Scope, Scope) = (("site", site.clone()), ("pool", api.pool.clone()), ("node", api.node.clone()));
    let world = World {
        roles: roles.iter().cloned().collect(),
        tenant: ten.clone(),
        paths: [
            (fleet.clone(), vec![fleet.clone()]),
            (s_site.clone(), vec![fleet.clone(), s_site.clone()]),
            (s_pool.clone(), vec![fleet.clone(), s_site.clone(), s_pool.clone()]),
            (s_node.clone(), vec![fleet.clone(), s_site.clone(), s_pool.clone(), s_node.clone()]),
        ]
        .into_iter()
        .collect(),
    };
    let tenant: Scope = ("tenant", ten.clone());
    let all_scopes = [fleet.clone(), tenant.clone(), s_site.clone(), s_pool.clone(), s_node.clone()];
    let mut seq = 0;
    // An identity of the tenant with these bindings (written directly, as an operator with the
    // database would) and a token for it.
    let mut identity = async |bindings: &[(String, Scope)]| -> (String, String, String, Vec<String>) {
        seq += 1;
        let idn = better_compute_iam::directory::create_identity(&tx, &ten, &format!("i{seq}"), "service").await.unwrap().id;
        let mut rbs = Vec::new();
        for (role, (kind, id)) in bindings {
            let rb = format!("rb_m{seq}_{}", rbs.len());
            tx.execute("INSERT INTO role_bindings (id, tenant_id, identity_id, role, scope_kind, scope_id) VALUES ($1, $2, $3, $4, $5, $6)", &[&rb, &ten, &idn, role, kind, id])
                .await
                .unwrap();
            rbs.push(rb);
        }
        better_compute_iam::bindings::project(&tx, &idn).await.unwrap();
        let tok = better_compute_iam::tokens::issue(&tx, &ten, None, &idn, "m", None).await.unwrap();
        (idn, tok.token.id, tok.secret, rbs)
    };
    // Callers: each role at tenant scope, at fleet scope, and at fleet scope beside `admin` at
    // tenant scope (an operator who also administers the tenant).
    let mut callers = Vec::new();
    for r in &names {
        callers.push(vec![(r.clone(), tenant.clone())]);
        callers.push(vec![(r.clone(), fleet.clone())]);
        callers.push(vec![("admin".to_owned(), tenant.clone()), (r.clone(), fleet.clone())]);
    }
    // Targets: nothing, or each role at each scope.
    let mut targets: Vec<Vec<(String, Scope)>> = vec![vec![]];
    for r in &names {
        for s in &all_scopes {
            targets.push(vec![(r.clone(), s.clone())]);
        }
    }
    let mut cells = Vec::new();
    for c in &callers {
        let caller = identity(c).await;
        let mut ts = Vec::new();
        for t in &targets {
            ts.push((t.clone(), identity(t).await));
        }
        let mut fresh = Vec::new();
        for _ in 0..names.len() * all_scopes.len() {
            fresh.push(identity(&[]).await);
        }
        cells.push((c.clone(), caller, ts, fresh));
    }
    tx.commit().await.unwrap();
    let other = api.tenant("other").await;

    let mut checked = 0;
    let mut allowed_acts = 0;
    for (c, (_, _, secret, _), ts, fresh) in &cells {
        let cg = world.grants(c);
        let has = |p: &str, at: &Scope| world.has(&cg, p, at);
        let who = format!("caller {c:?}");
        // Methods that act on no identity.
        for (m, body, want) in [
            ("roles.list", json!({}), 200),
            ("identities.list", json!({}), expect(has("iam:identities:read", &tenant), 403)),
            ("tokens.list", json!({}), expect(has("iam:identities:read", &tenant), 403)),
            ("roleBindings.list", json!({}), expect(has("iam:bindings:read", &tenant), 403)),
            ("tenants.list", json!({}), expect(has("iam:tenants:read", &fleet), 403)),
            ("tenants.get", json!({"tenantId": other.id}), expect(has("iam:tenants:read", &fleet), 404)),
            ("identities.create", json!({"name": format!("new{checked}"), "kind": "person"}), expect(has("iam:identities:write", &tenant), 403)),
            ("tenants.create", json!({"name": format!("made{checked}")}), expect(has("iam:tenants:write", &fleet), 403)),
        ] {
            let (s, v) = api.call(secret, m, body).await;
            assert_eq!(s, want, "{who}: {m}: {v}");
            checked += 1;
        }
        // Acting on each target: a token, a revocation, a binding, an unbinding.
        for (t, (idn, tok, _, rbs)) in ts {
            let mut tg = world.grants(t);
            let who = format!("{who} on target {t:?}");
            let may_act = |tg: &std::collections::BTreeSet<_>| world.dominates(&cg, tg);
            let (s, v) = api.call(secret, "tokens.create", json!({"identityId": idn})).await;
            assert_eq!(s, expect(has("iam:identities:write", &tenant) && may_act(&tg), 403), "{who}: tokens.create: {v}");
            allowed_acts += usize::from(s == 200);
            let (s, v) = api.call(secret, "tokens.revoke", json!({"tokenId": tok})).await;
            assert_eq!(s, expect(has("iam:identities:write", &tenant) && may_act(&tg), 403), "{who}: tokens.revoke: {v}");
            let (s, v) = api.call(secret, "roleBindings.create", json!({"identityId": idn, "role": "member", "scopeKind": "tenant"})).await;
            let bound = has("iam:bindings:write", &tenant) && may_act(&tg) && world.holds_role(&cg, "member", &tenant);
            assert_eq!(s, expect(bound, 403), "{who}: roleBindings.create: {v}");
            if bound {
                tg.extend(world.grants(&[("member".to_owned(), tenant.clone())]));
            }
            for rb in rbs {
                let (s, v) = api.call(secret, "roleBindings.delete", json!({"roleBindingId": rb})).await;
                assert_eq!(s, expect(has("iam:bindings:write", &tenant) && may_act(&tg), 403), "{who}: roleBindings.delete: {v}");
            }
            checked += 3 + rbs.len();
        }
        // Binding each role at each scope to an identity that holds nothing yet.
        let mut fresh = fresh.iter();
        for r in &names {
            for at in &all_scopes {
                let (idn, ..) = fresh.next().unwrap();
                let (s, v) = api.call(secret, "roleBindings.create", json!({"identityId": idn, "role": r, "scopeKind": at.0, "scopeId": at.1})).await;
                let want = expect(has("iam:bindings:write", &tenant) && world.holds_role(&cg, r, at), 403);
                assert_eq!(s, want, "{who}: binding {r} at {at:?}: {v}");
                checked += 1;
            }
        }
    }
    let callers_n = callers.len();
    assert_eq!(callers_n, 18);
    assert_eq!(checked, callers_n * (8 + (targets.len() - 1) * 4 + 3 + names.len() * all_scopes.len()), "every cell was checked");
    assert!(allowed_acts > 0 && allowed_acts < callers_n * targets.len(), "the matrix has both outcomes: {allowed_acts}");
    // The escalation found from outside, in so many words: a tenant admin cannot mint a token
    // for the fleet's operator, unbind them, revoke their tokens or make itself fleet-admin.
    let (s, v) = api.call(&made.token.secret, "roleBindings.create", json!({"identityId": made.identity.id, "role": "fleet-admin", "scopeKind": "tenant"})).await;
    assert_eq!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")), "{v}");
}
