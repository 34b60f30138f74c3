//! Bootstrap: the first tenant and its admin, once.

use std::time::Duration;

use better_compute_core::ErrorCode;
use better_compute_iam::bootstrap::{bootstrap, first_fleet_admin};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_beside_an_uncommitted_one_waits_for_it_and_is_refused_so_there_is_one_first_admin() {
    let h = crate::harness().await;
    let catalog = h.registry().permissions();
    let mut a = h.db().connect().await;
    let tx = a.transaction().await.unwrap();
    let first = bootstrap(&tx, &catalog, "operators-a", "admin").await.unwrap();
    // A second bootstrap while the first is not committed: it must wait for the first, not read
    // the fleet as not bootstrapped yet.
    let mut b = h.db().connect().await;
    let second = tokio::spawn({
        let catalog = catalog.clone();
        async move {
            let tx = b.transaction().await.unwrap();
            let r = bootstrap(&tx, &catalog, "operators-b", "admin").await;
            tx.commit().await.unwrap();
            r
        }
    });
    let watcher = h.db().connect().await;
    let waited = tokio::time::timeout(Duration::from_secs(5), async {
        while !second.is_finished() {
            let n: i64 = watcher
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'", &[])
                .await
                .unwrap()
                .get(0);
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok() && !second.is_finished(), "the second bootstrap did not wait for the first");
    tx.commit().await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(30), second).await.expect("the second bootstrap hung").unwrap().unwrap_err();
    assert_eq!(refused.code, ErrorCode::FailedPrecondition, "{refused}");
    assert!(refused.message.contains("already bootstrapped"), "{refused}");
    let c = h.db().connect().await;
    assert_eq!(first_fleet_admin(&c).await.unwrap(), Some((first.tenant.id.clone(), first.identity.id.clone())));
    let tenants: i64 = c.query_one("SELECT count(*) FROM tenants", &[]).await.unwrap().get(0);
    assert_eq!(tenants, 1, "the refused bootstrap left no tenant behind");
}

#[tokio::test]
async fn before_bootstrap_there_is_no_fleet_admin() {
    let h = crate::harness().await;
    assert_eq!(first_fleet_admin(&h.db().connect().await).await.unwrap(), None);
}
