//! Bearer tokens: only their hash is stored; one authenticates until it expires or is revoked.

use std::time::Duration;

use better_compute_core::ErrorCode;
use better_compute_iam::bootstrap::bootstrap;
use better_compute_iam::tokens::{self, secret_sha256, SECRET_PREFIX};

#[tokio::test]
async fn a_token_is_stored_as_its_hash_and_authenticates_its_identity_until_it_expires() {
    let h = crate::harness().await;
    let mut c = h.db().connect().await;
    let tx = c.transaction().await.unwrap();
    let admin = bootstrap(&tx, &h.registry().permissions(), "operators", "admin").await.unwrap();
    let t = tokens::issue(&tx, &admin.tenant.id, None, &admin.identity.id, "short", Some(120)).await.unwrap();
    tx.commit().await.unwrap();
    assert!(t.secret.starts_with(SECRET_PREFIX), "{}", t.secret);
    // The table holds the hash of each secret and never the secret.
    let rows = c.query("SELECT id, secret_sha256, row_to_json(t)::text FROM tokens t ORDER BY id", &[]).await.unwrap();
    assert_eq!(rows.len(), 2, "bootstrap's token and this one");
    let mine = rows.iter().find(|r| r.get::<_, String>(0) == t.token.id).expect("the issued token's row");
    assert_eq!(mine.get::<_, Vec<u8>>(1), secret_sha256(&t.secret).to_vec());
    assert!(rows.iter().all(|r| !r.get::<_, String>(2).contains(&t.secret) && !r.get::<_, String>(2).contains(&admin.token.secret)));
    let owner = tokens::authenticate(&c, &t.secret).await.unwrap();
    assert_eq!((owner.tenant_id.as_str(), owner.identity_id.as_str()), (admin.tenant.id.as_str(), admin.identity.id.as_str()));
    assert!(owner.expires_in_s > 0.0 && owner.expires_in_s <= 120.0, "{}", owner.expires_in_s);
    // Past its two minutes on the database's clock, it is refused like any unknown secret.
    h.db().advance(Duration::from_secs(121)).await;
    let e = tokens::authenticate(&c, &t.secret).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated);
    assert_eq!(tokens::time_left(&c, &t.token.id).await.unwrap_err().code, ErrorCode::Unauthenticated);
    // The bootstrap's token (90 days) still works.
    assert!(tokens::authenticate(&c, &admin.token.secret).await.is_ok());
}

#[tokio::test]
async fn a_revoked_token_no_longer_authenticates_and_bad_secrets_are_refused_alike() {
    let h = crate::harness().await;
    let mut c = h.db().connect().await;
    let tx = c.transaction().await.unwrap();
    let admin = bootstrap(&tx, &h.registry().permissions(), "operators", "admin").await.unwrap();
    let t = tokens::issue(&tx, &admin.tenant.id, None, &admin.identity.id, "ci", None).await.unwrap();
    tx.commit().await.unwrap();
    assert!(tokens::authenticate(&c, &t.secret).await.is_ok());
    let tx = c.transaction().await.unwrap();
    let revoked = tokens::revoke(&tx, &admin.tenant.id, &admin.identity.id, &t.token.id).await.unwrap();
    tx.commit().await.unwrap();
    assert!(revoked.revoked_at.is_some());
    assert_eq!(tokens::authenticate(&c, &t.secret).await.unwrap_err().code, ErrorCode::Unauthenticated);
    let wrong = format!("{}x", &t.secret[..t.secret.len() - 1]);
    let long = format!("{SECRET_PREFIX}{}", "a".repeat(200));
    for bad in [wrong.as_str(), "", "Bearer nonsense", long.as_str()] {
        assert_eq!(tokens::authenticate(&c, bad).await.unwrap_err().code, ErrorCode::Unauthenticated, "{bad:?}");
    }
}

#[tokio::test]
async fn a_token_for_another_tenants_identity_or_with_a_bad_lifetime_is_refused_and_nothing_is_written() {
    let h = crate::harness().await;
    let mut c = h.db().connect().await;
    let tx = c.transaction().await.unwrap();
    let admin = bootstrap(&tx, &h.registry().permissions(), "operators", "admin").await.unwrap();
    tx.commit().await.unwrap();
    let before: i64 = c.query_one("SELECT count(*) FROM tokens", &[]).await.unwrap().get(0);
    let tx = c.transaction().await.unwrap();
    let e = tokens::issue(&tx, "ten_other", None, &admin.identity.id, "x", None).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    for ttl_s in [59, tokens::MAX_TTL_S + 1] {
        let e = tokens::issue(&tx, &admin.tenant.id, None, &admin.identity.id, "x", Some(ttl_s)).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{ttl_s}: {e}");
    }
    tx.commit().await.unwrap();
    let after: i64 = c.query_one("SELECT count(*) FROM tokens", &[]).await.unwrap().get(0);
    assert_eq!(after, before);
}
