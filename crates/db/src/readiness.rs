//! What a server's `/readyz` checks of the database, whatever its roles: it answers, this
//! process's clock agrees with the database's (`clock.skew`), and it has every migration of this
//! version (`migrations`). The api role and the metrics listener answer with [`answer`].

use tokio_postgres::GenericClient;

use crate::clock::SelfCheck;
use crate::{Clock, DbError, Migration};

/// Samples `clock` and checks the migrations of `sets`.
pub async fn checks(db: &impl GenericClient, clock: &Clock, sets: &[&[Migration]]) -> Result<Vec<SelfCheck>, DbError> {
    clock.sample(db).await?;
    let mut checks = clock.self_check();
    let pending = crate::migrate::pending(db, sets).await?;
    checks.push(SelfCheck {
        name: "migrations",
        ok: pending.is_empty(),
        detail: match pending.first() {
            None => "every migration of this version is applied".to_owned(),
            Some(first) => format!("{} migration(s) of this version are not applied (the first: {first}); run `better-compute migrate`", pending.len()),
        },
    });
    Ok(checks)
}

/// The answer to `/readyz`: whether every check passed, and `{ready, checks: [{name, ok,
/// detail}]}`; a database that does not answer is the one failing check `database`.
pub fn answer(checks: Result<Vec<SelfCheck>, String>) -> (bool, serde_json::Value) {
    let checks: Vec<serde_json::Value> = match checks {
        Ok(cs) => cs.iter().map(|c| serde_json::json!({"name": c.name, "ok": c.ok, "detail": c.detail})).collect(),
        Err(e) => vec![serde_json::json!({"name": "database", "ok": false, "detail": format!("the database does not answer: {e}")})],
    };
    let ready = checks.iter().all(|c| c["ok"] == true);
    (ready, serde_json::json!({"ready": ready, "checks": checks}))
}
