//! The audit log against a real PostgreSQL: entries commit or roll back with their change, are
//! placed in commit order by `audit.checkpoint` (never behind a transaction still running), chained
//! and checkpointed with a signed Merkle root; an export verifies offline, proofs verify, and an
//! edited, deleted or reordered row is named by `verify`.

use std::sync::Arc;

use better_compute_audit::entry::{record, EntryActor, NewEntry, Outcome};
use better_compute_audit::verify::{verify, ExportLine};
use better_compute_audit::{log, merkle, AuditModule};
use better_compute_runtime::harness::Harness;

async fn harness() -> (Harness, Vec<u8>) {
    let h = Harness::new(vec![Arc::new(AuditModule)]).await;
    let signer = Arc::new(better_compute_runtime::signing::CommandSigner::generate());
    let key = signer.public_key();
    assert!(h.registry().install_command_signer(signer));
    (h, key)
}

fn entry<'a>(target: &'a str) -> NewEntry<'a> {
    NewEntry {
        actor: EntryActor::Identity { identity_id: "idn_a", token_id: "tok_a" },
        tenant_id: Some("ten_a"),
        action: "nodes.cordon",
        target,
        request_id: Some("req_1"),
        source: Some("127.0.0.1"),
        outcome: Outcome::Ok,
        request_digest: Some("44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"),
    }
}

async fn record_one(h: &Harness, target: &str) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    record(&*tx, &entry(target)).await.unwrap();
    tx.commit().await.unwrap();
}

async fn export(h: &Harness) -> Vec<ExportLine> {
    log::export_all(&**h.db().client().await).await.unwrap()
}

