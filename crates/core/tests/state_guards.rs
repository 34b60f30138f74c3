//! Every module's `src/sql/state_guards.sql` is generated from the state tables, and the module
//! applies it.

use std::collections::BTreeSet;
use std::path::Path;

use better_compute_core::state::{state_guards_sql, GUARDED_COLUMNS};

#[test]
fn every_modules_state_guards_are_generated_from_the_state_tables_and_applied() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let modules: BTreeSet<&str> = GUARDED_COLUMNS.iter().map(|g| g.module).collect();
    assert_eq!(modules.len(), 4, "{modules:?}");
    for module in modules {
        let file = crates.join(module).join("src/sql/state_guards.sql");
        let want = state_guards_sql(module);
        if std::env::var_os("UPDATE_STATE_GUARDS").is_some() {
            std::fs::write(&file, &want).unwrap();
        }
        let on_disk = std::fs::read_to_string(&file).unwrap_or_default();
        assert_eq!(on_disk, want, "{} drifted from the state tables; rewrite it: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core", file.display());
        let lib = std::fs::read_to_string(crates.join(module).join("src/lib.rs")).unwrap();
        assert!(lib.contains("include_str!(\"sql/state_guards.sql\")"), "{module} does not apply its state guards");
    }
}
