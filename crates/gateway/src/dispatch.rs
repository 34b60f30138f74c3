//! Dispatch: desired state and commands sent down sessions, on pokes (LISTEN/NOTIFY) and by polling.

use std::collections::BTreeSet;

use super::*;

/// Nodes whose desired state one read fetches at most.
pub(crate) const SPEC_PUSH_BATCH: usize = 256;
/// Nodes one dispatch transaction sends commands to at most.
pub(crate) const DISPATCH_BATCH: usize = 256;

/// What a dispatch moved to `sent` for one session, with the slots reserved for it in its queue.
pub(crate) struct Sent<'s> {
    node: &'s str,
    session: &'s hub::Session,
    dispatched: sessions::Dispatched,
    slots: Reserved<'s>,
}

/// A wake-up for one node.
#[derive(Debug, Clone)]
pub(crate) enum Poke {
    Commands(String),
    Spec(String),
}

impl Inner {
    /// Runs pokes with bounded concurrency. Pokes that have arrived together (a change to a whole
    /// site wakes thousands of nodes; commands enqueued at a steady rate wake hundreds a second) go
    /// as one read or one dispatch of up to [`SPEC_PUSH_BATCH`] and [`DISPATCH_BATCH`] nodes.
    pub(crate) async fn poke_loop(self: Arc<Self>, mut pokes: tokio::sync::mpsc::Receiver<Poke>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let poke = tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                p = pokes.recv() => match p { Some(p) => p, None => return },
            };
            let (mut specs, mut commands) = (BTreeSet::new(), BTreeSet::new());
            let mut next = Some(poke);
            while let Some(p) = next.take() {
                match p {
                    Poke::Spec(n) => specs.insert(n),
                    Poke::Commands(n) => commands.insert(n),
                };
                if specs.len() < SPEC_PUSH_BATCH && commands.len() < DISPATCH_BATCH {
                    next = pokes.try_recv().ok();
                }
            }
            if !commands.is_empty() {
                self.clone().spawn_dispatch(commands.into_iter().collect()).await;
            }
            if !specs.is_empty() {
                self.clone().spawn_spec_push(specs.into_iter().collect()).await;
            }
        }
    }

    /// Pushes desired state to the sessions of `nodes` in one task under one dispatch permit.
    pub(crate) async fn spawn_spec_push(self: Arc<Self>, mut nodes: Vec<String>) {
        nodes.retain(|n| self.hub.get(n).is_some());
        if nodes.is_empty() {
            return;
        }
        let Ok(permit) = self.dispatching.clone().acquire_owned().await else { return };
        tokio::spawn(async move {
            if let Err(e) = self.push_specs(&nodes).await {
                tracing::warn!(nodes = nodes.len(), error = %e, "pushing desired state failed; the poll retries");
            }
            drop(permit);
        });
    }

    /// Dispatches the due commands of `nodes` in a task of its own under a dispatch permit.
    pub(crate) async fn spawn_dispatch(self: Arc<Self>, mut nodes: Vec<String>) {
        nodes.retain(|n| self.hub.get(n).is_some());
        if nodes.is_empty() {
            return;
        }
        let Ok(permit) = self.dispatching.clone().acquire_owned().await else { return };
        tokio::spawn(async move {
            if let Err(e) = self.dispatch(&nodes).await {
                tracing::warn!(nodes = nodes.len(), error = %e, "dispatch failed; the poll retries");
            }
            drop(permit);
        });
    }

    /// Every poll: the nodes of our sessions with due commands or cancels, and those behind on
    /// desired state. This is what makes a lost poke only a delay.
    pub(crate) async fn poll_loop(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(self.cfg.poll_interval) => {}
            }
            if let Err(e) = self.clone().poll_once().await {
                tracing::warn!(error = %e, "gateway poll failed");
            }
        }
    }

    pub(crate) async fn poll_once(self: Arc<Self>) -> Result<(), DbError> {
        if self.hub.is_empty() {
            return Ok(());
        }
        let (work, behind) = {
            let mut c = self.pool.get().await?;
            let tx = c.transaction().await?;
            let found = (sessions::nodes_with_work(&*tx, &self.cfg.id).await?, sessions::nodes_behind(&*tx, &self.cfg.id).await?);
            tx.commit().await?;
            found
        };
        for nodes in work.chunks(DISPATCH_BATCH) {
            self.clone().spawn_dispatch(nodes.to_vec()).await;
        }
        let behind: Vec<String> =
            behind.into_iter().filter(|(n, generation)| self.hub.get(n).is_some_and(|s| s.sent_generation() < *generation)).map(|(n, _)| n).collect();
        for nodes in behind.chunks(SPEC_PUSH_BATCH) {
            self.clone().spawn_spec_push(nodes.to_vec()).await;
        }
        Ok(())
    }

    /// Sends each node its due pending commands (as many as its queue has room for) and Cancel
    /// for in-flight ones someone cancelled: one transaction for all of them. A superseded session
    /// is dropped.
    pub(crate) async fn dispatch(&self, nodes: &[String]) -> Result<(), DbError> {
        let sessions: Vec<(&str, Arc<hub::Session>)> = nodes.iter().filter_map(|n| Some((n.as_str(), self.hub.get(n)?))).collect();
        let held: Vec<(&str, &hub::Session)> = sessions.iter().map(|(n, s)| (*n, &**s)).collect();
        let mut c = self.pool.get().await?;
        let tx = c.transaction().await?;
        let sent = self.dispatch_in(&*tx, &held).await?;
        tx.commit().await?;
        for d in sent {
            self.send_dispatched(d);
        }
        Ok(())
    }

    /// The database side of a dispatch to many sessions, in the caller's transaction. A session
    /// with no room in its queue is left for the poll; a superseded one is dropped here. Room is
    /// reserved before any command is claimed, so a command moved to `sent` always has its slot,
    /// however many dispatches for the node run at once.
    pub(crate) async fn dispatch_in<'s>(
        &self,
        tx: &impl tokio_postgres::GenericClient,
        sessions: &[(&'s str, &'s hub::Session)],
    ) -> Result<Vec<Sent<'s>>, DbError> {
        let mut reserved = Vec::with_capacity(sessions.len());
        for &(node, s) in sessions {
            let room = s.out.capacity().clamp(1, 64);
            // Nothing reserved: a slow daemon's queue is full, and the poll comes back to it.
            if let Ok(slots) = s.out.try_reserve_many(room) {
                reserved.push((node, s, room, slots));
            }
        }
        if reserved.is_empty() {
            return Ok(Vec::new());
        }
        let want: Vec<sessions::DispatchFor<'_>> =
            reserved.iter().map(|(node, s, room, _)| sessions::DispatchFor { node_id: node, epoch: s.epoch, limit: *room as i64 }).collect();
        let mut found = sessions::dispatch_many(tx, &self.cfg.id, &want).await?;
        let mut sent = Vec::with_capacity(reserved.len());
        for (node, s, _, slots) in reserved {
            match found.remove(node) {
                Some(d) => sent.push(Sent { node, session: s, dispatched: d, slots }),
                None => {
                    self.hub.remove(node, s.epoch, "this session was closed or superseded");
                }
            }
        }
        Ok(sent)
    }

    /// Sends what a committed dispatch moved to `sent`, into the slots reserved for it.
    pub(crate) fn send_dispatched(&self, sent: Sent<'_>) {
        let Sent { node, session: s, dispatched: d, mut slots } = sent;
        for cmd in d.commands {
            match slots.next() {
                Some(slot) => slot.send(Ok(command_message(node, &cmd))),
                // Cannot happen: at most as many commands were claimed as slots were reserved.
                None => tracing::error!(node = %node, command = %cmd.id, "no reserved slot; the command goes again on reconnect"),
            }
            metrics::counter!("better_compute_gateway_commands_sent_total").increment(1);
            metrics::histogram!("better_compute_gateway_dispatch_seconds").record(cmd.waited_ms.max(0) as f64 / 1000.0);
        }
        drop(slots);
        for id in d.cancels {
            let _ = s.out.try_send(Ok(GatewayMessage { msg: Some(gateway_message::Msg::Cancel(Cancel { command_id: id })) }));
        }
    }

    /// Sends each node its desired state if it is newer than what its session has seen: one read
    /// for all of them.
    pub(crate) async fn push_specs(&self, nodes: &[String]) -> Result<(), DbError> {
        let sessions: Vec<(&String, Arc<hub::Session>)> = nodes.iter().filter_map(|n| Some((n, self.hub.get(n)?))).collect();
        if sessions.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = sessions.iter().map(|(n, _)| n.as_str()).collect();
        let mut specs = {
            let mut c = self.pool.get().await?;
            let tx = c.transaction().await?;
            let d = sessions::desired_states(&*tx, &ids).await?;
            tx.commit().await?;
            d
        };
        for (node, s) in sessions {
            let Some((generation, json)) = specs.remove(node.as_str()) else { continue };
            if s.claim_generation(generation) {
                send_spec(node, &s, generation, json);
            }
        }
        Ok(())
    }
}

