//! Dispatch: desired state and commands sent down sessions, on pokes (LISTEN/NOTIFY) and by polling.

use super::*;

/// Nodes whose desired state one read fetches at most.
pub(crate) const SPEC_PUSH_BATCH: usize = 256;

/// A wake-up for one node.
#[derive(Debug, Clone)]
pub(crate) enum Poke {
    Commands(String),
    Spec(String),
}

impl Inner {
    /// Runs pokes with bounded concurrency. Desired-state pokes that have arrived together (a
    /// change to a whole site wakes thousands) go as one read of up to [`SPEC_PUSH_BATCH`] nodes.
    pub(crate) async fn poke_loop(self: Arc<Self>, mut pokes: tokio::sync::mpsc::Receiver<Poke>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let poke = tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                p = pokes.recv() => match p { Some(p) => p, None => return },
            };
            let mut specs = Vec::new();
            let mut next = Some(poke);
            while let Some(p) = next.take() {
                match p {
                    Poke::Spec(n) => specs.push(n),
                    Poke::Commands(n) => self.clone().spawn_dispatch(n).await,
                }
                if specs.len() < SPEC_PUSH_BATCH {
                    next = pokes.try_recv().ok();
                }
            }
            if !specs.is_empty() {
                self.clone().spawn_spec_push(specs).await;
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

    /// Dispatches `node`'s due commands in a task of its own under a dispatch permit.
    pub(crate) async fn spawn_dispatch(self: Arc<Self>, node: String) {
        if self.hub.get(&node).is_none() {
            return;
        }
        let Ok(permit) = self.dispatching.clone().acquire_owned().await else { return };
        tokio::spawn(async move {
            if let Err(e) = self.dispatch(&node).await {
                tracing::warn!(node = %node, error = %e, "dispatch failed; the poll retries");
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
            let found = (session::nodes_with_work(&*tx, &self.cfg.id).await?, session::nodes_behind(&*tx, &self.cfg.id).await?);
            tx.commit().await?;
            found
        };
        for n in work {
            self.clone().spawn_dispatch(n).await;
        }
        let behind: Vec<String> =
            behind.into_iter().filter(|(n, generation)| self.hub.get(n).is_some_and(|s| s.sent_generation() < *generation)).map(|(n, _)| n).collect();
        for nodes in behind.chunks(SPEC_PUSH_BATCH) {
            self.clone().spawn_spec_push(nodes.to_vec()).await;
        }
        Ok(())
    }

    /// Sends the node its due pending commands (as many as its queue has room for) and Cancel for
    /// in-flight ones someone cancelled. A superseded session is dropped.
    pub(crate) async fn dispatch(&self, node_id: &str) -> Result<(), DbError> {
        let Some(s) = self.hub.get(node_id) else { return Ok(()) };
        let mut c = self.pool.get().await?;
        let tx = c.transaction().await?;
        let d = self.dispatch_in(&*tx, node_id, &s).await?;
        tx.commit().await?;
        if let Some(d) = d {
            self.send_dispatched(node_id, &s, d);
        }
        Ok(())
    }

    /// The database side of a dispatch, in the caller's transaction: `None` when there is no room
    /// in the session's queue, or the session was superseded (then it is dropped here). Room is
    /// reserved before any command is claimed, so a command moved to `sent` always has its slot,
    /// however many dispatches for the node run at once.
    pub(crate) async fn dispatch_in<'s>(
        &self,
        tx: &impl tokio_postgres::GenericClient,
        node_id: &str,
        s: &'s hub::Session,
    ) -> Result<Option<(session::Dispatched, Reserved<'s>)>, DbError> {
        let room = s.out.capacity().min(64);
        // Nothing reserved: a slow daemon's queue is full, and the poll comes back to it.
        let Ok(slots) = s.out.try_reserve_many(room.max(1)) else { return Ok(None) };
        let d = session::dispatch(tx, node_id, &self.cfg.id, s.epoch, room.max(1) as i64).await?;
        match d {
            Some(d) => Ok(Some((d, slots))),
            None => {
                self.hub.remove(node_id, s.epoch, "this session was closed or superseded");
                Ok(None)
            }
        }
    }

    /// Sends what a committed dispatch moved to `sent`, into the slots reserved for it.
    pub(crate) fn send_dispatched(&self, node_id: &str, s: &hub::Session, (d, mut slots): (session::Dispatched, Reserved<'_>)) {
        for cmd in d.commands {
            match slots.next() {
                Some(slot) => slot.send(Ok(command_message(node_id, &cmd))),
                // Cannot happen: at most as many commands were claimed as slots were reserved.
                None => tracing::error!(node = %node_id, command = %cmd.id, "no reserved slot; the command goes again on reconnect"),
            }
            metrics::counter!("gateway_commands_sent_total").increment(1);
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
            let d = session::desired_states(&*tx, &ids).await?;
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

pub(crate) fn command_message(node_id: &str, c: &session::Dispatch) -> GatewayMessage {
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
