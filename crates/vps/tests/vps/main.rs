//! The vps module's tests against a real PostgreSQL: hosts and their images, and instances. One
//! binary, so the tests link once.

mod common;
mod hosts;
mod instances;
