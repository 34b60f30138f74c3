//! The vps invariants, checked against the database after the fact by the simulator and the
//! tests (feature `testing`; production builds do not carry them). Each lists what breaks a rule,
//! so a violation names what broke.

use better_compute_db::DbError;
use tokio_postgres::GenericClient;

/// The metering invariant: every instance's windows sum to exactly
/// the seconds its VM was up before the end of the last window it was metered to, and an instance
/// has at most one open run. Returns what is wrong (empty: holds).
pub async fn violations(db: &impl GenericClient) -> Result<Vec<String>, DbError> {
    let mut wrong = Vec::new();
    for r in db
        .query(
            "WITH m AS (
               SELECT i.id,
                      coalesce((SELECT sum(w.instance_seconds) FROM instance_usage_windows w WHERE w.instance_id = i.id), 0) AS billed,
                      coalesce((SELECT sum(extract(epoch FROM upper(x.up) - lower(x.up)))
                                  FROM instance_runs r, LATERAL (SELECT r.during * tstzrange(NULL, i.usage_closed_until) AS up) x
                                 WHERE r.instance_id = i.id AND NOT isempty(x.up)), 0) AS up
                 FROM instances i WHERE i.usage_closed_until IS NOT NULL)
             SELECT id, billed::text, up::text FROM m WHERE billed <> up ORDER BY id",
            &[],
        )
        .await?
    {
        wrong.push(format!("instance {} is billed {} s but was up {} s in its metered windows", r.get::<_, String>(0), r.get::<_, String>(1), r.get::<_, String>(2)));
    }
    for r in db.query("SELECT instance_id FROM instance_runs WHERE upper_inf(during) GROUP BY 1 HAVING count(*) > 1 ORDER BY 1", &[]).await? {
        wrong.push(format!("instance {} has more than one open run", r.get::<_, String>(0)));
    }
    Ok(wrong)
}
