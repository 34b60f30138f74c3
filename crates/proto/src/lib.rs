//! `bettercompute.agent.v1`: the desired state of a node ([`v1::NodeSpec`]) and the command bodies
//! ([`v1::CommandBody`]), generated from `proto/` by prost, with the proto3 JSON mapping by pbjson.
//! This crate stands alone: the daemon depends on it, never on the database.

#![allow(missing_docs, clippy::all)]

/// The v1 package.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.serde.rs"));
}
