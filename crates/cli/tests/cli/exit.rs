//! Exit statuses that need no server: a usage error, and a server that cannot be reached.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

fn status(args: &[&str], url: &str) -> Option<i32> {
    Command::new(BIN).args(args).env("BETTER_COMPUTE_URL", url).env("BETTER_COMPUTE_TOKEN", "bct_x").output().unwrap().status.code()
}

#[test]
fn a_bad_flag_exits_2_and_an_unreachable_server_69_and_help_documents_them() {
    assert_eq!(status(&["api", "--no-such-flag"], "http://127.0.0.1:9"), Some(2));
    assert_eq!(status(&["no-such-command"], "http://127.0.0.1:9"), Some(2));
    // Port 9 (discard) on loopback: nothing listens, the connection is refused.
    assert_eq!(status(&["api", "nodes.list"], "http://127.0.0.1:9"), Some(69));
    assert_eq!(status(&["api", "--list"], "http://127.0.0.1:9"), Some(69));
    let help = Command::new(BIN).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("Exit status:") && text.contains("3 not found") && text.contains("69 the server"), "{text}");
}

#[test]
fn a_ca_certificate_that_cannot_be_read_is_a_usage_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    for (path, says) in [(dir.path().join("missing.pem"), "missing.pem"), (not_pem, "holds no PEM certificate")] {
        let out = Command::new(BIN).args(["api", "nodes.list"]).env("BETTER_COMPUTE_URL", "https://127.0.0.1:9").env("BETTER_COMPUTE_TOKEN", "bct_x").env("BETTER_COMPUTE_CA_CERT", &path).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--ca-cert") && err.contains(says), "{err}");
    }
}
