//! `bettercompute.agent.v1`: the desired state of a node (`v1::NodeSpec`), the command bodies
//! (`v1::CommandBody`) and, with the `grpc` feature, the daemon<->gateway service
//! (`v1::gateway_server`, `v1::gateway_client`), generated from `proto/` by prost and tonic, with the
//! proto3 JSON mapping by pbjson. This crate stands alone: the daemon depends on it, never on the database.

#![allow(missing_docs, clippy::all)]

/// The v1 package.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.serde.rs"));
}