/// Sends a stored desired state down a session; a full queue forgets the send, so the next poll
/// sends it again.
pub(crate) fn send_spec(node_id: &str, s: &hub::Session, generation: i64, json: serde_json::Value) {
    let spec: NodeSpec = match serde_json::from_value(json) {
        Ok(spec) => spec,
        Err(e) => {
            tracing::error!(node = %node_id, error = %e, "stored spec does not parse as NodeSpec");
            return;
        }
    };
    let msg = GatewayMessage { msg: Some(gateway_message::Msg::DesiredState(DesiredState { generation, spec: Some(spec) })) };
    if s.out.try_send(Ok(msg)).is_err() {
        tracing::warn!(node = %node_id, "session queue full; desired state goes again on the next poll");
        s.reset_generation(generation - 1);
    }
}

pub(crate) fn command_message(node_id: &str, c: &sessions::Dispatch) -> GatewayMessage {
    let body = CommandBody::decode(c.body.as_slice()).unwrap_or_default();
    GatewayMessage {
        msg: Some(gateway_message::Msg::Command(Command {
            command_id: c.id.clone(),
            node_id: node_id.to_owned(),
            seq: c.seq,
            kind: c.kind.clone(),
            lane: c.lane.clone(),
            body: Some(body),
            min_generation: c.min_generation,
            expires_in_ms: c.expires_in_ms,
            retry_safe: c.retry_safe,
            not_after_unix_ms: c.not_after_unix_ms,
            signature: c.signature.clone(),
            trace_parent: c.trace_parent.clone(),
        })),
    }
}

/// Turns command and desired-state notifications into pokes until shutdown. A full poke queue
/// drops the poke: the poll covers it.
pub(crate) async fn listen_for_pokes(url: String, pokes: tokio::sync::mpsc::Sender<Poke>, mut shutdown: watch::Receiver<bool>) {
    use better_compute_nodes::commands::COMMANDS_CHANNEL;
    use better_compute_runtime::nodespec::NODESPEC_CHANNEL;
    let listen = better_compute_runtime::work_queue::listen(url, &[COMMANDS_CHANNEL, NODESPEC_CHANNEL], move |channel, node| {
        let poke = if channel == NODESPEC_CHANNEL { Poke::Spec(node.to_owned()) } else { Poke::Commands(node.to_owned()) };
        let _ = pokes.try_send(poke);
    });
    tokio::select! {
        _ = shutdown.wait_for(|s| *s) => {}
        _ = listen => {}
    }
}
