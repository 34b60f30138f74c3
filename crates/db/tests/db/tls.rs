//! Connections to a PostgreSQL that speaks TLS, as each `sslmode` asks (`better_compute_db::tls`).

use std::os::unix::fs::PermissionsExt;

use better_compute_db::launcher::{Cluster, ClusterOptions};
use better_compute_db::pool;

/// A CA, and a server certificate from it for `localhost` and 127.0.0.1: (CA PEM, cert PEM, key PEM).
fn server_certificate() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "test database CA");
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let server = rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    (ca_pem, server.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
}

/// Whether the connection the string opens is encrypted, or the error it fails with.
async fn connect(conn: &str) -> Result<bool, String> {
    let c = pool::connect(conn).await.map_err(|e| e.to_string())?;
    Ok(c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_connects_as_libpq_does_and_verify_full_refuses_a_certificate_it_cannot_trust() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster = Cluster::new(ClusterOptions {
        data_dir: dir.path().join("pgdata"),
        socket_dir: dir.path().join("run"),
        durable: false,
        max_connections: 20,
    })
    .unwrap();
    cluster.init_if_needed().unwrap();
    let (ca_pem, cert_pem, key_pem) = server_certificate();
    // The server's files, owned by whoever owns the data folder (postgres, when we are root).
    let data = dir.path().join("pgdata");
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&data).unwrap());
    let group = std::os::unix::fs::MetadataExt::gid(&std::fs::metadata(&data).unwrap());
    for (name, text, mode) in [("server.crt", &cert_pem, 0o644), ("server.key", &key_pem, 0o600)] {
        let path = data.join(name);
        std::fs::write(&path, text).unwrap();
        std::os::unix::fs::chown(&path, Some(owner), Some(group)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    cluster.start().unwrap();
    let admin = pool::connect(&cluster.connection_string("postgres")).await.unwrap();
    // One statement each: several in one simple query run as one transaction, which ALTER SYSTEM refuses.
    for setting in ["listen_addresses = '127.0.0.1'".to_owned(), format!("port = {port}"), "ssl = on".to_owned()] {
        admin.batch_execute(&format!("ALTER SYSTEM SET {setting}")).await.unwrap();
    }
    drop(admin);
    cluster.stop().unwrap();
    cluster.start().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    let stranger = dir.path().join("stranger.pem");
    std::fs::write(&stranger, server_certificate().0).unwrap();
    let tcp = |host: &str, tail: &str| format!("host={host} port={port} user=postgres dbname=postgres {tail}");

    assert_eq!(connect(&tcp("localhost", "sslmode=disable")).await, Ok(false));
    assert_eq!(connect(&tcp("localhost", "")).await, Ok(true), "prefer (the default) takes TLS when offered");
    assert_eq!(connect(&tcp("localhost", "sslmode=require")).await, Ok(true), "require: encrypted, the certificate unchecked");
    let root = format!("sslrootcert={}", ca_file.display());
    assert_eq!(connect(&tcp("localhost", &format!("sslmode=verify-full {root}"))).await, Ok(true));
    assert_eq!(connect(&tcp("127.0.0.1", &format!("sslmode=verify-full {root}"))).await, Ok(true), "an IP the certificate names");
    let url = format!("postgresql://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}", ca_file.display());
    assert_eq!(connect(&url).await, Ok(true), "the URL form");
    // A CA that did not sign the server's certificate: verify-ca, verify-full and require with a
    // root refuse; so does verify-full with the public roots.
    let other = format!("sslrootcert={}", stranger.display());
    for tail in [format!("sslmode=verify-ca {other}"), format!("sslmode=verify-full {other}"), format!("sslmode=require {other}"), "sslmode=verify-full".to_owned()] {
        let refused = connect(&tcp("localhost", &tail)).await;
        assert!(refused.as_ref().is_err_and(|e| e.contains("TLS handshake: invalid peer certificate")), "{tail}: {refused:?}");
    }
    cluster.stop().unwrap();
}
