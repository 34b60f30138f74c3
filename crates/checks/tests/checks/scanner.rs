//! The scanner behind the one-clock check catches every form and honours the exceptions.

use std::path::Path;

use better_compute_checks::{scan_rust, scan_sql};

fn rust(src: &str) -> Vec<String> {
    scan_rust(Path::new("x.rs"), src).into_iter().map(|v| format!("{}:{}", v.line, v.found)).collect()
}

#[test]
fn each_forbidden_form_is_caught_in_a_string() {
    for (sql, found) in [
        ("SELECT now()", "now()"),
        ("WHERE t < NOW ( )", "NOW ( )"),
        ("DEFAULT CURRENT_TIMESTAMP", "CURRENT_TIMESTAMP"),
        ("x < localtimestamp", "localtimestamp"),
        ("transaction_timestamp()", "transaction_timestamp()"),
        ("Statement_Timestamp()", "Statement_Timestamp()"),
        ("clock_timestamp()", "clock_timestamp()"),
        ("current_date - 1", "current_date"),
        ("CURRENT_TIME", "CURRENT_TIME"),
        ("localtime", "localtime"),
    ] {
        let src = format!("fn f() {{ q(\"{sql}\"); }}");
        assert_eq!(rust(&src), [format!("1:{found}")], "{sql}");
    }
}

#[test]
fn compute_now_and_lookalike_names_pass() {
    assert!(rust(r#"q("SELECT compute_now(), nowhere, snow(), now_ms, current_timestamps")"#).is_empty());
}

#[test]
fn raw_byte_and_multiline_strings_are_scanned_with_the_right_line() {
    let src = "let a = 1;\nq(r#\"SELECT 1,\n  \"quoted\" now()\"#);\nq(br\"clock_timestamp()\");\n";
    assert_eq!(rust(src), ["3:now()", "4:clock_timestamp()"]);
}

#[test]
fn code_and_comments_outside_strings_are_not_sql() {
    let src = "// SELECT now()\n/* now() /* nested now() */ */\nfn now() {}\nlet t = Instant::now();\n";
    assert!(rust(src).is_empty(), "{:?}", rust(src));
}

#[test]
fn char_literals_and_lifetimes_do_not_open_strings() {
    let src = "fn f<'a>(x: &'a str) -> char { let q = '\"'; let e = '\\''; q }\nq(\"now()\");\n";
    assert_eq!(rust(src), ["2:now()"]);
}

#[test]
fn the_allow_marker_exempts_its_line_only() {
    let src = "q(\"SELECT now()\"); // check-sql-now: allow\nq(\"SELECT now()\");\n";
    assert_eq!(rust(src), ["2:now()"]);
    let multi = "q(\"SELECT 1,\n now() -- check-sql-now: allow\n, now()\");";
    assert_eq!(rust(multi), ["3:now()"]);
}

#[test]
fn sql_files_are_scanned_whole_except_the_clock_file() {
    let sql = "CREATE TABLE t (a timestamptz DEFAULT now());\n-- fine: compute_now()\n";
    let v = scan_sql(Path::new("crates/x/src/migrations/x/0002_t.sql"), sql);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].line, 1);
    assert!(scan_sql(Path::new("crates/db/src/sql/clock.sql"), sql).is_empty());
    let marked = "SELECT now(); -- check-sql-now: allow\n";
    assert!(scan_sql(Path::new("a.sql"), marked).is_empty());
}