/// Runs `audit.checkpoint` until `n` entries are placed (60 s at most: the xmin rule waits for
/// every older transaction of the cluster, other tests' among them).
async fn place_until(h: &Harness, n: i64) {
    for _ in 0..600 {
        h.db().advance(better_compute_audit::checkpoint::EVERY).await;
        h.job("audit.checkpoint").drain(10).await;
        if placed(h).await >= n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("{n} entries were not placed within 60 s");
}

async fn placed(h: &Harness) -> i64 {
    h.db().client().await.query_one("SELECT count(*) FROM audit_entries WHERE log_index IS NOT NULL", &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn entries_are_placed_once_in_commit_order_and_an_export_verifies_offline_with_its_proofs() {
    let (h, key) = harness().await;
    // A change that rolls back leaves no entry.
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    record(&*tx, &entry("node_rolled_back")).await.unwrap();
    drop(tx);
    // Eight writers at once, twenty entries each.
    let mut writers = Vec::new();
    for w in 0..8 {
        let pool = h.db().pool.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..20 {
                let mut c = pool.get().await.unwrap();
                let tx = c.transaction().await.unwrap();
                record(&*tx, &entry(&format!("node_{w}_{i}"))).await.unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        tokio::time::timeout(std::time::Duration::from_secs(60), w).await.expect("a writer hung").unwrap();
    }
    // A transaction still running holds back every entry after it, so none is placed behind it.
    let mut held = h.db().client().await;
    let open = held.transaction().await.unwrap();
    record(&*open, &entry("node_slow")).await.unwrap();
    record_one(&h, "node_after_slow").await;
    place_until(&h, 160).await;
    h.db().advance(better_compute_audit::checkpoint::EVERY).await;
    h.job("audit.checkpoint").drain(10).await;
    assert_eq!(placed(&h).await, 160, "the 160 before the open transaction, and none after it");
    open.commit().await.unwrap();
    place_until(&h, 162).await;
    assert_eq!(placed(&h).await, 162);
    let lines = export(&h).await;
    let entries: Vec<_> = lines.iter().filter_map(|l| if let ExportLine::Entry(e) = l { Some(e) } else { None }).collect();
    assert_eq!(entries.len(), 162);
    assert_eq!((entries[160].target.as_str(), entries[161].target.as_str()), ("node_slow", "node_after_slow"), "commit order");
    assert!(!entries.iter().any(|e| e.target == "node_rolled_back"));
    assert!(entries.iter().enumerate().all(|(i, e)| e.log_index == Some(i as i64)));
    let v = verify(&lines, Some(&key));
    assert!(v.entries == 162 && v.checkpoints >= 2 && v.problem.is_none(), "{v:?}");
    assert_eq!(v.reaches, Some(162), "it says how far it reaches");
    // Cut short (its last lines gone), it does not verify as complete, at a checkpoint or not.
    for keep in [lines.len() - 1, lines.len() - 2] {
        let cut = verify(&lines[..keep], Some(&key));
        assert!(cut.problem.as_deref().is_some_and(|p| p.contains("cut short")), "{keep}: {cut:?}");
    }
    let mut longer = lines.clone();
    longer.push(longer[0].clone());
    assert!(verify(&longer, Some(&key)).problem.unwrap().contains("after the export's end line"));
    // Another key is not trusted.
    assert!(verify(&lines, Some(&[7u8; 32])).problem.unwrap().contains("not the trusted key"));
    // Proofs: entry 17 is in the last checkpoint, which is consistent with the first.
    let id = &entries[17].id;
    let p = log::proof(&**c, id, None, 162, Some(160)).await.unwrap();
    let unhex = |s: &str| -> merkle::Hash { hex::decode(s).unwrap().try_into().unwrap() };
    let leaf = merkle::leaf_hash(&better_compute_audit::entry::canonical(&p.entry));
    let path: Vec<merkle::Hash> = p.inclusion.iter().map(|s| unhex(s)).collect();
    assert!(merkle::verify_inclusion(17, 162, &leaf, &path, &unhex(&p.checkpoint.root)));
    let all = log::checkpoints(&**c, 0, 100).await.unwrap();
    let sizes: Vec<i64> = all.iter().map(|c| c.tree_size).collect();
    assert!(sizes.ends_with(&[160, 162]), "{sizes:?}");
    let cons: Vec<merkle::Hash> = p.consistency.iter().map(|s| unhex(s)).collect();
    let root_of = |n: i64| unhex(&all.iter().find(|c| c.tree_size == n).unwrap().root);
    assert!(merkle::verify_consistency(160, 162, &root_of(160), &root_of(162), &cons));
    assert!(!merkle::verify_consistency(160, 162, &root_of(162), &root_of(162), &cons), "the proof is of these two trees");
    // Placed entries cannot change or go, short of switching the guard off.
    let err = c.execute("UPDATE audit_entries SET target = 'x' WHERE log_index = 3", &[]).await.unwrap_err();
    let message = err.as_db_error().map(|e| e.message().to_owned()).unwrap_or_default();
    assert!(message.contains("cannot change"), "{err:?}");
    assert!(c.execute("DELETE FROM audit_entries WHERE log_index = 3", &[]).await.is_err());
    // A tenant reads its own entries, filtered and paged.
    let page = log::list(&**c, &log::Filter { tenant_id: Some("ten_a"), target: Some("node_3_4"), ..Default::default() }, "", 10).await.unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(log::list(&**c, &log::Filter { tenant_id: Some("ten_b"), ..Default::default() }, "", 10).await.unwrap().len(), 0);
    assert_eq!(log::get(&**c, id, Some("ten_b")).await.unwrap_err().code, better_compute_core::ErrorCode::NotFound);
}

#[tokio::test]
async fn verify_names_the_first_edited_deleted_or_reordered_entry() {
    let (h, key) = harness().await;
    for i in 0..10 {
        record_one(&h, &format!("node_{i}")).await;
    }
    place_until(&h, 10).await;
    let c = h.db().client().await;
    let id_at = async |i: i64| -> String { c.query_one("SELECT id FROM audit_entries WHERE log_index = $1", &[&i]).await.unwrap().get(0) };
    let (at2, at3, at5, at8) = (id_at(2).await, id_at(3).await, id_at(5).await, id_at(8).await);
    assert_eq!(verify(&export(&h).await, Some(&key)).problem, None);
    // An owner of the database switches the guard off and edits a row.
    c.batch_execute("ALTER TABLE audit_entries DISABLE TRIGGER audit_entries_append_only").await.unwrap();
    c.execute("UPDATE audit_entries SET target = 'node_elsewhere' WHERE log_index = 5", &[]).await.unwrap();
    let found = verify(&export(&h).await, Some(&key)).problem.unwrap();
    assert!(found.contains(&at5) && found.contains("index 5"), "{found}");
    // Even with the chain hashes recomputed after the edit, the signed checkpoint does not match.
    let mut forged = export(&h).await;
    let mut prev = [0u8; 32];
    for l in &mut forged {
        if let ExportLine::Entry(e) = l {
            let h = better_compute_audit::entry::chain_hash(&prev, e);
            e.chain_hash = Some(hex::encode(h));
            prev = h;
        }
    }
    let found = verify(&forged, Some(&key)).problem.unwrap();
    assert!(found.contains("Merkle root"), "{found}");
    c.execute("UPDATE audit_entries SET target = 'node_5' WHERE log_index = 5", &[]).await.unwrap();
    assert_eq!(verify(&export(&h).await, Some(&key)).problem, None, "put back, it verifies again");
    // Reordered: two entries swap places.
    c.batch_execute("BEGIN; UPDATE audit_entries SET log_index = 1000000 WHERE log_index = 2; UPDATE audit_entries SET log_index = 2 WHERE log_index = 3; UPDATE audit_entries SET log_index = 3 WHERE log_index = 1000000; COMMIT").await.unwrap();
    let found = verify(&export(&h).await, Some(&key)).problem.unwrap();
    assert!(found.contains(&at3) && found.contains("index 2"), "the entry now at 2 is named: {found}");
    c.batch_execute("BEGIN; UPDATE audit_entries SET log_index = 1000000 WHERE log_index = 2; UPDATE audit_entries SET log_index = 2 WHERE log_index = 3; UPDATE audit_entries SET log_index = 3 WHERE log_index = 1000000; COMMIT").await.unwrap();
    assert_eq!(c.query_one("SELECT id FROM audit_entries WHERE log_index = 2", &[]).await.unwrap().get::<_, String>(0), at2);
    assert_eq!(verify(&export(&h).await, Some(&key)).problem, None);
    // Deleted: the entry after the gap is named.
    c.execute("DELETE FROM audit_entries WHERE log_index = 7", &[]).await.unwrap();
    let found = verify(&export(&h).await, Some(&key)).problem.unwrap();
    assert!(found.contains(&at8) && found.contains("missing"), "{found}");
}

#[tokio::test]
async fn pruning_keeps_the_log_verifiable_from_the_checkpoint_it_pruned_below() {
    let (h, key) = harness().await;
    for i in 0..10 {
        record_one(&h, &format!("node_{i}")).await;
    }
    place_until(&h, 10).await;
    h.db().advance(std::time::Duration::from_secs(7200)).await;
    for i in 10..15 {
        record_one(&h, &format!("node_{i}")).await;
    }
    place_until(&h, 15).await;
    let c = h.db().client().await;
    // Without a retention nothing goes; with one, what is below the checkpoint older than it.
    let prune = async || {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        let n = better_compute_audit::prune::prune(&*tx).await.unwrap();
        tx.commit().await.unwrap();
        n
    };
    assert_eq!(prune().await, 0);
    assert!(better_compute_audit::prune::set_retention_s(&**c, Some(60)).await.is_err(), "an hour at least");
    better_compute_audit::prune::set_retention_s(&**c, Some(3600)).await.unwrap();
    assert_eq!(prune().await, 10, "the entries below the first checkpoint, two hours old");
    assert_eq!(prune().await, 0, "the second checkpoint is newer than the retention");
    let lines = export(&h).await;
    assert!(matches!(&lines[0], ExportLine::Anchor(a) if a.checkpoint.tree_size == 10), "{:?}", lines[0]);
    assert_eq!(lines.iter().filter(|l| matches!(l, ExportLine::Entry(_))).count(), 5);
    let v = verify(&lines, Some(&key));
    assert_eq!((v.entries, v.checkpoints, v.problem), (5, 2, None));
    // What is left is as protected as before, and a change in it is still named.
    assert!(c.execute("DELETE FROM audit_entries WHERE log_index = 12", &[]).await.is_err());
    c.batch_execute("ALTER TABLE audit_entries DISABLE TRIGGER audit_entries_append_only; UPDATE audit_entries SET target = 'x' WHERE log_index = 12").await.unwrap();
    let found = verify(&export(&h).await, Some(&key)).problem.unwrap();
    assert!(found.contains("index 12"), "{found}");
}
