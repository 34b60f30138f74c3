//! The command-kind contract: every kind of one-shot command is registered by a module with the
//! rules for delivering it and its payload message. The queue itself lives with the `commands`
//! table in the nodes module.

use std::time::Duration;

use better_compute_core::Error;
use better_compute_proto::v1::CommandBody;

/// A kind of command and its delivery rules.
#[derive(Debug, Clone, Copy)]
pub struct CommandKind {
    /// The kind, e.g. `node.reboot`.
    pub name: &'static str,
    /// What it does, for the reference page.
    pub summary: &'static str,
    /// The daemon lane it runs in; a lane's credits bound commands in flight.
    pub lane: &'static str,
    /// How long it may run after `notAfter` before the sweeper fails it with `timeout`.
    pub timeout: Duration,
    /// Safe to run twice (a new daemon journal does not fail it).
    pub retry_safe: bool,
    /// Ends the daemon (a reboot): a reconnect with a new boot settles it as succeeded.
    pub self_terminating: bool,
    /// Destructive; from v0.2 the daemon refuses it unsigned.
    pub destructive: bool,
    /// Allowed through `commands.run`.
    pub api_allowed: bool,
    /// The payload message's name in `bettercompute.agent.v1`.
    pub payload_message: &'static str,
    /// Parses the payload (proto3 JSON of the payload message) into a `CommandBody` and checks it.
    pub encode: fn(&serde_json::Value) -> Result<CommandBody, Error>,
}

/// Renders the reference page of `kinds` (docs/command-kinds.md is this text).
pub fn reference_page(kinds: &[CommandKind]) -> String {
    let mut s = String::from(
        "# Command kinds\n\nGenerated from the registry by `better-compute docs command-kinds`; a test fails when this page\n\
         and the registry differ.\n\n\
         | kind | lane | timeout | retry-safe | self-terminating | destructive | commands.run | payload |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let yes = |b: bool| if b { "yes" } else { "no" };
    for k in kinds {
        s.push_str(&format!(
            "| `{}` | {} | {} s | {} | {} | {} | {} | `{}` |\n",
            k.name,
            k.lane,
            k.timeout.as_secs(),
            yes(k.retry_safe),
            yes(k.self_terminating),
            yes(k.destructive),
            yes(k.api_allowed),
            k.payload_message
        ));
    }
    s.push('\n');
    for k in kinds {
        s.push_str(&format!("## `{}`\n\n{}\n\n", k.name, k.summary));
    }
    s
}
