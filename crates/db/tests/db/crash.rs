//! A throwaway cluster (`durable: false`, as the tests and the simulator run) keeps every commit it
//! acknowledged through a crash of the server alone: the simulator's postgres-crash fault checks the
//! product against acknowledged commits, so the cluster must not lose them itself.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use better_compute_db::launcher::{Cluster, ClusterOptions};
use better_compute_db::pool;

/// Stops the cluster however the test ends.
struct Running(Arc<Cluster>);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_acknowledged_before_the_server_crashes_is_there_after_its_restart() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster = Arc::new(
        Cluster::new(ClusterOptions { data_dir: dir.path().join("pgdata"), socket_dir: dir.path().join("run"), durable: false, max_connections: 20 })
            .unwrap(),
    );
    cluster.init_if_needed().unwrap();
    cluster.start().unwrap();
    let _running = Running(cluster.clone());
    let conn = cluster.connection_string("postgres");
    pool::connect(&conn).await.unwrap().batch_execute("CREATE TABLE acked (writer int, n int)").await.unwrap();

    // Four writers commit one row at a time until the crash cuts them off; each keeps what was
    // acknowledged to it.
    let writers: Vec<_> = (0..4)
        .map(|w: i32| {
            let conn = conn.clone();
            tokio::spawn(async move {
                let c = pool::connect(&conn).await.unwrap();
                let mut acked = 0;
                for n in 1.. {
                    match c.execute("INSERT INTO acked VALUES ($1, $2)", &[&w, &n]).await {
                        Ok(_) => acked = n,
                        Err(_) => break,
                    }
                }
                acked
            })
        })
        .collect();
    // Let them commit a while (wall-clock here is the server's own, not simulated time).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.crash_and_restart()).await.unwrap().unwrap();
    let mut acked = Vec::new();
    for w in writers {
        acked.push(tokio::time::timeout(Duration::from_secs(60), w).await.expect("a writer hung").unwrap());
    }
    assert!(acked.iter().all(|&n| n > 0), "every writer committed before the crash: {acked:?}");

    let c = pool::connect(&conn).await.unwrap();
    for (w, &n) in acked.iter().enumerate() {
        let kept: i32 = c.query_one("SELECT coalesce(max(n), 0) FROM acked WHERE writer = $1", &[&(w as i32)]).await.unwrap().get(0);
        assert!(kept >= n, "writer {w}: {n} commits acknowledged, {kept} kept after the crash");
    }
}
