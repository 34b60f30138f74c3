//! The binary's tests, one module each: what `deploy/` ships, `dev` and `up` as a user runs them
//! (and the console in a browser), the generated reference pages, exit statuses, the schema
//! snapshot and audit export, and short runs of the simulator. One binary, so they link once.

mod deploy;
mod dev;
mod docs;
mod exit;
mod schema;
mod sim;
