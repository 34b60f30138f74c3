//! The workspace checks, one module each: the crate graph, dependencies declared once, the one
//! clock, table ownership and the CLI's reads, pokes after commit, and the scanner behind the
//! clock check. One binary, so the checks link once.

mod crate_graph;
mod dependencies;
mod one_clock;
mod ownership;
mod pokes;
mod scanner;
