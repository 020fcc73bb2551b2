use crate::protocol::{
    ConnAck, ConnAckProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode, LastWill,
    LastWillProperties, Packet, PingResp, PubAck, PubAckReason, PubRec, PubRecReason, PubRel,
    PubRelProperties, PubRelReason, Publish, PublishProperties, QoS, SubAck, SubscribeReasonCode,
    UnsubAck, UnsubAckReason,
};
use crate::router::alertlog::alert;
use crate::router::logs::PublishData;
use crate::router::scheduler::{PauseReason, Tracker};
use crate::router::{ConnectionEvents, Forward};
use crate::segments::Position;
use crate::subscriptions::{SubOptions, Subscriptions};
use crate::*;
use flume::{bounded, Receiver, RecvError, Sender, TryRecvError};
use slab::Slab;
use std::collections::{HashMap, HashSet, VecDeque};
use std::str::Utf8Error;
use std::thread;
use std::time::{Duration, Instant, SystemTime};
use thiserror::Error;
use tracing::{debug, error, info, trace, warn};

use super::alertlog::{Alert, AlertLog};
use super::graveyard::Graveyard;
use super::iobufs::{Incoming, Outgoing};
use super::logs::{AckLog, DataLog, Held, LogCounts};
use super::scheduler::{ScheduleReason, Scheduler};
use super::shared_subs::{not_for, unmark, SharedGroup};
use super::{
    packetid, Connection, DataRequest, Event, FilterIdx, Meter, Notification, Print, RouterMeter,
    ShadowRequest, MAX_CHANNEL_CAPACITY, MAX_SCHEDULE_ITERATIONS,
};

#[derive(Error, Debug)]
pub enum RouterError {
    #[error("Receive error = {0}")]
    Recv(#[from] RecvError),
    #[error("Try Receive error = {0}")]
    TryRecv(#[from] TryRecvError),
    #[error("Disconnection")]
    Disconnected,
    #[error("Topic not utf-8")]
    NonUtf8Topic(#[from] Utf8Error),
    #[cfg(feature = "validate-tenant-prefix")]
    #[error("Bad Tenant")]
    BadTenant(String, String),
    #[error("No matching filters to topic {0}")]
    NoMatchingFilters(String),
    #[error("Invalid filter prefix {0}")]
    InvalidFilterPrefix(Filter),
    #[error("Invalid client_id {0}")]
    InvalidClientId(String),
    #[error("Disconnection (Reason: {0:?})")]
    Disconnect(DisconnectReasonCode),
}

// TODO: set this to some appropriate value
const TOPIC_ALIAS_MAX: u16 = 4096;

pub struct Router {
    id: RouterId,
    /// Id of this router. Used to index native commitlog to store data from
    /// local connections
    config: RouterConfig,
    /// Saved state of dead persistent connections
    graveyard: Graveyard,
    /// List of MetersLink's senders
    meters: Slab<Sender<Vec<Meter>>>,
    /// List of AlertsLink's senders with their respective subscription Filter
    alerts: Slab<Sender<Vec<Alert>>>,
    /// List of connections
    connections: Slab<Connection>,
    /// Connection map from device id to connection id
    connection_map: HashMap<String, ConnectionId>,
    /// Subscription map to interested connection ids
    subscription_map: HashMap<Filter, HashSet<ConnectionId>>,
    /// Subscriptions (live or kept for a persistent session) using each
    /// filter's log, by filter without `$share/group/`: a log is freed when
    /// its last subscription ends (statebroker patch 8).
    filter_users: HashMap<Filter, usize>,
    /// Incoming data grouped by connection
    ibufs: Slab<Incoming>,
    /// Outgoing data grouped by connection
    obufs: Slab<Outgoing>,
    /// Data log of all the subscriptions
    datalog: DataLog,
    /// Data log of all the alert subscriptions
    alertlog: AlertLog,
    /// Acks log per connection
    ackslog: Slab<AckLog>,
    /// Scheduler to schedule connections
    scheduler: Scheduler,
    /// Parked requests that are ready because of new data on the subscription
    notifications: VecDeque<(ConnectionId, DataRequest)>,
    /// Channel receiver to receive data from all the active connections and
    /// replicators. Each connection will have a tx handle which they use
    /// to send data and requests to router
    router_rx: Receiver<(ConnectionId, Event)>,
    /// Channel sender to send data to this router. This is given to active
    /// network connections, local connections and replicators to communicate
    /// with this router
    router_tx: Sender<(ConnectionId, Event)>,
    /// Router metrics
    router_meters: RouterMeter,
    /// Buffer for cache exchange of incoming packets
    cache: Option<VecDeque<Packet>>,
    /// Shared subscriptions map <group-name, group>
    shared_subscriptions: HashMap<String, SharedGroup>,
    /// The shared subscriptions with members here, for other threads
    /// (statebroker patch 28).
    groups: tokio::sync::watch::Sender<std::collections::BTreeSet<String>>,
    /// Will messages per client_id
    last_wills: HashMap<String, (LastWill, Option<LastWillProperties>)>,
    /// Who subscribes to what, by client id, readable from other threads
    /// (statebroker patch 16).
    subscriptions: std::sync::Arc<Subscriptions>,
    /// Where the changes a restart must not lose go (statebroker patch 16).
    journal: Option<std::sync::Arc<dyn Journal>>,
    /// When the last WARN line about refused publishes was written, and
    /// those refused since (statebroker patch 23).
    refusals: (Option<Instant>, u64),
    /// Some session chose `QueueFull::Refuse` for itself since the start:
    /// publishes are then checked against kept sessions' queues even where
    /// the router's setting drops the oldest (statebroker patch 25).
    sessions_may_refuse: bool,
    /// Bytes of the clients' QoS 2 publishes waiting for their PUBREL, of
    /// connections and kept sessions together (statebroker patch 47).
    held_qos2: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Router {
    pub fn new(router_id: RouterId, config: RouterConfig) -> Router {
        let (router_tx, router_rx) = bounded(1000);

        let meters = Slab::with_capacity(10);
        let alerts = Slab::with_capacity(10);
        let connections = Slab::with_capacity(config.max_connections);
        let ibufs = Slab::with_capacity(config.max_connections);
        let obufs = Slab::with_capacity(config.max_connections);
        let ackslog = Slab::with_capacity(config.max_connections);

        let router_metrics = RouterMeter {
            router_id,
            ..RouterMeter::default()
        };

        let max_connections = config.max_connections;
        Router {
            id: router_id,
            config: config.clone(),
            graveyard: Graveyard::new(),
            meters,
            alerts,
            connections,
            connection_map: Default::default(),
            subscription_map: Default::default(),
            filter_users: Default::default(),
            ibufs,
            obufs,
            datalog: DataLog::new(config.clone()).unwrap(),
            alertlog: AlertLog::new(config),
            ackslog,
            scheduler: Scheduler::with_capacity(max_connections),
            notifications: VecDeque::with_capacity(1024),
            router_rx,
            router_tx,
            router_meters: router_metrics,
            cache: Some(VecDeque::with_capacity(MAX_CHANNEL_CAPACITY)),
            shared_subscriptions: HashMap::new(),
            groups: tokio::sync::watch::Sender::new(Default::default()),
            last_wills: HashMap::new(),
            subscriptions: Default::default(),
            journal: None,
            refusals: (None, 0),
            sessions_may_refuse: false,
            held_qos2: Default::default(),
        }
    }

    /// Saves durable changes to `journal` (statebroker patch 16).
    pub fn set_journal(&mut self, journal: std::sync::Arc<dyn Journal>) {
        self.journal = Some(journal);
    }

    /// The shared subscriptions (`$share/g/filter`) with members here,
    /// kept up to date by the router once spawned (statebroker patch 28).
    pub fn shared_groups(
        &self,
    ) -> tokio::sync::watch::Receiver<std::collections::BTreeSet<String>> {
        self.groups.subscribe()
    }

    /// The subscriptions by client id, kept up to date by the router once
    /// spawned (statebroker patch 16).
    pub fn subscriptions(&self) -> std::sync::Arc<Subscriptions> {
        std::sync::Arc::clone(&self.subscriptions)
    }

    /// Gets handle to the router. This is not a public method to ensure that link
    /// is created only after the router starts
    fn link(&self) -> Sender<(ConnectionId, Event)> {
        self.router_tx.clone()
    }

    // pub(crate) fn get_replica_handle(&mut self, _replica_id: NodeId) -> (LinkTx, LinkRx) {
    //     unimplemented!()
    // }

    /// Starts the router in a background thread and returns link to it. Link
    /// to communicate with router should only be returned only after it starts.
    /// For that reason, all the public methods should start the router in the
    /// background
    #[tracing::instrument(skip_all)]
    /// The number of retained messages held, kept up to date by the router
    /// once spawned (statebroker patch 14).
    pub fn retained_count(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        std::sync::Arc::clone(&self.datalog.retained_count)
    }

    /// The number of message logs and the bytes they hold, kept up to
    /// date by the router once spawned (statebroker patch 20).
    pub fn log_counts(&self) -> std::sync::Arc<LogCounts> {
        std::sync::Arc::clone(&self.datalog.counts)
    }

    /// Starts the router on its own thread; `stopped` is set to `true`
    /// when the thread ends, by an error or a panic (statebroker patch 44:
    /// the broker's health checks and its binary watch it).
    pub fn spawn(
        mut self,
        stopped: tokio::sync::watch::Sender<bool>,
    ) -> Sender<(ConnectionId, Event)> {
        let link = self.link();
        spawn_watched(format!("router-{}", self.id), stopped, move || {
            let e = self.run(0);
            error!(reason=?e, "Router done!");
        });
        link
    }

    /// Waits on incoming events when ready queue is empty.
    /// After pulling 1 event, tries to pull 500 more events
    /// before polling ready queue 100 times (connections)
    #[tracing::instrument(skip_all)]
    fn run(&mut self, count: usize) -> Result<(), RouterError> {
        match count {
            0 => loop {
                self.run_inner()?;
            },
            n => {
                for _ in 0..n {
                    self.run_inner()?;
                }
            }
        };

        Ok(())
    }

    fn run_inner(&mut self) -> Result<(), RouterError> {
        // Block on incoming events if there are no ready connections for consumption
        if self.consume().is_none() {
            // Wake at least once a second to end expired sessions
            // (statebroker patch 9).
            match self.router_rx.recv_timeout(Duration::from_secs(1)) {
                Ok((id, data)) => self.events(id, data),
                Err(flume::RecvTimeoutError::Timeout) => {}
                Err(flume::RecvTimeoutError::Disconnected) => {
                    return Err(RouterError::Disconnected);
                }
            }
        }
        self.end_expired_sessions();

        // Try reading more from connections in a non-blocking
        // fashion to accumulate data and handle subscriptions.
        // Accumulating more data lets requests retrieve bigger
        // bulks which in turn increases efficiency
        for _ in 0..500 {
            // All these methods will handle state and errors
            match self.router_rx.try_recv() {
                Ok((id, data)) => self.events(id, data),
                Err(TryRecvError::Disconnected) => return Err(RouterError::Disconnected),
                Err(TryRecvError::Empty) => break,
            }
        }

        // A connection should not be scheduled multiple times
        #[cfg(debug_assertions)]
        if let Some(readyqueue) = self.scheduler.check_readyqueue_duplicates() {
            warn!(
                "Connection was scheduled multiple times in readyqueue: {:?}",
                readyqueue
            );
        }

        // Poll 100 connections which are ready in ready queue
        for _ in 0..100 {
            self.consume();
        }

        // self.send_all_alerts();
        Ok(())
    }

    fn events(&mut self, id: ConnectionId, data: Event) {
        // patch 37: per event, so not at the default level (see PATCHES.md).
        let span = tracing::debug_span!("[>] incoming", connection_id = id);
        let _guard = span.enter();

        match data {
            Event::Connect {
                connection,
                incoming,
                outgoing,
            } => self.handle_new_connection(connection, incoming, outgoing),
            Event::NewMeter(tx) => self.handle_new_meter(tx),
            Event::NewAlert(tx) => self.handle_new_alert(tx),
            Event::DeviceData => self.handle_device_payload(id),
            Event::Disconnect => self.handle_disconnection(id, None),
            Event::Ready => self.scheduler.reschedule(id, ScheduleReason::Ready),
            Event::Shadow(request) => {
                retrieve_shadow(&mut self.datalog, &mut self.obufs[id], request)
            }
            Event::SendAlerts => {
                self.send_alerts();
            }
            Event::SendMeters => {
                self.send_meters();
            }
            Event::PrintStatus(metrics) => print_status(self, metrics),
            Event::PublishWill((client_id, _tenant_id)) => self.handle_last_will(
                client_id,
                #[cfg(feature = "validate-tenant-prefix")]
                _tenant_id,
            ),
            Event::Restore(restore, done) => {
                self.restore(restore);
                let _ = done.send(());
            }
            Event::Replace(client_id, session, done) => {
                let _ = done.send(self.replace_session(&client_id, session));
            }
        }
    }

    fn handle_new_connection(
        &mut self,
        mut connection: Connection,
        incoming: Incoming,
        mut outgoing: Outgoing,
    ) {
        let client_id = outgoing.client_id.clone();
        if let Err(err) = validate_clientid(&client_id) {
            error!("Invalid client_id: {}", err);
            return;
        };

        let span = tracing::info_span!("incoming_connect", client_id);
        let _guard = span.enter();

        // A connection that would add a kept session beyond the bound is
        // refused before it touches anything (a live connection of the same
        // client id stays); one whose client id has a kept session already
        // (it resumes or replaces it) never is (statebroker patch 22).
        let limit = self.config.max_kept_sessions;
        if limit > 0
            && connection.session_expiry > 0
            && !self.subscriptions.has_kept_session(&client_id)
            && self.subscriptions.kept_sessions() >= limit
        {
            debug!(limit, "kept sessions at the bound: connection refused");
            let ack = ConnAck {
                session_present: false,
                code: ConnectReturnCode::QuotaExceeded,
            };
            let refused = Notification::DeviceAck(Ack::ConnAck(0, ack, None));
            outgoing.data_buffer.lock().push_back(refused);
            outgoing.handle.try_send(()).ok();
            return;
        }

        if cfg!(not(feature = "allow-duplicate-clientid")) {
            // Check if same client_id already exists and if so, replace it with this new connection
            // ref: https://docs.oasis-open.org/mqtt/mqtt/v3.1.1/os/mqtt-v3.1.1-os.html#_Toc398718032

            let connection_id = self.connection_map.get(&client_id);
            if let Some(connection_id) = connection_id {
                // patch 12: a client id connecting again takes its session
                // over (MQTT 3.1.4-3): normal, not an error. The broker's
                // connection layer logs the takeover itself.
                debug!(
                    "Duplicate client_id, dropping previous connection with connection_id: {}",
                    connection_id
                );
                self.handle_disconnection(*connection_id, None);
            }
        }

        if self.connections.len() >= self.config.max_connections {
            error!("no space for new connection");
            // let ack = ConnectionAck::Failure("No space for new connection".to_owned());
            // let message = Notification::ConnectionAck(ack);
            return;
        }

        // Retrieve previous connection state from graveyard
        let mut saved = self.graveyard.retrieve(&client_id);
        let clean_session = connection.clean;
        // A clean start ends the kept session, and so does its expiry:
        // its subscriptions stop holding their filters' logs (statebroker
        // patches 8 and 9).
        let expired = saved
            .as_ref()
            .and_then(|s| s.expires_at)
            .is_some_and(|at| at <= Instant::now());
        if clean_session || expired {
            let state = saved.as_mut().and_then(|s| s.session_state.take());
            self.end_session(
                &client_id,
                state.map(|s| s.subscriptions).unwrap_or_default(),
            );
        }
        let previous_session = saved.as_ref().is_some_and(|s| s.session_state.is_some());
        // for qos2 pending pubrels
        let mut pending_acks = VecDeque::new();
        // incoming qos2 publishes waiting for their pubrel
        let mut incoming_qos2 = Held::new(std::sync::Arc::clone(&self.held_qos2));

        let tracker = if !clean_session {
            // if there was some saved state, restore the metrics
            // and get the session's state if present
            let saved_state = saved.and_then(|saved| {
                connection.events = saved.metrics;
                saved.session_state
            });

            // if session's state is present, restore that session
            // otherwise, just start new one
            saved_state.map_or_else(
                || Tracker::new(client_id.clone()),
                |session_state| {
                    connection.subscriptions = session_state.subscriptions;
                    connection.subscription_ids = session_state.subscription_ids;
                    // for using in acklog
                    pending_acks.clone_from(&session_state.unacked_pubrels);
                    outgoing.unacked_pubrels = session_state.unacked_pubrels;
                    outgoing.resume(session_state.replay);
                    incoming_qos2 = session_state.incoming_qos2;
                    session_state.tracker
                },
            )
        } else {
            // Only retrieve metrics in clean session
            connection.events = saved.map_or_else(ConnectionEvents::default, |s| s.metrics);
            Tracker::new(client_id.clone())
        };

        // A resumed session's shared subscriptions take their turns again
        // (statebroker patch 27: it kept the subscriptions, outside their
        // groups).
        let groups: Vec<_> = tracker
            .data_requests
            .iter()
            .filter_map(|r| Some((r.group.clone()?, r.cursor)))
            .collect();
        for (group, cursor) in groups {
            self.join_group(&group, client_id.clone(), cursor);
        }

        let mut ackslog = AckLog::new(std::sync::Arc::clone(&self.held_qos2));
        ackslog.restore_recorded(incoming_qos2);

        let time = match SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
            Ok(v) => v.as_millis().to_string(),
            Err(e) => format!("Time error = {e:?}"),
        };

        let event = "connection at ".to_owned() + &time + ", clean = " + &clean_session.to_string();
        connection.events.events.push_back(event);

        if connection.events.events.len() > 10 {
            connection.events.events.pop_front();
        }

        if let Some(will) = connection.last_will.take() {
            self.last_wills.insert(
                client_id.clone(),
                (will, connection.last_will_properties.take()),
            );
        }

        // A session that outlives this connection is saved now, one that
        // ends with it is no longer (statebroker patch 16).
        let kept = connection.session_expiry > 0;
        self.sessions_may_refuse |= kept && connection.queue_full == Some(QueueFull::Refuse);
        let was_kept = self.subscriptions.has_kept_session(&client_id);
        self.subscriptions.set_kept(&client_id, kept);
        if let Some(journal) = &self.journal {
            if kept {
                let record = self.subscriptions.record(
                    &client_id,
                    connection.session_expiry,
                    connection.queue_full,
                    None,
                );
                journal.session(&client_id, Some(&record));
            } else if was_kept {
                journal.session(&client_id, None);
            }
        }

        let connection_id = self.connections.insert(connection);
        assert_eq!(self.ibufs.insert(incoming), connection_id);
        assert_eq!(self.obufs.insert(outgoing), connection_id);

        self.connection_map.insert(client_id.clone(), connection_id);
        // A resumed session's subscriptions are this connection's: an
        // UNSUBSCRIBE finds them, as patch 23's check does (statebroker
        // patch 26; upstream left them out until subscribed again).
        for filter in &self.connections[connection_id].subscriptions {
            self.subscription_map
                .entry(filter.clone())
                .or_default()
                .insert(connection_id);
        }
        info!(connection_id, "Client connection registered");

        assert_eq!(self.ackslog.insert(ackslog), connection_id);
        assert_eq!(self.scheduler.add(tracker), connection_id);

        // Check if there are multiple data requests on same filter.
        debug_assert!(self
            .scheduler
            .check_tracker_duplicates(connection_id)
            .is_none());

        let ack = ConnAck {
            session_present: !clean_session && previous_session,
            code: ConnectReturnCode::Success,
        };

        let properties = ConnAckProperties {
            topic_alias_max: Some(TOPIC_ALIAS_MAX),
            ..Default::default()
        };

        let ackslog = self.ackslog.get_mut(connection_id).unwrap();
        ackslog.connack(connection_id, ack, Some(properties));

        pending_acks.into_iter().for_each(|pkid| {
            // NOTE: will it be better if we store the whole PubRel
            // instead of pkid in pending acks
            let pubrel = PubRel {
                pkid,
                reason: PubRelReason::Success,
            };
            ackslog.pubrel(pubrel)
        });

        self.scheduler
            .reschedule(connection_id, ScheduleReason::Init);

        self.router_meters.total_connections += 1;
    }

    fn handle_new_meter(&mut self, tx: Sender<Vec<Meter>>) {
        let _meter_id = self.meters.insert(tx);
    }

    fn handle_new_alert(&mut self, tx: Sender<Vec<Alert>>) {
        let _alert_id = self.alerts.insert(tx);
    }

    fn handle_disconnection(&mut self, id: ConnectionId, reason: Option<DisconnectReasonCode>) {
        // Some clients can choose to send Disconnect packet before network disconnection.
        // This will lead to double Disconnect packets in router `events`
        let client_id = match &self.obufs.get(id) {
            Some(v) => v.client_id.clone(),
            None => {
                // patch 12: a client's DISCONNECT packet removes the
                // connection, and the link's own Disconnect event follows:
                // normal, not an error.
                debug!("connection id {} is already gone", id);
                return;
            }
        };

        let span = tracing::info_span!("incoming_disconnect", client_id);
        let _guard = span.enter();

        // must handle last will before sending disconnect packet
        // as the disconnecting client might have subscribed to will topic.
        // if execute_last_will {
        //     self.handle_last_will(id);
        // }

        info!("Disconnecting connection");

        if let Some(reason_code) = reason {
            let outgoing = match self.obufs.get_mut(id) {
                Some(v) => v,
                None => {
                    debug!("connection id {} is already gone", id);
                    return;
                }
            };

            let disconnect = Disconnect { reason_code };

            let disconnect_notification = Notification::Disconnect(disconnect, None);

            outgoing
                .data_buffer
                .lock()
                .push_back(disconnect_notification);

            outgoing.handle.try_send(()).ok();
        }

        // Remove connection from router
        let connection = self.connections.remove(id);
        let _incoming = self.ibufs.remove(id);
        let outgoing = self.obufs.remove(id);
        let mut tracker = self.scheduler.remove(id);
        self.connection_map.remove(&client_id);
        let incoming_qos2 = self.ackslog.remove(id).take_recorded();

        // Don't remove connection id from readyqueue with index. This will
        // remove wrong connection from readyqueue. Instead just leave disconnected
        // connection in readyqueue and allow 'consume()' method to deal with this
        // self.readyqueue.remove(id);

        let inflight_data_requests = self.datalog.clean(id);
        let retransmissions = outgoing.retransmission_map();
        let mut replay = outgoing.replay_state();

        // Remove connections from all groups and
        // discard empty group ( group with no client )
        // note: can we do this in better way?
        let groups = &self.groups;
        self.shared_subscriptions.retain(|name, group| {
            group.remove_client(&client_id);
            let keep = !group.is_empty();
            if !keep {
                groups.send_modify(|g| {
                    g.remove(name);
                });
            }
            keep
        });

        // Remove this connection from subscriptions
        for filter in connection.subscriptions.iter() {
            if let Some(connections) = self.subscription_map.get_mut(filter) {
                connections.remove(&id);
                if connections.is_empty() {
                    self.subscription_map.remove(filter);
                }
            }
        }
        let mut connection = connection;

        // Add disconnection event to metrics
        let time = match SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
            Ok(v) => v.as_millis().to_string(),
            Err(e) => format!("Time error = {e:?}"),
        };

        let event = "disconnection at ".to_owned() + &time;
        connection.events.events.push_back(event);

        if connection.events.events.len() > 10 {
            connection.events.events.pop_front();
        }

        // Save the state of a session that outlives its connection (MQTT 5:
        // a Session Expiry Interval above 0; 3.1.1: clean session 0)
        // (statebroker patch 9).
        if connection.session_expiry > 0 {
            // Add inflight data requests back to tracker
            inflight_data_requests
                .into_iter()
                .for_each(|r| tracker.register_data_request(r));

            for request in tracker.data_requests.iter_mut() {
                if let Some(cursor) = retransmissions.get(&request.filter_idx) {
                    // What was sent is read again from the first
                    // unacknowledged publish (statebroker patch 11).
                    replay.sent_up_to(request.filter_idx, request.cursor);
                    request.cursor = *cursor;
                    // Reset the group's cursor. The group is gone when
                    // this connection was its last member (removed above):
                    // nothing to reset, and a client's disconnect must not
                    // panic the router (statebroker patch 44).
                    if let Some(group) = request
                        .group
                        .as_ref()
                        .and_then(|name| self.shared_subscriptions.get_mut(name))
                    {
                        group.cursor = *cursor;
                    }
                }
            }

            // Saved with the time, so that its expiry keeps counting while
            // the broker is down (statebroker patch 16).
            if let Some(journal) = &self.journal {
                let record = self.subscriptions.record(
                    &client_id,
                    connection.session_expiry,
                    connection.queue_full,
                    Some(unix_ms()),
                );
                journal.session(&client_id, Some(&record));
            }
            self.graveyard.save_state(
                tracker,
                connection.queue_full,
                connection.subscriptions,
                connection.subscription_ids,
                connection.events,
                outgoing.unacked_pubrels,
                incoming_qos2,
                replay,
                (connection.session_expiry != u32::MAX).then(|| {
                    Instant::now() + Duration::from_secs(u64::from(connection.session_expiry))
                }),
            );
        } else {
            // A clean session ends here: nothing of it is kept (statebroker
            // patch 8: its metrics used to stay in the graveyard forever),
            // and the logs only it used are freed.
            self.end_session(&client_id, &connection.subscriptions);
        }
        self.router_meters.total_connections -= 1;
    }

    /// Whether appending `publish` would push out of a log it goes to a
    /// message that a kept session subscribed at QoS 1 or 2 has not had
    /// yet (read or not, unacknowledged: a reconnection reads it again):
    /// the client id of one such session (statebroker patch 23). Looks at
    /// the subscribers only when the append would push anything out.
    fn fills_a_kept_queue(&mut self, publish: &Publish) -> Option<String> {
        let topic = std::str::from_utf8(&publish.topic).ok()?;
        let size = 4 + publish.topic.len() + publish.payload.len();
        for idx in self.datalog.matches(topic)? {
            let Some((below, filter)) = self.datalog.evicts_below(idx, size) else {
                continue;
            };
            let reads_before = |cursor: Option<(u64, u64)>| cursor.is_some_and(|c| c.1 < below);
            for &id in self.subscription_map.get(filter).into_iter().flatten() {
                let Some(connection) = self.connections.get(id) else {
                    continue;
                };
                let refuses = connection.queue_full.unwrap_or(self.config.queue_full);
                if connection.session_expiry == 0 || refuses != QueueFull::Refuse {
                    continue;
                }
                let at_qos =
                    |r: &&DataRequest| r.filter_idx == idx && r.qos > 0 && r.group.is_none();
                let tracked = self
                    .scheduler
                    .trackers
                    .get(id)
                    .and_then(|t| t.data_requests.iter().find(at_qos))
                    .map(|r| r.cursor);
                let woken = self
                    .notifications
                    .iter()
                    .filter(|(n, _)| *n == id)
                    .map(|(_, r)| r)
                    .find(at_qos)
                    .map(|r| r.cursor);
                let unacked = self.obufs.get(id).and_then(|o| o.first_unacked(idx));
                if reads_before(tracked) || reads_before(woken) || reads_before(unacked) {
                    return Some(connection.client_id.clone());
                }
            }
            if let Some(client) = self
                .graveyard
                .reads_before(idx, below, self.config.queue_full)
            {
                return Some(client.to_owned());
            }
        }
        None
    }

    /// Whether `client_id` is one of the broker's own links (its `$SYS`
    /// statistics, other cluster nodes' copies): not held to the bounds
    /// of patches 46 and 47, which are the clients'.
    fn is_internal(&self, client_id: &str) -> bool {
        let prefix = &self.config.internal_prefix;
        !prefix.is_empty() && client_id.starts_with(prefix.as_str())
    }

    /// Which retained bound `publish` (retained, not empty) of a client
    /// (not one of the broker's own links) would pass (statebroker patch
    /// 46).
    fn passes_retained_bound(
        &mut self,
        client_id: &str,
        publish: &Publish,
    ) -> Option<&'static str> {
        if !publish.retain || publish.payload.is_empty() || self.is_internal(client_id) {
            return None;
        }
        let topic = std::str::from_utf8(&publish.topic).ok()?;
        self.datalog.retain_refused(
            topic,
            publish.payload.len(),
            self.config.max_retained_messages,
            self.config.max_retained_bytes,
        )
    }

    /// Which bound of the QoS 2 publishes waiting for their PUBREL the
    /// QoS 2 `publish` of connection `id` would pass: its session's, or
    /// everyone's (statebroker patch 47).
    fn passes_held_qos2_bound(
        &self,
        id: ConnectionId,
        client_id: &str,
        publish: &Publish,
        properties: Option<&PublishProperties>,
    ) -> Option<&'static str> {
        let (per_client, total) = (
            self.config.max_unreleased_qos2_bytes,
            self.config.max_unreleased_qos2_bytes_total,
        );
        if per_client == 0 && total == 0 || self.is_internal(client_id) {
            return None;
        }
        let size = Held::size_of(publish, properties);
        let held = self.ackslog.get(id).map_or(0, AckLog::held_bytes);
        if per_client > 0 && held + size > per_client {
            return Some("max_unreleased_qos2_bytes");
        }
        let all = self.held_qos2.load(std::sync::atomic::Ordering::Relaxed);
        if total > 0 && all + size > total {
            return Some("max_unreleased_qos2_bytes_total");
        }
        None
    }

    /// Refuses `publish` from connection `id` (`client_id`), `why`: PUBACK
    /// or PUBREC "quota exceeded" (QoS 0: dropped), counted, and a WARN
    /// line at most every 10 s (statebroker patches 23, 46, 47).
    fn refuse_publish(
        &mut self,
        id: ConnectionId,
        client_id: &str,
        why: &Refused,
        publish: &Publish,
    ) {
        self.datalog.counts.count_refused();
        self.router_meters.failed_publishes += 1;
        let now = Instant::now();
        self.refusals.1 += 1;
        if self
            .refusals
            .0
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(10))
        {
            let refused = std::mem::take(&mut self.refusals.1);
            let topic = String::from_utf8_lossy(&publish.topic);
            match why {
                Refused::KeptQueue(lagging) => warn!(
                    client_id,
                    %topic,
                    kept_session = lagging,
                    refused,
                    "publishes refused (quota exceeded): a kept session's messages would be pushed \
                     out of the filter's log before it has them (queue_full = \"refuse\" for that session)"
                ),
                Refused::Unreleased(bound) => warn!(
                    client_id,
                    %topic,
                    bound,
                    refused,
                    "publishes refused (quota exceeded): QoS 2 publishes waiting for their PUBREL \
                     are at their bound ([broker] {bound})"
                ),
                Refused::Retained(bound) => warn!(
                    client_id,
                    %topic,
                    bound,
                    refused,
                    "publishes refused (quota exceeded): the retained messages are at their bound \
                     ([broker] {bound})"
                ),
            }
            self.refusals.0 = Some(now);
        }
        let Some(ackslog) = self.ackslog.get_mut(id) else {
            return;
        };
        match publish.qos {
            QoS::AtLeastOnce => ackslog.puback(
                PubAck {
                    pkid: publish.pkid,
                    reason: PubAckReason::QuotaExceeded,
                },
                None,
            ),
            QoS::ExactlyOnce => ackslog.pubrec_refused(PubRec {
                pkid: publish.pkid,
                reason: PubRecReason::QuotaExceeded,
            }),
            QoS::AtMostOnce => {}
        }
    }

    /// Handles new incoming data on a topic
    fn handle_device_payload(&mut self, id: ConnectionId) {
        // TODO: Retun errors and move error handling to the caller
        let incoming = match self.ibufs.get_mut(id) {
            Some(v) => v,
            None => {
                // patch 12: data a link sent just before its connection
                // went away; nothing to do.
                debug!("connection id {} is already gone", id);
                return;
            }
        };

        let client_id = incoming.client_id.clone();
        // patch 37: the events below name the client themselves.
        let span = tracing::debug_span!("incoming_payload", client_id);
        let _guard = span.enter();

        // Instead of exchanging, we should just append new incoming packets inside cache
        let mut packets = incoming.exchange(self.cache.take().unwrap());

        let mut force_ack = false;
        let mut new_data = false;
        let mut disconnect = false;
        let mut disconnect_reason: Option<DisconnectReasonCode> = None;

        // info!("{:15.15}[I] {:20} count = {}", client_id, "packets", packets.len());

        for packet in packets.drain(0..) {
            match packet {
                Packet::Publish(publish, properties) => {
                    let span = tracing::debug_span!("publish", topic = ?publish.topic, pkid = publish.pkid);
                    let _guard = span.enter();

                    let qos = publish.qos;
                    let pkid = publish.pkid;

                    // Prepare acks for the above publish
                    // If any of the publish in the batch results in force flush,
                    // set global force flush flag. Force flush is triggered when the
                    // router is in instant ack more or connection data is from a replica
                    //
                    // TODO: handle multiple offsets
                    //
                    // The problem with multiple offsets is that when using replication with the current
                    // architecture, a single publish might get appended to multiple commit logs, resulting in
                    // multiple offsets (see `append_to_commitlog` function), meaning replicas will need to
                    // coordinate using multiple offsets, and we don't have any idea how to do so right now.
                    // Currently as we don't have replication, we just use a single offset, even when appending to
                    // multiple commit logs.

                    // What a restart must not lose is saved first, and the
                    // acknowledgement waits for it (statebroker patch 16). A
                    // QoS 2 publish sent again before its PUBREL is recorded
                    // already: acknowledged again, nothing else (patch 6).
                    let again = qos == QoS::ExactlyOnce && self.ackslog[id].is_recorded(pkid);
                    // A publish that would push out of a log what a kept
                    // session has not had is refused, when so configured
                    // (statebroker patch 23): nothing saved or appended.
                    let refused = if !again
                        && (self.config.queue_full == QueueFull::Refuse || self.sessions_may_refuse)
                    {
                        self.fills_a_kept_queue(&publish).map(Refused::KeptQueue)
                    } else {
                        None
                    };
                    // Nor a QoS 2 one beyond the bounds of those waiting
                    // for their PUBREL (patch 47), nor a retained one
                    // beyond the retained messages' (patch 46).
                    let refused = match refused {
                        None if !again && qos == QoS::ExactlyOnce => self
                            .passes_held_qos2_bound(id, &client_id, &publish, properties.as_ref())
                            .map(Refused::Unreleased),
                        refused => refused,
                    };
                    let refused = match refused {
                        None if !again => self
                            .passes_retained_bound(&client_id, &publish)
                            .map(Refused::Retained),
                        refused => refused,
                    };
                    if let Some(why) = refused {
                        self.refuse_publish(id, &client_id, &why, &publish);
                        force_ack |= qos != QoS::AtMostOnce;
                        continue;
                    }
                    let (queued, receipt) = if again {
                        (None, None)
                    } else {
                        self.save_publish(id, &publish, properties.as_ref())
                    };

                    match qos {
                        QoS::AtLeastOnce => {
                            let puback = PubAck {
                                pkid,
                                reason: PubAckReason::Success,
                            };

                            let ackslog = self.ackslog.get_mut(id).unwrap();
                            ackslog.puback(puback, receipt);
                            force_ack = true;
                        }
                        QoS::ExactlyOnce => {
                            let pubrec = PubRec {
                                pkid,
                                reason: PubRecReason::Success,
                            };

                            let ackslog = self.ackslog.get_mut(id).unwrap();
                            ackslog.pubrec((publish, properties, queued), pubrec, receipt);
                            force_ack = true;
                            continue;
                        }
                        QoS::AtMostOnce => {
                            // Do nothing
                        }
                    };

                    self.router_meters.total_publishes += 1;

                    // Try to append publish to commitlog
                    match append_to_commitlog(
                        id,
                        publish.clone(),
                        properties,
                        queued,
                        &mut self.datalog,
                        &mut self.notifications,
                        &mut self.connections,
                    ) {
                        Ok(_offset) => {
                            // Even if one of the data in the batch is appended to commitlog,
                            // set new data. This triggers notifications to wake waiters.
                            // Don't overwrite this flag to false if it is already true.
                            new_data = true;
                        }
                        Err(e) => {
                            // Disconnect on bad publishes. A rule the
                            // client broke is told to it in DISCONNECT and
                            // is no error of the router (patch 42).
                            if let RouterError::Disconnect(_) = e {
                                info!(client_id, reason = ?e, "Refused a publish");
                            } else {
                                error!(
                                    client_id, reason = ?e, "Failed to append to commitlog"
                                );
                            }
                            self.router_meters.failed_publishes += 1;
                            disconnect = true;

                            if let RouterError::Disconnect(code) = e {
                                disconnect_reason = Some(code)
                            }

                            break;
                        }
                    };

                    let meter = &mut self.ibufs.get_mut(id).unwrap().meter;
                    meter.register_publish(&publish);
                }
                Packet::Subscribe(mut subscribe, props) => {
                    let mut return_codes = Vec::new();
                    let pkid = subscribe.pkid;
                    // let len = s.len();
                    let limit = self.config.max_subscriptions_per_client;
                    let mut over_quota = 0usize;

                    for f in &mut subscribe.filters {
                        // One client's subscriptions are bounded: a new
                        // filter beyond the limit is refused, the others
                        // are applied (statebroker patch 20).
                        let connection = &self.connections[id];
                        if limit > 0
                            && connection.subscriptions.len() >= limit
                            && !connection.subscriptions.contains(&f.path)
                        {
                            over_quota += 1;
                            return_codes.push(SubscribeReasonCode::QuotaExceeded);
                            continue;
                        }

                        let span =
                            tracing::info_span!("subscribe", topic = f.path, pkid = subscribe.pkid);
                        let _guard = span.enter();

                        info!("Adding subscription on topic {}", f.path);
                        let connection = self.connections.get_mut(id).unwrap();

                        if let Err(e) = validate_subscription(connection, f) {
                            warn!(client_id, reason = ?e,"Subscription cannot be validated: {}", e);

                            disconnect = true;
                            break;
                        }

                        let mut filter = f.path.clone();
                        let mut group = None;

                        // A shared subscription is its Share Name and its
                        // filter: the group is named by `$share/g/filter`
                        // whole (MQTT 5 4.8.2; statebroker patch 27).
                        if let Some((_, filter_path)) = extract_group(&f.path) {
                            group = Some(f.path.clone());
                            filter = filter_path;
                        };

                        let subscription_id = props.as_ref().and_then(|p| p.id);

                        if subscription_id == Some(0) {
                            // Patch 42: the decoder refuses it already (patch 41).
                            debug!(client_id, "Subscription identifier can't be 0");
                            disconnect = true;
                            disconnect_reason = Some(DisconnectReasonCode::ProtocolError);
                            break;
                        }

                        let (idx, cursor) = self.datalog.next_native_offset(&filter);

                        // in case of shared sub original_filter will be $share/group/topic
                        // this is because we do want to treat is as diffrent subscription
                        // and create DataRequest, while using the same datalog of "topic"
                        // NOTE: topic & $share/group/topic will have same filteridx!
                        self.prepare_filter(id, cursor, idx, f, group, subscription_id);
                        self.subscriptions.subscribe(
                            &client_id,
                            &f.path,
                            SubOptions::of(f, subscription_id),
                        );

                        let code = match f.qos {
                            QoS::AtMostOnce => SubscribeReasonCode::QoS0,
                            QoS::AtLeastOnce => SubscribeReasonCode::QoS1,
                            QoS::ExactlyOnce => SubscribeReasonCode::QoS2,
                        };

                        return_codes.push(code);
                    }

                    // let meter = &mut self.ibufs.get_mut(id).unwrap().meter;
                    // meter.total_size += len;

                    if over_quota > 0 {
                        warn!(
                            client_id,
                            refused = over_quota,
                            max_subscriptions_per_client = limit,
                            "subscriptions refused: quota exceeded"
                        );
                    }
                    let suback = SubAck { pkid, return_codes };
                    // A persistent session's SUBACK waits for the disk
                    // (statebroker patch 16).
                    let receipt = self.save_session(id);
                    let ackslog = self.ackslog.get_mut(id).unwrap();
                    ackslog.suback(suback, receipt);
                    force_ack = true;
                }
                Packet::Unsubscribe(unsubscribe, _) => {
                    // One UNSUBACK per UNSUBSCRIBE, with a reason per filter:
                    // "no subscription existed" for a filter the client did
                    // not have (statebroker patch 16; the router sent one
                    // UNSUBACK per removed filter and none for the others).
                    let pkid = unsubscribe.pkid;
                    let mut reasons = Vec::with_capacity(unsubscribe.filters.len());
                    for filter in &unsubscribe.filters {
                        let span = tracing::info_span!("unsubscribe", topic = filter, pkid);
                        let _guard = span.enter();

                        debug!("Removing subscription on filter {}", filter);
                        let removed = self.unsubscribe(id, &client_id, filter);
                        reasons.push(if removed {
                            UnsubAckReason::Success
                        } else {
                            UnsubAckReason::NoSubscriptionExisted
                        });
                    }
                    let receipt = self.save_session(id);
                    let unsuback = UnsubAck { pkid, reasons };
                    let ackslog = self.ackslog.get_mut(id).unwrap();
                    ackslog.unsuback(unsuback, receipt);
                    force_ack = true;
                }
                Packet::PubAck(puback, _) => {
                    let span = tracing::info_span!("puback", pkid = puback.pkid);
                    let _guard = span.enter();

                    let outgoing = self.obufs.get_mut(id).unwrap();
                    let pkid = puback.pkid;
                    let Some(queued) = outgoing.register_ack(pkid) else {
                        error!(
                            client_id,
                            pkid, "Unsolicited/ooo ack received for pkid {}", pkid
                        );
                        disconnect = true;
                        break;
                    };
                    self.delivered(&client_id, queued);

                    self.scheduler.reschedule(id, ScheduleReason::IncomingAck);
                }
                Packet::PubRec(pubrec, _) => {
                    let span = tracing::info_span!("pubrec", pkid = pubrec.pkid);
                    let _guard = span.enter();

                    let outgoing = self.obufs.get_mut(id).unwrap();
                    let pkid = pubrec.pkid;
                    let Some(queued) = outgoing.register_ack(pkid) else {
                        error!(
                            client_id,
                            pkid, "Unsolicited/ooo ack received for pkid {}", pkid
                        );
                        disconnect = true;
                        break;
                    };
                    // At QoS 2 the client has the message once it PUBRECs
                    // (statebroker patch 16).
                    self.delivered(&client_id, queued);
                    let outgoing = self.obufs.get_mut(id).unwrap();

                    let ackslog = self.ackslog.get_mut(id).unwrap();
                    let pubrel = PubRel {
                        pkid: pubrec.pkid,
                        reason: PubRelReason::Success,
                    };

                    outgoing.register_pubrec(pubrel.pkid);
                    ackslog.pubrel(pubrel);
                    self.scheduler.reschedule(id, ScheduleReason::IncomingAck);
                }
                Packet::PubRel(pubrel, pubrel_properties) => {
                    let span = tracing::info_span!("pubrel", pkid = pubrel.pkid);
                    let _guard = span.enter();

                    let ackslog = self.ackslog.get_mut(id).unwrap();

                    // A client resends unacknowledged PUBRELs after reconnecting
                    // to a persistent session: the recorded publishes come back
                    // from the graveyard. A PUBREL for a packet id not recorded
                    // (released already) gets PUBCOMP 0x92 (statebroker patch 6).
                    let Some((publish, props, queued)) = ackslog.pubcomp(pubrel.pkid) else {
                        force_ack = true;
                        continue;
                    };
                    force_ack = true;

                    // The front end's word that this one was had already:
                    // PUBCOMP, and nothing delivered (statebroker patch 35).
                    if discards(pubrel_properties.as_ref()) {
                        debug!(
                            pkid = pubrel.pkid,
                            "PUBREL: a recorded QoS 2 publish discarded"
                        );
                        self.forget_discarded(&client_id, &publish, queued);
                        self.scheduler.reschedule(id, ScheduleReason::IncomingAck);
                        continue;
                    }

                    // Try to append publish to commitlog
                    match append_to_commitlog(
                        id,
                        publish,
                        props,
                        queued,
                        &mut self.datalog,
                        &mut self.notifications,
                        &mut self.connections,
                    ) {
                        Ok(_offset) => {
                            // Even if one of the data in the batch is appended to commitlog,
                            // set new data. This triggers notifications to wake waiters.
                            // Don't overwrite this flag to false if it is already true.
                            new_data = true;
                        }
                        Err(e) => {
                            // Disconnect on bad publishes. A rule the
                            // client broke is told to it in DISCONNECT and
                            // is no error of the router (patch 42).
                            if let RouterError::Disconnect(_) = e {
                                info!(client_id, reason = ?e, "Refused a publish");
                            } else {
                                error!(
                                    client_id, reason = ?e, "Failed to append to commitlog"
                                );
                            }
                            self.router_meters.failed_publishes += 1;
                            disconnect = true;
                            break;
                        }
                    };
                    self.scheduler.reschedule(id, ScheduleReason::IncomingAck);
                }
                Packet::PubComp(pubcomp, _) => {
                    let span = tracing::info_span!("pubcomp", pkid = pubcomp.pkid);
                    let _guard = span.enter();

                    let outgoing = self.obufs.get_mut(id).unwrap();
                    let pkid = pubcomp.pkid;
                    if outgoing.register_pubcomp(pkid).is_none() {
                        error!(
                            client_id,
                            pkid, "ack received for pkid {}, but the pkid didn't exists!", pkid
                        );
                        disconnect = true;
                        break;
                    }
                }
                Packet::PingReq(_) => {
                    let ackslog = self.ackslog.get_mut(id).unwrap();
                    ackslog.pingresp(PingResp);

                    force_ack = true;
                }
                Packet::Disconnect(_, properties) => {
                    let span = tracing::info_span!("disconnect");
                    let _guard = span.enter();
                    // MQTT 5 3.14.2.2.2: DISCONNECT may change the Session
                    // Expiry Interval (statebroker patch 9).
                    if let Some(expiry) = properties.and_then(|p| p.session_expiry_interval)
                        && let Some(connection) = self.connections.get_mut(id)
                        && !connection.discarded
                    {
                        connection.session_expiry = expiry;
                    }
                    disconnect = true;
                    // delete the last will message
                    self.last_wills.remove(&client_id);
                    break;
                }
                incoming => {
                    warn!(client_id, packet=?incoming, "Unexpected packet received, ignoring the packet." );
                }
            }
        }

        self.cache = Some(packets);

        // Prepare AcksRequest in tracker if router is operating in a
        // single node mode or force ack request for subscriptions
        if force_ack {
            self.scheduler.reschedule(id, ScheduleReason::FreshData);
        }

        // Notify waiting consumers only if there is publish data. During
        // subscription, data request is added to data waiter. With out this
        // if condition, connection will be woken up even during subscription
        if new_data {
            // Prepare all the consumers which are waiting for new data
            while let Some((id, request)) = self.notifications.pop_front() {
                self.scheduler.track(id, request);
                self.scheduler.reschedule(id, ScheduleReason::FreshData);
            }
        }

        // Incase BytesMut represents 10 packets, publish error/diconnect event
        // on say 5th packet should not block new data notifications for packets
        // 1 - 4. Hence we use a flag instead of diconnecting immediately
        if disconnect {
            self.handle_disconnection(id, disconnect_reason);
        }
    }

    /// Apply filter and prepare this connection to receive subscription data
    /// Handle retained messages as per subscription options!
    fn prepare_filter(
        &mut self,
        id: ConnectionId,
        cursor: Offset,
        filter_idx: FilterIdx,
        filter: &protocol::Filter,
        group: Option<String>,
        subscription_id: Option<usize>,
    ) {
        let filter_path = &filter.path;

        // Add connection id to subscription list
        match self.subscription_map.get_mut(filter_path) {
            Some(connections) => {
                connections.insert(id);
            }
            None => {
                let mut connections = HashSet::new();
                connections.insert(id);
                self.subscription_map
                    .insert(filter_path.clone(), connections);
            }
        }

        // Add/Create shared group
        if let Some(group_name) = &group {
            let client_id = self.connections[id].client_id.clone();
            self.join_group(group_name, client_id, cursor);
        };

        // Prepare consumer to pull data in case of subscription
        let connection = self.connections.get_mut(id).unwrap();

        // The new subscription replaces the old one, its identifier (or
        // the lack of one) included (MQTT 5 [MQTT-3.8.4-3]; statebroker
        // patch 21).
        match subscription_id {
            Some(subscription_id) => {
                connection
                    .subscription_ids
                    .insert(filter_path.clone(), subscription_id);
            }
            None => {
                connection.subscription_ids.remove(filter_path);
            }
        }

        // call to `insert(_)` returns `true` if it didn't contain the filter_path already
        // i.e. its a new subscription
        let new_subscription = connection.subscriptions.insert(filter_path.clone());
        if new_subscription {
            let bare = bare_filter(filter_path);
            *self.filter_users.entry(bare).or_default() += 1;
        }

        // Retained messages are never sent for shared subscriptions; for
        // others the Retain Handling option decides (statebroker patch 2).
        let forward_retained = group.is_none()
            && match filter.retain_forward_rule {
                protocol::RetainForwardRule::OnEverySubscribe => true,
                protocol::RetainForwardRule::OnNewSubscribe => new_subscription,
                protocol::RetainForwardRule::Never => false,
            };

        if new_subscription {
            let request = DataRequest {
                filter: filter_path.clone(),
                filter_idx,
                qos: filter.qos as u8,
                cursor,
                read_count: 0,
                max_count: 100,
                forward_retained,
                group,
                nolocal: filter.nolocal,
                preserve_retain: filter.preserve_retain,
                retained: VecDeque::new(),
            };

            self.scheduler.track(id, request);
            self.scheduler.reschedule(id, ScheduleReason::NewFilter);
            debug_assert!(self.scheduler.check_tracker_duplicates(id).is_none())
        } else {
            // A subscription to a filter the connection has already
            // replaces the old one's options (MQTT 5 3.8.4), and sends the
            // retained messages again with Retain Handling 0.
            let update = |request: &mut DataRequest| {
                request.qos = filter.qos as u8;
                request.nolocal = filter.nolocal;
                request.preserve_retain = filter.preserve_retain;
                request.forward_retained |= forward_retained;
            };
            if let Some(request) = self.scheduler.request_mut(id, filter_path) {
                update(request);
            } else if let Some(mut request) = self.datalog.remove_waiters_for_id(id, filter_path) {
                update(&mut request);
                self.scheduler.track(id, request);
            }
            self.scheduler.reschedule(id, ScheduleReason::NewFilter);
        }

        let meter = &mut self.ibufs.get_mut(id).unwrap().meter;
        meter.register_subscription(filter_path.clone());
    }

    /// Ends the kept sessions whose Session Expiry Interval passed: their
    /// state goes, and their subscriptions stop holding logs (statebroker
    /// patch 9).
    fn end_expired_sessions(&mut self) {
        // The common case costs no clock read.
        if !self.graveyard.has_deadlines() {
            return;
        }
        for state in self.graveyard.expired(Instant::now()) {
            debug!(client_id = state.tracker.id, "session expired");
            self.end_session(&state.tracker.id, &state.subscriptions);
        }
    }

    /// `client_id`'s session ends (a clean start, its expiry, its
    /// connection without a kept session, or another node took it): its
    /// `subscriptions` release their filters' logs and the session is
    /// forgotten (statebroker patches 8, 9, 16, 26).
    fn end_session<S: AsRef<str>>(
        &mut self,
        client_id: &str,
        subscriptions: impl IntoIterator<Item = S>,
    ) {
        for filter in subscriptions {
            self.release_filter(filter.as_ref());
        }
        self.forget_session(client_id);
    }

    /// A subscription to `filter` ended (unsubscribed, or its session ended):
    /// when nothing else uses the filter, its log and the router's entries
    /// for it are freed (statebroker patch 8).
    fn release_filter(&mut self, filter: &str) {
        let bare = bare_filter(filter);
        let Some(users) = self.filter_users.get_mut(&bare) else {
            return;
        };
        *users -= 1;
        if *users > 0 {
            return;
        }
        self.filter_users.remove(&bare);
        if let Some(idx) = self.datalog.remove_filter(&bare) {
            self.notifications.retain(|(_, r)| r.filter_idx != idx);
            for (_, outgoing) in self.obufs.iter_mut() {
                outgoing.forget_filter(idx);
            }
        }
    }

    /// Makes `client_id` a member of the shared subscription `group`
    /// (`$share/g/filter`), created at `cursor` if it is the first.
    fn join_group(&mut self, group: &str, client_id: String, cursor: Offset) {
        self.shared_subscriptions
            .entry(group.to_owned())
            .or_insert_with(|| {
                self.groups.send_modify(|g| {
                    g.insert(group.to_owned());
                });
                SharedGroup::new(cursor, self.config.shared_subscriptions_strategy.clone())
            })
            .add_client(client_id);
    }

    /// `client_id` leaves the shared subscription `group`, which ends with
    /// its last member.
    fn leave_group(&mut self, group: &str, client_id: &str) {
        if let Some(shared) = self.shared_subscriptions.get_mut(group) {
            shared.remove_client(client_id);
            if shared.is_empty() {
                self.shared_subscriptions.remove(group);
                self.groups.send_modify(|g| {
                    g.remove(group);
                });
            }
        }
    }

    /// Removes connection `id`'s subscription to `filter`; whether it had
    /// one.
    fn unsubscribe(&mut self, id: ConnectionId, client_id: &str, filter: &str) -> bool {
        let Some(connection_ids) = self.subscription_map.get_mut(filter) else {
            return false;
        };
        if !connection_ids.remove(&id) {
            return false;
        }
        if connection_ids.is_empty() {
            self.subscription_map.remove(filter);
        }
        let meter = &mut self.ibufs.get_mut(id).unwrap().meter;
        meter.unregister_subscription(filter);
        let connection = self.connections.get_mut(id).unwrap();
        if !connection.subscriptions.remove(filter) {
            warn!("Unsubscribe failed as filter was not subscribed previously");
            return false;
        }
        if let Some(broker_aliases) = connection.broker_topic_aliases.as_mut() {
            broker_aliases.remove_alias(filter);
        }
        // remove the subscription id
        connection.subscription_ids.remove(filter);
        // Leaves this filter's group only, which ends with its last member
        // (statebroker patch 27: the client left every group it was in).
        self.leave_group(filter, client_id);
        self.scheduler.untrack(id, filter);
        let bare = bare_filter(filter);
        self.datalog.remove_waiters_for_id(id, &bare);
        self.notifications
            .retain(|(cid, r)| !(*cid == id && r.filter == *filter));
        self.subscriptions.unsubscribe(client_id, filter);
        self.release_filter(filter);
        true
    }

    /// Saves connection `id`'s session if it is persistent; returns what
    /// an acknowledgement of the change waits for (statebroker patch 16).
    fn save_session(&self, id: ConnectionId) -> Option<Receipt> {
        let journal = self.journal.as_ref()?;
        let connection = self.connections.get(id)?;
        if connection.session_expiry == 0 {
            return None;
        }
        let record = self.subscriptions.record(
            &connection.client_id,
            connection.session_expiry,
            connection.queue_full,
            None,
        );
        journal.session(&connection.client_id, Some(&record))
    }

    /// Saves what a restart must not lose of connection `id`'s publish: a
    /// retained message, and a copy for each kept session a QoS 1/2
    /// publish reaches. Returns the number the copy is kept under and what
    /// the acknowledgement waits for (statebroker patch 16).
    fn save_publish(
        &self,
        id: ConnectionId,
        publish: &Publish,
        properties: Option<&PublishProperties>,
    ) -> (Option<MessageId>, Option<Receipt>) {
        let Some(journal) = &self.journal else {
            return (None, None);
        };
        let Some(connection) = self.connections.get(id) else {
            return (None, None);
        };
        let Ok(topic) = std::str::from_utf8(&publish.topic) else {
            return (None, None);
        };
        let message = || Message {
            publish: publish.clone(),
            properties: properties.cloned(),
        };
        let mut receipt = None;
        if publish.retain {
            let kept = (!publish.payload.is_empty()).then(message);
            receipt = journal.retained(topic, kept.as_ref());
        }
        let mut queued = None;
        if publish.qos != QoS::AtMostOnce
            && self.subscriptions.any_kept()
            && journal.keeps_messages()
        {
            let clients = self
                .subscriptions
                .kept_recipients(&connection.client_id, topic);
            if !clients.is_empty() {
                let clients: Vec<&str> = clients.iter().map(|c| &**c).collect();
                if let Some((number, saved)) = journal.queued(&clients, &message()) {
                    queued = Some(number);
                    receipt = receipt.max(saved);
                }
            }
        }
        (queued, receipt)
    }

    /// A QoS 2 publish of `client_id`'s released with [`DISCARD`]: the
    /// journal forgets the copy it saved for the kept sessions the publish
    /// was for (statebroker patch 35).
    fn forget_discarded(&self, client_id: &str, publish: &Publish, queued: Option<MessageId>) {
        let Some(queued) = queued else {
            return;
        };
        let Ok(topic) = std::str::from_utf8(&publish.topic) else {
            return;
        };
        for client in self.subscriptions.kept_recipients(client_id, topic) {
            self.delivered(&client, Some(queued));
        }
    }

    /// `client_id` has message `queued` (acknowledged, or sent at QoS 0):
    /// the journal forgets its copy (statebroker patch 16).
    fn delivered(&self, client_id: &str, queued: Option<MessageId>) {
        if let (Some(journal), Some(message)) = (&self.journal, queued) {
            journal.delivered(client_id, message);
        }
    }

    /// `client_id`'s session ends: its subscriptions leave the index, and
    /// what the journal saved of it goes (statebroker patch 16).
    fn forget_session(&self, client_id: &str) {
        let kept = self.subscriptions.has_kept_session(client_id);
        self.subscriptions.end_session(client_id);
        if let (true, Some(journal)) = (kept, &self.journal) {
            journal.session(client_id, None);
        }
    }

    /// Gives back what the journal kept (statebroker patch 16): retained
    /// messages, and each persistent session as a kept session, with its
    /// subscriptions (their logs read from where they end now) and, read
    /// first, a private log of the messages it still waited for. Nothing is
    /// saved again.
    fn restore(&mut self, restore: Restore) {
        for message in restore.retained {
            if let Ok(topic) = std::str::from_utf8(&message.publish.topic) {
                let topic = topic.to_owned();
                self.datalog.insert_to_retained_publishes(
                    message.publish,
                    message.properties,
                    topic,
                );
            }
        }
        for session in restore.sessions {
            self.restore_session(session);
        }
    }

    /// Replaces `client_id`'s kept session with `session`, or discards it
    /// (statebroker patch 26). A session whose client is connected here is
    /// not replaced (`false`); discarded, it ends with its connection. A
    /// replacement that would be one kept session beyond
    /// `max_kept_sessions` is not made (`false`).
    fn replace_session(&mut self, client_id: &str, session: Option<RestoredSession>) -> bool {
        if let Some(&id) = self.connection_map.get(client_id) {
            if session.is_some() {
                return false;
            }
            if let Some(connection) = self.connections.get_mut(id) {
                connection.session_expiry = 0;
                connection.discarded = true;
            }
            return true;
        }
        let limit = self.config.max_kept_sessions;
        if session.is_some()
            && limit > 0
            && !self.subscriptions.has_kept_session(client_id)
            && self.subscriptions.kept_sessions() >= limit
        {
            return false;
        }
        let state = self
            .graveyard
            .retrieve(client_id)
            .and_then(|s| s.session_state);
        self.end_session(
            client_id,
            state.map(|s| s.subscriptions).unwrap_or_default(),
        );
        if let Some(session) = session {
            self.restore_session(session);
        }
        true
    }

    fn restore_session(&mut self, session: RestoredSession) {
        let client_id = session.client_id;
        let mut tracker = Tracker::new(client_id.clone());
        let mut subscriptions = HashSet::new();
        let mut subscription_ids = HashMap::new();
        let request = |filter: &str, filter_idx, cursor, options: &SubOptions, group| DataRequest {
            filter: filter.to_owned(),
            filter_idx,
            qos: options.qos,
            cursor,
            read_count: 0,
            max_count: 100,
            forward_retained: false,
            group,
            nolocal: options.no_local,
            preserve_retain: options.retain_as_published,
            retained: VecDeque::new(),
        };
        if !session.waiting.is_empty() {
            let name = format!("#restored/{client_id}");
            let messages = session
                .waiting
                .into_iter()
                .map(|(number, message)| PublishData {
                    publish: message.publish,
                    properties: message.properties,
                    timestamp: Instant::now(),
                    origin: None,
                    queued: Some(number),
                });
            let (filter_idx, cursor) = self.datalog.private_log(&name, messages);
            // Each message at its own QoS (the caller set it), RETAIN 0.
            let options = SubOptions {
                qos: 2,
                ..SubOptions::default()
            };
            tracker.register_data_request(request(&name, filter_idx, cursor, &options, None));
            *self.filter_users.entry(name.clone()).or_default() += 1;
            subscriptions.insert(name);
        }
        self.subscriptions.set_kept(&client_id, true);
        for (filter, options) in &session.filters {
            let (group, bare) = match extract_group(filter) {
                Some((_, bare)) => (Some(filter.clone()), bare),
                None => (None, filter.clone()),
            };
            let (filter_idx, cursor) = self.datalog.next_native_offset(&bare);
            tracker.register_data_request(request(filter, filter_idx, cursor, options, group));
            *self.filter_users.entry(bare).or_default() += 1;
            subscriptions.insert(filter.clone());
            if let Some(id) = options.id {
                subscription_ids.insert(filter.clone(), id);
            }
            self.subscriptions.subscribe(&client_id, filter, *options);
        }
        let expires_at = session.expires_in.map(|left| Instant::now() + left);
        self.sessions_may_refuse |= session.queue_full == Some(QueueFull::Refuse);
        self.graveyard.save_state(
            tracker,
            session.queue_full,
            subscriptions,
            subscription_ids,
            ConnectionEvents::default(),
            VecDeque::new(),
            Held::new(std::sync::Arc::clone(&self.held_qos2)),
            Default::default(),
            expires_at,
        );
    }

    /// When a connection is ready, it should sweep native data from 'datalog',
    /// send data and notifications to consumer.
    /// To activate a connection, first connection's tracker is fetched and
    /// all the requests are handled.
    fn consume(&mut self) -> Option<()> {
        let (id, mut requests) = self.scheduler.poll()?;

        let span = tracing::info_span!("[<] outgoing", connection_id = id);
        let _guard = span.enter();

        let outgoing = match self.obufs.get_mut(id) {
            Some(v) => v,
            None => {
                error!("Connection is already disconnected");
                return Some(());
            }
        };

        let ackslog = self.ackslog.get_mut(id).unwrap();
        let datalog = &mut self.datalog;
        let alertlog = &mut self.alertlog;

        trace!("Consuming requests");

        // We always try to ack when ever a connection is scheduled
        ack_device_data(ackslog, outgoing);

        let connection = &mut self.connections[id];

        // Keep track of temporarily skipped DataRequest
        // NOTE: VecDeque::new() doesn't allocate memory until elements are pushed
        let mut skipped_requests: VecDeque<DataRequest> = VecDeque::new();

        // A new connection's tracker is always initialized with acks request.
        // A subscribe will register data request.
        // So a new connection is always scheduled with at least one request
        for _ in 0..MAX_SCHEDULE_ITERATIONS {
            let mut request = match requests.pop_front() {
                // Handle next data or acks request
                Some(request) => request,
                // No requests in the queue. This implies that consumer data and
                // acks are completely caught up. Pending requests are registered
                // in waiters and awaiting new notifications (device or replica data)
                None => {
                    if skipped_requests.is_empty() {
                        // if no requests is in skip list, that means
                        // we have nothing left to process, i.e. we caughtup
                        self.scheduler.pause(id, PauseReason::Caughtup);
                        // Told once, after everything pushed so far
                        // (statebroker patch 48).
                        if std::mem::take(&mut connection.tell_caught_up) {
                            outgoing.push_notification(Notification::CaughtUp);
                            outgoing.handle.try_send(()).ok();
                        }
                    }
                    // add back the skipped requests!
                    self.scheduler.trackv(id, skipped_requests);
                    return Some(());
                }
            };

            let shared_group = request
                .group
                .as_ref()
                .and_then(|name| self.shared_subscriptions.get_mut(name));

            match forward_device_data(
                &mut request,
                datalog,
                outgoing,
                alertlog,
                connection,
                shared_group,
                self.journal.as_deref(),
            ) {
                ConsumeStatus::BufferFull => {
                    requests.push_back(request);
                    self.scheduler.pause(id, PauseReason::Busy);
                    break;
                }
                ConsumeStatus::InflightFull => {
                    requests.push_back(request);
                    self.scheduler.pause(id, PauseReason::InflightFull);
                    break;
                }
                ConsumeStatus::FilterCaughtup => {
                    let filter = &request.filter;
                    trace!(filter, "Filter caughtup {filter}, parking connection");

                    // When all the data in the log is caught up, current request is
                    // registered in waiters and not added back to the tracker. This
                    // ensures that tracker.next() stops when all the requests are done
                    datalog.park(id, request);
                }
                ConsumeStatus::PartialRead => {
                    requests.push_back(request);
                }
                ConsumeStatus::SkipRequest => {
                    skipped_requests.push_back(request);
                }
            }
        }

        // Add requests back to the tracker if there are any
        requests.extend(skipped_requests);
        self.scheduler.trackv(id, requests);
        Some(())
    }

    pub fn handle_last_will(
        &mut self,
        client_id: String,
        #[cfg(feature = "validate-tenant-prefix")] tenant_id: Option<String>,
    ) {
        #[cfg(feature = "validate-tenant-prefix")]
        let tenant_prefix = tenant_id.map(|id| format!("/tenants/{id}/"));

        let Some((will, will_props)) = self.last_wills.remove(&client_id) else {
            return;
        };

        let publish = Publish {
            dup: false,
            qos: will.qos,
            retain: will.retain,
            topic: will.topic,
            pkid: 0,
            payload: will.message,
        };

        let properties = will_props.map(PublishProperties::from);

        match append_will_message(
            publish,
            properties,
            &mut self.datalog,
            &mut self.notifications,
            #[cfg(feature = "validate-tenant-prefix")]
            tenant_prefix,
        ) {
            Ok(_offset) => {
                // Prepare all the consumers which are waiting for new data
                while let Some((id, request)) = self.notifications.pop_front() {
                    self.scheduler.track(id, request);
                    self.scheduler.reschedule(id, ScheduleReason::FreshData);
                }
            }
            Err(e) => {
                // Disconnect on bad publishes
                error!(
                    reason = ?e, "Failed to append to commitlog"
                );
                self.router_meters.failed_publishes += 1;
                // Removed disconnect = true from here because we disconnect anyways
            }
        };
    }

    fn send_meters(&mut self) {
        let mut meters = Vec::with_capacity(10);
        if let Some(router_meter) = self.router_meters.get() {
            meters.push(Meter::Router(self.id, router_meter));
        }
        for f in self.subscription_map.keys() {
            let filter = f.to_owned();
            if let Some(subscription_meter) = self.datalog.meter(f).and_then(|meter| meter.get()) {
                meters.push(Meter::Subscription(filter, subscription_meter));
            }
        }

        if !meters.is_empty() {
            for (meter_id, link) in self.meters.iter() {
                if let Err(e) = link.try_send(meters.clone()) {
                    error!(meter_id, "Failed to send meter. Error = {:?}", e);
                }
            }
        }
    }

    fn send_alerts(&mut self) {
        let alerts = self.alertlog.take();

        if !alerts.is_empty() {
            let alerts: Vec<Alert> = alerts.into();
            for (meter_id, link) in self.alerts.iter() {
                if let Err(e) = link.try_send(alerts.clone()) {
                    error!(meter_id, "Failed to send alert. Error = {:?}", e);
                }
            }
        }
    }
}

/// A User Property by which the front end releases a recorded QoS 2
/// publish without delivering it (its PUBREL carries it): a copy of a
/// message it knows was delivered already, such as a cluster node's QoS 2
/// publish sent again through another node (statebroker patch 35). Only
/// the front end sets it; it removes it from what clients send.
pub const DISCARD: &str = "statebroker:discard";

/// Whether a PUBREL's properties carry [`DISCARD`].
fn discards(properties: Option<&PubRelProperties>) -> bool {
    properties.is_some_and(|p| p.user_properties.iter().any(|(k, _)| k == DISCARD))
}

/// Why a client's publish is refused "quota exceeded".
enum Refused {
    /// It would push out of a filter's log what this kept session has not
    /// had (patch 23).
    KeptQueue(String),
    /// Keeping it retained would pass this bound (patch 46).
    Retained(&'static str),
    /// Holding it until its PUBREL would pass this bound (patch 47).
    Unreleased(&'static str),
}

fn append_to_commitlog(
    id: ConnectionId,
    mut publish: Publish,
    mut properties: Option<PublishProperties>,
    queued: Option<MessageId>,
    datalog: &mut DataLog,
    notifications: &mut VecDeque<(ConnectionId, DataRequest)>,
    connections: &mut Slab<Connection>,
) -> Result<Offset, RouterError> {
    let connection = connections.get_mut(id).unwrap();

    let topic_alias = properties.as_mut().and_then(|p| {
        // clear the received value as it is irrelevant while forwarding publishes
        p.topic_alias.take()
    });

    // [MQTT-3.3.4-6]: a Protocol Error (statebroker patch 42: it was
    // 0x81 and an ERROR event; a client's mistake is not the router's).
    // The broker's front end refuses such a PUBLISH before it gets here.
    if properties
        .as_ref()
        .is_some_and(|p| !p.subscription_identifiers.is_empty())
    {
        debug!(
            "A PUBLISH packet sent from a Client to a Server MUST NOT contain a Subscription Identifier"
        );
        return Err(RouterError::Disconnect(DisconnectReasonCode::ProtocolError));
    }

    if let Some(alias) = topic_alias {
        validate_and_set_topic_alias(&mut publish, connection, alias)?;
    };

    let topic = topic_text(&publish.topic)?;

    // Ensure that only clients associated with a tenant can publish to tenant's topic
    #[cfg(feature = "validate-tenant-prefix")]
    if let Some(tenant_prefix) = &connection.tenant_prefix {
        if !topic.starts_with(tenant_prefix) {
            return Err(RouterError::BadTenant(
                tenant_prefix.to_owned(),
                topic.to_owned(),
            ));
        }
    }

    // MQTT 5 3.3.1.3: a retained publish replaces the topic's retained
    // message, and with an empty payload removes it; a publish without
    // RETAIN leaves it alone, empty or not (statebroker patch 4).
    if publish.retain {
        if publish.payload.is_empty() {
            datalog.remove_from_retained_publishes(topic.to_owned());
        } else {
            datalog.insert_to_retained_publishes(
                publish.clone(),
                properties.clone(),
                topic.to_owned(),
            );
        }
    }

    // The log keeps the RETAIN flag: forwarding clears it unless the
    // subscription asked for Retain As Published (statebroker patch 2).
    let pkid = publish.pkid;

    let filter_idxs = datalog.matches(topic);

    // Create a dynamic filter if dynamic_filters are enabled for this connection
    let filter_idxs = match filter_idxs {
        Some(v) => v,
        None if connection.dynamic_filters => {
            let (idx, _cursor) = datalog.next_native_offset(topic);
            smallvec::smallvec![idx]
        }
        None => return Err(RouterError::NoMatchingFilters(topic.to_owned())),
    };

    let mut o = (0, 0);
    for filter_idx in filter_idxs {
        let publish_data = PublishData {
            publish: publish.clone(),
            properties: properties.clone(),
            timestamp: std::time::Instant::now(),
            origin: Some(connection.origin.clone()),
            queued,
        };
        let Some((offset, filter)) = datalog.append(filter_idx, publish_data, notifications) else {
            continue;
        };
        debug!(
            pkid,
            "Appended to commitlog: {}[{}, {})", filter, offset.0, offset.1,
        );

        o = offset;
    }

    // error!("{:15.15}[E] {:20} topic = {}", connections[id].client_id, "no-filter", topic);
    Ok(o)
}

/// statebroker patch 40: `topic` as text, as `std::str::from_utf8` reads
/// it (the same answer and the same error), through
/// [`crate::protocol::mqtt_str`]'s check of eight ASCII bytes at a time
/// first: every publish's topic is read so, and `from_utf8` took ~140
/// instructions for a 30-byte topic.
fn topic_text(topic: &[u8]) -> Result<&str, Utf8Error> {
    match crate::protocol::mqtt_str(topic) {
        Some(text) => Ok(text),
        // Not ASCII, or with U+0000: as upstream.
        None => std::str::from_utf8(topic),
    }
}

fn append_will_message(
    mut publish: Publish,
    properties: Option<PublishProperties>,
    datalog: &mut DataLog,
    notifications: &mut VecDeque<(ConnectionId, DataRequest)>,
    #[cfg(feature = "validate-tenant-prefix")] tenant_prefix: Option<String>,
) -> Result<Offset, RouterError> {
    // [MQTT-3.3.4-6]: a Protocol Error (statebroker patch 42: it was
    // 0x81 and an ERROR event; a client's mistake is not the router's).
    // The broker's front end refuses such a PUBLISH before it gets here.
    if properties
        .as_ref()
        .is_some_and(|p| !p.subscription_identifiers.is_empty())
    {
        debug!(
            "A PUBLISH packet sent from a Client to a Server MUST NOT contain a Subscription Identifier"
        );
        return Err(RouterError::Disconnect(DisconnectReasonCode::ProtocolError));
    }

    let topic = std::str::from_utf8(&publish.topic)?;

    // Ensure that only clients associated with a tenant can publish to tenant's topic
    #[cfg(feature = "validate-tenant-prefix")]
    if let Some(tenant_prefix) = tenant_prefix {
        if !topic.starts_with(&tenant_prefix) {
            return Err(RouterError::BadTenant(
                tenant_prefix.to_owned(),
                topic.to_owned(),
            ));
        }
    }

    // MQTT 5 3.3.1.3: a retained publish replaces the topic's retained
    // message, and with an empty payload removes it; a publish without
    // RETAIN leaves it alone, empty or not (statebroker patch 4).
    if publish.retain {
        if publish.payload.is_empty() {
            datalog.remove_from_retained_publishes(topic.to_owned());
        } else {
            datalog.insert_to_retained_publishes(
                publish.clone(),
                properties.clone(),
                topic.to_owned(),
            );
        }
    }

    // after recording retained message, we also send that message to existing subscribers
    // as normal publish message. Therefore we are setting retain to false
    publish.retain = false;
    let pkid = publish.pkid;

    let filter_idxs = datalog.matches(topic);

    let filter_idxs = match filter_idxs {
        Some(v) => v,
        None => return Err(RouterError::NoMatchingFilters(topic.to_owned())),
    };

    let mut o = (0, 0);
    for filter_idx in filter_idxs {
        let publish_data = (publish.clone(), properties.clone());
        let Some((offset, filter)) = datalog.append(filter_idx, publish_data.into(), notifications)
        else {
            continue;
        };
        debug!(
            pkid,
            "Appended to commitlog: {}[{}, {})", filter, offset.0, offset.1,
        );

        o = offset;
    }

    Ok(o)
}

fn validate_and_set_topic_alias(
    publish: &mut Publish,
    connection: &mut Connection,
    alias: u16,
) -> Result<(), RouterError> {
    if alias == 0 || alias > TOPIC_ALIAS_MAX {
        debug!("Alias must be greater than 0 and <={TOPIC_ALIAS_MAX}");
        return Err(RouterError::Disconnect(
            DisconnectReasonCode::TopicAliasInvalid,
        ));
    }

    if publish.topic.is_empty() {
        // if publish topic is empty, publisher must have set a valid alias
        let Some(alias_topic) = connection.topic_aliases.get(&alias) else {
            debug!("Empty topic name with invalid alias");
            return Err(RouterError::Disconnect(DisconnectReasonCode::ProtocolError));
        };
        // set the publish topic before further processing
        publish.topic = alias_topic.to_owned().into();
    } else {
        // if publish topic isn't empty, that means
        // publisher wants to establish new mapping for topic & alias
        let topic = std::str::from_utf8(&publish.topic)?;
        connection.topic_aliases.insert(alias, topic.to_owned());
        trace!("set alias {alias} for topic {topic}");
    };

    Ok(())
}

/// Sweep ackslog for all the pending acks.
/// We write everything to outgoing buf with out worrying about buffer size
/// because acks most certainly won't cause memory bloat
fn ack_device_data(ackslog: &mut AckLog, outgoing: &mut Outgoing) -> bool {
    let span = tracing::info_span!("outgoing_ack", client_id = outgoing.client_id);
    let _guard = span.enter();

    let acks = ackslog.readv();
    if acks.is_empty() {
        debug!("No acks pending");
        return false;
    }

    let mut count = 0;
    let mut buffer = outgoing.data_buffer.lock();

    // Unlike forwards, we are reading all the pending acks for a given connection.
    // At any given point of time, there can be a max of connection's buffer size
    for (ack, receipt) in acks.drain(..) {
        let pkid = packetid(&ack);
        trace!(pkid, "Ack added for pkid {}", pkid);
        let message = match receipt {
            Some(receipt) => Notification::DurableAck(receipt, ack),
            None => Notification::DeviceAck(ack),
        };
        buffer.push_back(message);
        count += 1;
    }

    debug!(acks_count = count, "Acks sent to device");
    outgoing.handle.try_send(()).ok();
    true
}

enum ConsumeStatus {
    /// Limit for publishes on outgoing channel reached
    BufferFull,
    /// Limit for inflight publishes on outgoing channel reached
    InflightFull,
    /// All publishes on topic forwarded
    FilterCaughtup,
    /// Some publishes on topic have been forwarded
    PartialRead,
    /// Use to indicate we want to skip the datareqest
    /// for shared subscriptions
    SkipRequest,
}

/// Sweep datalog from offset in DataRequest and updates DataRequest
/// for next sweep. Returns (busy, caughtup) status
/// Returned arguments:
/// 1. `busy`: whether the data request was completed or not.
/// 2. `done`: whether the connection was busy or not.
/// 3. `inflight_full`: whether the inflight requests were completely filled
fn forward_device_data(
    request: &mut DataRequest,
    datalog: &mut DataLog,
    outgoing: &mut Outgoing,
    alertlog: &mut AlertLog,
    connection: &mut Connection,
    shared_group: Option<&mut SharedGroup>,
    journal: Option<&dyn Journal>,
) -> ConsumeStatus {
    let span = tracing::info_span!("outgoing_publish", client_id = outgoing.client_id);
    let _guard = span.enter();

    if let Some(ref shared_group) = shared_group {
        // update the request cursor to use shared cursor
        request.cursor = shared_group.cursor;
    }

    trace!(
        "Reading from datalog: {}[{}, {}]",
        request.filter,
        request.cursor.0,
        request.cursor.1
    );

    let mut inflight_slots = if request.qos != 0 {
        // for qos 1 & 2
        let len = outgoing.free_slots();
        if len == 0 {
            trace!("Aborting read from datalog: inflight capacity reached");
            return ConsumeStatus::InflightFull;
        }

        len as u64
    } else {
        datalog.config.max_outgoing_packet_count
    };

    if shared_group
        .as_ref()
        .is_some_and(|g| g.strategy == Strategy::RoundRobin)
    {
        // only read one message in case of round robin
        // so that messages get equally distributed!
        inflight_slots = 1;
    }

    let mut publishes = Vec::new();

    // statebroker patch 3: every matching retained message is sent, queued
    // on the request and handed out as inflight room allows (the router
    // used to drop all but the first `inflight_slots` of them).
    if request.forward_retained {
        request.retained = datalog.read_retained_messages(&request.filter).into();
        // we only want to forward retained messages once
        request.forward_retained = false;
    }
    if !request.retained.is_empty() {
        let count = request.retained.len().min(inflight_slots as usize);
        publishes.extend(request.retained.drain(..count).map(|p| ((p, None), None)));
        inflight_slots -= count as u64;
    }

    // The log is read once the retained messages are out (and while there
    // is room): until then the cursor stays where it is.
    let (start, next, caughtup) = if request.retained.is_empty() && inflight_slots > 0 {
        let exclude_origin = request.nolocal.then_some(&*connection.origin);
        let (next, publishes_from_datalog) = match datalog.native_readv(
            request.filter_idx,
            request.cursor,
            inflight_slots,
            exclude_origin,
        ) {
            Ok(v) => v,
            Err(e) => {
                error!(error = ?e, "Failed to read from commitlog {}", e);
                return ConsumeStatus::FilterCaughtup;
            }
        };

        publishes.extend(
            publishes_from_datalog
                .into_iter()
                .map(|(p, offset)| (p, Some(offset))),
        );

        match next {
            Position::Next { start, end } => (start, end, false),
            Position::Done { start, end } => (start, end, true),
        }
    } else {
        (request.cursor, request.cursor, false)
    };

    if let Some(ref shared_group) = shared_group {
        let skip_current_client = Some(&outgoing.client_id) != shared_group.current_client();

        if skip_current_client {
            return if caughtup {
                ConsumeStatus::FilterCaughtup
            } else {
                ConsumeStatus::SkipRequest
            };
        }
    }

    if start != request.cursor {
        // The log pushed out what this subscriber had not read: counted,
        // and said at WARN at most every 10 s per connection (statebroker
        // patch 23; rumqttd wrote a WARN line per read, without the count).
        let lost = start.1.saturating_sub(request.cursor.1);
        datalog.counts.count_dropped(lost);
        if let Some((since, total)) = connection.dropped.lost(lost) {
            warn!(
                client_id = outgoing.client_id,
                filter = request.filter,
                dropped = since,
                dropped_in_all = total,
                "messages dropped before delivery: the filter's log pushed them out \
                 before this client read them (bounded by [router] max_segment_size \
                 x max_segment_count; [broker] queue_full = \"refuse\" refuses new \
                 publishes instead)"
            );
        }

        let alert = alert::cursorjump(&outgoing.client_id, &request.filter, 0);
        alertlog.log(alert);
    }

    trace!(
        "Read from commitlog, cursor = {}[{}, {}), read count = {}",
        request.filter,
        next.0,
        next.1,
        publishes.len()
    );

    let qos = request.qos;
    let preserve_retain = request.preserve_retain;
    let filter_idx = request.filter_idx;
    request.read_count += publishes.len();
    request.cursor = next;
    // println!("{:?} {:?} {}", start, next, request.read_count);

    // What another cluster node delivers to this group is passed over
    // (statebroker patch 28): the group's cursor moves on, and the turn
    // stays with this member.
    if let Some(group) = request.group.as_deref() {
        let read = publishes.len();
        publishes.retain(|(((_, properties), _), _)| !not_for(properties.as_ref(), group));
        if read > 0
            && publishes.is_empty()
            && let Some(share) = shared_group
        {
            share.cursor = request.cursor;
            return if caughtup {
                ConsumeStatus::FilterCaughtup
            } else {
                ConsumeStatus::PartialRead
            };
        }
    }

    if publishes.is_empty() {
        return ConsumeStatus::FilterCaughtup;
    }

    let broker_topic_aliases = &mut connection.broker_topic_aliases;
    let mut topic_alias = broker_topic_aliases
        .as_ref()
        .and_then(|aliases| aliases.get_alias(&request.filter));

    let topic_alias_already_exists = topic_alias.is_some();

    // if topic alias doesn't exists, try creating new one!
    if !topic_alias_already_exists {
        topic_alias = broker_topic_aliases
            .as_mut()
            .and_then(|broker_aliases| broker_aliases.set_new_alias(&request.filter))
    }

    let subscription_id = connection.subscription_ids.get(&request.filter);

    // Fill and notify device data
    let forwards =
        publishes
            .into_iter()
            .map(|(((mut publish, mut properties), queued), offset)| {
                // MQTT 5 3.8.4: delivered at the smaller of the publish's QoS and
                // the subscription's (statebroker patch 1).
                publish.qos = protocol::qos(qos.min(publish.qos as u8)).unwrap();
                // Retained messages sent for the subscription keep RETAIN (they
                // come without an offset); others keep it only with Retain As
                // Published (statebroker patch 2).
                if offset.is_some() && !preserve_retain {
                    publish.retain = false;
                }

                unmark(&mut properties);

                // if there is some topic alias to use, set it in publish properties
                if topic_alias.is_some() {
                    let mut props = properties.unwrap_or_default();
                    props.topic_alias = topic_alias;
                    properties = Some(props);
                }

                // We want to clear topic if we are using an existing alias
                if topic_alias_already_exists {
                    publish.topic.clear()
                }

                if let Some(&subscription_id) = subscription_id {
                    // create new props if not already exists
                    let mut props = properties.unwrap_or_default();
                    props.subscription_identifiers.push(subscription_id);
                    properties = Some(props);
                }

                Forward {
                    cursor: offset,
                    size: 0,
                    publish,
                    properties,
                    queued,
                }
            });

    let mut delivered = Vec::new();
    let (len, inflight) = outgoing.push_forwards(forwards, qos, filter_idx, &mut delivered);
    // Saved messages sent at QoS 0 are delivered as they go (statebroker
    // patch 16).
    if let Some(journal) = journal {
        for message in delivered {
            journal.delivered(&outgoing.client_id, message);
        }
    }

    debug!(
        inflight_count = inflight,
        forward_count = len,
        "Forwarding publishes, cursor = {}[{}, {}) forward count = {}",
        request.filter,
        request.cursor.0,
        request.cursor.1,
        len
    );

    if len >= MAX_CHANNEL_CAPACITY - 1 {
        debug!("Outgoing channel reached its capacity");
        outgoing.push_notification(Notification::Unschedule);
        outgoing.handle.try_send(()).ok();
        return ConsumeStatus::BufferFull;
    }

    outgoing.handle.try_send(()).ok();

    // update the state of shared subscription
    if let Some(share) = shared_group {
        share.update_next_client();
        // update the shared cursor
        share.cursor = request.cursor;
    }

    if caughtup {
        ConsumeStatus::FilterCaughtup
    } else {
        ConsumeStatus::PartialRead
    }
}

fn retrieve_shadow(datalog: &mut DataLog, outgoing: &mut Outgoing, shadow: ShadowRequest) {
    if let Some(reply) = datalog.shadow(&shadow.filter) {
        let publish = reply.0;
        let shadow_reply = router::ShadowReply {
            topic: publish.topic,
            payload: publish.payload,
        };

        // Fill notify shadow
        let message = Notification::Shadow(shadow_reply);
        let len = outgoing.push_notification(message);
        if len >= MAX_CHANNEL_CAPACITY - 1 {
            outgoing.push_notification(Notification::Unschedule);
        }
        outgoing.handle.try_send(()).ok();
    }
}

fn print_status(router: &mut Router, metrics: Print) {
    match metrics {
        Print::Config => {
            let config = router.config.clone();
            println!("{config:#?}");
        }
        Print::Router => {
            let metrics = router.router_meters.clone();
            println!("{metrics:#?}");
        }
        Print::Connection(id) => {
            let metrics = router.connection_map.get(&id).map(|v| {
                let c = router
                    .connections
                    .get(*v)
                    .map(|v| v.events.clone())
                    .unwrap();
                let t = router.scheduler.trackers.get(*v).cloned().unwrap();
                (c, t)
            });

            let metrics = match metrics {
                Some(v) => Some(v),
                None => router.graveyard.retrieve(&id).map(|v| {
                    (
                        v.metrics,
                        v.session_state
                            .map(|s| s.tracker)
                            .unwrap_or(Tracker::new(id)),
                    )
                }),
            };

            println!("{metrics:#?}");
        }
        Print::Subscriptions => {
            let metrics: HashMap<Filter, Vec<String>> = router
                .subscription_map
                .iter()
                .map(|(filter, connections)| {
                    let connections = connections
                        .iter()
                        .map(|id| router.obufs[*id].client_id.clone())
                        .collect();

                    (filter.to_owned(), connections)
                })
                .collect();

            println!("{metrics:#?}");
        }
        Print::Subscription(filter) => {
            let metrics = router.datalog.meter(&filter);
            println!("{metrics:#?}");
        }
        Print::Waiters(filter) => {
            if let Some(waiters) = router.datalog.waiters(&filter) {
                let v: Vec<(String, DataRequest)> = waiters
                    .waiters()
                    .iter()
                    .map(|(id, request)| (router.obufs[*id].client_id.clone(), request.clone()))
                    .collect();

                println!("{v:#?}");
            }
        }
        Print::ReadyQueue => {
            let metrics = router.scheduler.readyqueue.clone();
            println!("{metrics:#?}");
        }
    };
}

fn validate_subscription(
    connection: &mut Connection,
    filter: &protocol::Filter,
) -> Result<(), RouterError> {
    trace!(
        "validate subscription = {}, tenant = {:?}",
        filter.path,
        connection.tenant_prefix
    );
    // Ensure that only client devices of the tenant can
    #[cfg(feature = "validate-tenant-prefix")]
    if let Some(tenant_prefix) = &connection.tenant_prefix {
        if !filter.path.starts_with(tenant_prefix) {
            return Err(RouterError::InvalidFilterPrefix(filter.path.to_owned()));
        }
    }

    // `$SYS/...` is allowed: the broker publishes its statistics there
    // (statebroker patch 13); clients cannot publish to it.
    if filter.path.starts_with('$')
        && !filter.path.starts_with("$share")
        && !filter.path.starts_with("$SYS/")
    {
        return Err(RouterError::InvalidFilterPrefix(filter.path.to_owned()));
    }

    Ok(())
}

fn validate_clientid(client_id: &str) -> Result<(), RouterError> {
    trace!("Validating Client ID = {}", client_id,);
    // Ensure that only client devices of the tenant can
    if "+$#/".chars().any(|c| client_id.contains(c)) {
        return Err(RouterError::InvalidClientId(client_id.to_string()));
    }

    Ok(())
}

/// A filter without its `$share/group/` prefix: the filter whose log a
/// subscription reads (statebroker patch 8).
fn bare_filter(filter: &str) -> String {
    extract_group(filter).map_or_else(|| filter.to_owned(), |(_, f)| f)
}

fn extract_group(filter: &str) -> Option<(String, String)> {
    filter.strip_prefix("$share/").and_then(|s| {
        s.split_once('/')
            .map(|(group, path)| (group.to_string(), path.to_string()))
    })
}
// #[cfg(test)]
// #[allow(non_snake_case)]
// mod test {
//     use std::{
//         thread,
//         time::{Duration, Instant},
//     };

//     use bytes::BytesMut;

//     use super::*;
//     use crate::{
//         link::local::*,
//         protocol::v4::{self, subscribe::SubscribeFilter, QoS},
//         router::ConnectionMeter,
//     };

//     /// Create a router and n connections
//     fn new_router(count: usize, clean: bool) -> (Router, VecDeque<(LinkTx, LinkRx)>) {
//         let config = RouterConfig {
//             instant_ack: true,
//             max_segment_size: 1024 * 10, // 10 KB
//             max_mem_segments: 10,
//             max_disk_segments: 0,
//             max_read_len: 128,
//             log_dir: None,
//             max_connections: 128,
//             dynamic_log: false,
//         };

//         let mut router = Router::new(0, config);
//         let link = router.link();
//         let handle = thread::spawn(move || {
//             (0..count)
//                 .map(|i| Link::new(&format!("link-{}", i), link.clone(), clean))
//                 .collect::<VecDeque<Result<_, _>>>()
//         });

//         router.run_exact(count).unwrap();
//         let links = handle
//             .join()
//             .unwrap()
//             .into_iter()
//             .map(|x| x.unwrap())
//             .collect();
//         (router, links)
//     }

//     fn reconnect(router: &mut Router, link_id: usize, clean: bool) -> (LinkTx, LinkRx) {
//         let link = router.link();
//         let handle =
//             thread::spawn(move || Link::new(&format!("link-{}", link_id), link, clean).unwrap());
//         router.run(1).unwrap();
//         handle.join().unwrap()
//     }

//     #[test]
//     fn test_graveyard_retreive_metrics_always() {
//         let (mut router, mut links) = new_router(1, false);
//         let (tx, _) = links.pop_front().unwrap();
//         let id = tx.connection_id;
//         let conn = router.connections.get_mut(id).unwrap();
//         conn.meter = ConnectionMeter {
//             publish_size: 1000,
//             publish_count: 1000,
//             subscriptions: HashSet::new(),
//             events: conn.meter.events.clone(),
//         };
//         conn.meter.push_event("graveyard-testing".to_string());
//         router.handle_disconnection(id);

//         let (tx, _) = reconnect(&mut router, 0, false);
//         let id = tx.connection_id;
//         let conn = router.connections.get_mut(id).unwrap();
//         assert_eq!(conn.meter.publish_size, 1000);
//         assert_eq!(conn.meter.publish_count, 1000);
//         assert_eq!(conn.meter.events.len(), 4);

//         let (mut router, mut links) = new_router(1, true);
//         let (tx, _) = links.pop_front().unwrap();
//         let id = tx.connection_id;
//         let conn = router.connections.get_mut(id).unwrap();
//         conn.meter = ConnectionMeter {
//             publish_size: 1000,
//             publish_count: 1000,
//             subscriptions: HashSet::new(),
//             events: conn.meter.events.clone(),
//         };
//         conn.meter.push_event("graveyard-testing".to_string());
//         router.handle_disconnection(id);

//         let (tx, _) = reconnect(&mut router, 0, true);
//         let id = tx.connection_id;
//         let conn = router.connections.get_mut(id).unwrap();
//         assert_eq!(conn.meter.publish_size, 1000);
//         assert_eq!(conn.meter.publish_count, 1000);
//         assert_eq!(conn.meter.events.len(), 4);
//     }

//     #[test]
//     #[should_panic]
//     fn test_blocking_too_many_connections() {
//         new_router(512, true);
//     }

//     #[test]
//     fn test_not_clean_sessions() {
//         // called once per data push (subscribe to 2 topics in our case)
//         // called once per each sub topic
//         // if prepare_data_request called, then Tracker::register_data_request is also called so
//         // no need to check separately for that

//         let (mut router, mut links) = new_router(2, false);
//         let (tx1, mut rx1) = links.pop_front().unwrap();
//         let id1 = tx1.connection_id;
//         let (tx2, mut rx2) = links.pop_front().unwrap();
//         let id2 = tx2.connection_id;

//         // manually subscribing to avoid calling Router::run(), so that we can see and test changes
//         // in Router::readyqueue.
//         let mut buf = BytesMut::new();
//         v4::subscribe::write(
//             vec![
//                 SubscribeFilter::new("hello/1/world".to_string(), QoS::AtMostOnce),
//                 SubscribeFilter::new("hello/2/world".to_string(), QoS::AtMostOnce),
//             ],
//             0,
//             &mut buf,
//         )
//         .unwrap();
//         let buf = buf.freeze();
//         {
//             let incoming = router.ibufs.get_mut(id1).unwrap();
//             let mut recv_buf = incoming.buffer.lock();
//             recv_buf.push_back(buf.clone());
//             assert_eq!(router.subscription_map.len(), 0);
//         }
//         {
//             let incoming = router.ibufs.get_mut(id2).unwrap();
//             let mut recv_buf = incoming.buffer.lock();
//             recv_buf.push_back(buf.clone());
//             assert_eq!(router.subscription_map.len(), 0);
//         }

//         router.handle_device_payload(id1);
//         assert_eq!(router.subscription_map.len(), 2);
//         assert_eq!(router.readyqueue.len(), 1);
//         router.consume(id1);
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             1
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             1
//         );

//         router.handle_device_payload(id2);
//         assert_eq!(router.subscription_map.len(), 2);
//         assert_eq!(router.readyqueue.len(), 2);
//         router.consume(id2);
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );

//         assert!(matches!(rx1.recv().unwrap(), Some(Notification::DeviceAck(_))));
//         assert!(matches!(rx2.recv().unwrap(), Some(Notification::DeviceAck(_))));

//         router.handle_disconnection(id1);
//         router.handle_disconnection(id2);
//         router.run(1).unwrap();

//         let (_, _) = reconnect(&mut router, 0, false);
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             1
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             1
//         );

//         let (_, _) = reconnect(&mut router, 1, false);
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//     }

//     #[test]
//     fn test_publish_appended_to_commitlog() {
//         let (mut router, mut links) = new_router(2, true);
//         let (mut sub_tx, _) = links.pop_front().unwrap();
//         let (mut pub_tx, _) = links.pop_front().unwrap();

//         sub_tx.subscribe("hello/1/world").unwrap();
//         router.run(1).unwrap();

//         // Each LinkTx::publish creates a single new event
//         for _ in 0..10 {
//             pub_tx.publish("hello/1/world", b"hello".to_vec()).unwrap();
//         }
//         router.run(1).unwrap();
//         assert_eq!(router.datalog.next_native_offset("hello/1/world").1, (0, 10));
//     }

//     #[test]
//     fn test_adding_caughtups_to_waiters() {
//         // number of times forward_device_data hit
//         //     = router.run times * topics * subscribers per topic
//         //     = 2 * 2 * 2 = 8
//         //
//         // we also call consume 2 times per subsriber, and one time it will call
//         // forward_device_data again, but no data will actually be forwarded.
//         // as 256 publishes at once, and router's config only reads 128 at a time, data needs to be
//         // read from same log twice, and thus half of the times the data reading is not done

//         let (mut router, mut links) = new_router(4, true);
//         let (mut sub1_tx, _) = links.pop_front().unwrap();
//         let (mut pub1_tx, _) = links.pop_front().unwrap();
//         let (mut sub2_tx, _) = links.pop_front().unwrap();
//         let (mut pub2_tx, _) = links.pop_front().unwrap();
//         sub1_tx.subscribe("hello/1/world").unwrap();
//         sub1_tx.subscribe("hello/2/world").unwrap();
//         sub2_tx.subscribe("hello/1/world").unwrap();
//         sub2_tx.subscribe("hello/2/world").unwrap();
//         router.run(1).unwrap();

//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );

//         for _ in 0..256 {
//             pub1_tx.publish("hello/1/world", b"hello".to_vec()).unwrap();
//             pub2_tx.publish("hello/2/world", b"hello".to_vec()).unwrap();
//         }
//         router.run(1).unwrap();

//         let tracker = router.trackers.get(sub1_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 2);
//         let tracker = router.trackers.get(sub2_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 2);

//         router.run(1).unwrap();

//         let tracker = router.trackers.get(sub1_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 2);
//         let tracker = router.trackers.get(sub2_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 2);

//         router.consume(sub1_tx.connection_id);
//         router.consume(sub2_tx.connection_id);

//         let tracker = router.trackers.get(sub1_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 1);
//         let tracker = router.trackers.get(sub2_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 1);

//         router.consume(sub1_tx.connection_id);
//         router.consume(sub2_tx.connection_id);

//         let tracker = router.trackers.get(sub1_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 0);
//         let tracker = router.trackers.get(sub2_tx.connection_id).unwrap();
//         assert_eq!(tracker.get_data_requests().len(), 0);

//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/1/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//         assert_eq!(
//             router
//                 .datalog
//                 .waiters(&"hello/2/world".to_string())
//                 .unwrap()
//                 .waiters()
//                 .len(),
//             2
//         );
//     }

//     #[test]
//     fn test_disconnect_invalid_sub() {
//         let (mut router, mut links) = new_router(3, true);

//         let (mut tx, mut rx) = links.pop_front().unwrap();
//         tx.subscribe("$hello/world").unwrap();
//         router.run(1).unwrap();
//         assert!(matches!(rx.recv(), Err(LinkError::Recv(flume::RecvError::Disconnected))));

//         let (mut tx, mut rx) = links.pop_front().unwrap();
//         tx.subscribe("test/hello").unwrap();
//         router.run(1).unwrap();
//         assert!(matches!(rx.recv(), Err(LinkError::Recv(flume::RecvError::Disconnected))));
//     }

//     #[test]
//     fn test_disconnect_invalid_pub() {
//         let (mut router, mut links) = new_router(1, true);
//         let (mut tx, mut rx) = links.pop_front().unwrap();
//         tx.publish("invalid/topic", b"hello".to_vec()).unwrap();
//         router.run(1).unwrap();
//         assert!(matches!(rx.recv(), Err(LinkError::Recv(flume::RecvError::Disconnected))));
//     }

//     #[test]
//     fn test_pingreq() {
//         let (mut router, mut links) = new_router(1, true);
//         let (mut tx, mut rx) = links.pop_front().unwrap();
//         let mut buf = BytesMut::new();
//         mqttbytes::v4::PingReq.write(&mut buf).unwrap();
//         let buf = buf.freeze();
//         for _ in 0..10 {
//             tx.push(buf.clone()).unwrap();
//         }
//         router.run(1).unwrap();
//         for _ in 0..10 {
//             let ret = rx.recv().unwrap().unwrap();
//             assert!(matches!(ret, Notification::DeviceAck(Ack::PingResp)));
//         }
//     }

//     #[test]
//     fn test_disconnect() {
//         let (mut router, mut links) = new_router(1, true);
//         let (mut tx, mut rx) = links.pop_front().unwrap();
//         let mut buf = BytesMut::new();
//         mqttbytes::v4::Disconnect.write(&mut buf).unwrap();
//         let buf = buf.freeze();
//         tx.push(buf).unwrap();
//         router.run(1).unwrap();
//         assert!(matches!(rx.recv(), Err(LinkError::Recv(flume::RecvError::Disconnected))));
//     }

//     #[test]
//     fn test_connection_in_qos1() {
//         // connection as in crate::connection::Connection struct should get filled for all unacked,
//         // and refuse to add more packets than unacked.

//         let config = RouterConfig {
//             instant_ack: true,
//             max_segment_size: 1024 * 10, // 10 KB
//             max_mem_segments: 10,
//             max_disk_segments: 0,
//             max_read_len: 256,
//             log_dir: None,
//             max_connections: 128,
//             dynamic_log: false,
//         };

//         let mut router = Router::new(0, config);
//         let link = router.link();
//         let handle = thread::spawn(move || {
//             (0..2)
//                 .map(|i| Link::new(&format!("link-{}", i), link.clone(), true))
//                 .collect::<VecDeque<Result<_, _>>>()
//         });

//         router.run(2).unwrap();
//         let mut links: VecDeque<(LinkTx, LinkRx)> = handle
//             .join()
//             .unwrap()
//             .into_iter()
//             .map(|x| x.unwrap())
//             .collect();

//         let (mut sub_tx, _sub_rx) = links.pop_front().unwrap();
//         let (mut pub_tx, _) = links.pop_front().unwrap();

//         let mut buf = BytesMut::new();
//         mqttbytes::v4::Subscribe::new("hello/1/world", mqttbytes::QoS::AtLeastOnce)
//             .write(&mut buf)
//             .unwrap();
//         let buf = buf.freeze();
//         sub_tx.push(buf).unwrap();
//         router.run(1).unwrap();

//         for _ in 0..202 {
//             pub_tx.publish("hello/1/world", b"hello".to_vec()).unwrap();
//         }
//         router.run(1).unwrap();

//         let id = sub_tx.connection_id;
//         let tracker = router.trackers.get(id).unwrap();
//         assert_eq!(tracker.get_data_requests().front().unwrap().cursor, (0, 200));
//     }

//     #[test]
//     #[ignore]
//     fn test_resend_in_qos1() {
//         unimplemented!("we don't resend QoS1 packets yet")
//     }

//     #[test]
//     fn test_wildcard_subs() {
//         let (mut router, mut links) = new_router(3, true);

//         let (mut sub1_tx, mut sub1_rx) = links.pop_front().unwrap();
//         sub1_tx.subscribe("#").unwrap();

//         let (mut sub2_tx, mut sub2_rx) = links.pop_front().unwrap();
//         sub2_tx.subscribe("hello/+/world").unwrap();

//         let (mut pub_tx, mut _pub_rx) = links.pop_front().unwrap();
//         for _ in 0..10 {
//             for i in 0..10 {
//                 pub_tx
//                     .publish(format!("hello/{}/world", i), b"hello".to_vec())
//                     .unwrap();
//             }
//         }

//         for _ in 0..10 {
//             pub_tx.publish("hello/world", b"hello".to_vec()).unwrap();
//         }

//         router.run(1).unwrap();

//         let mut count = 0;
//         while let Ok(Some(notification)) =
//             sub1_rx.recv_deadline(Instant::now() + Duration::from_millis(1))
//         {
//             match notification {
//                 Notification::Forward { .. } => count += 1,
//                 _ => {}
//             }
//         }
//         assert_eq!(count, 110);

//         count = 0;
//         while let Ok(Some(notification)) =
//             sub2_rx.recv_deadline(Instant::now() + Duration::from_millis(1))
//         {
//             match notification {
//                 Notification::Forward { .. } => count += 1,
//                 _ => {}
//             }
//         }
//         assert_eq!(count, 100);
//     }
// }

// // #[cfg(test)]
// // mod test {
// //     use crate::connection::Connection;
// //     use crate::link::local::{Link, LinkRx, LinkTx};
// //     use crate::tracker::Tracker;
// //     use crate::{ConnectionId, Notification, Router, RouterConfig};
// //     use bytes::BytesMut;
// //     use flume::Receiver;
// //     use mqttbytes::v4::{Publish, Subscribe};
// //     use mqttbytes::QoS;
// //     use std::collections::VecDeque;
// //     use std::sync::atomic::AtomicBool;
// //     use std::sync::Arc;
// //     use std::thread;

// //     /// Create a router and n connections
// //     fn router(count: usize) -> (Router, VecDeque<(LinkTx, LinkRx)>) {
// //         let config = RouterConfig {
// //             data_filter: "hello/world".to_owned(),
// //             wildcard_filters: vec![],
// //             instant_ack: true,
// //             max_segment_size: 10 * 1024,
// //             max_segment_count: 10 * 1024,
// //             max_connections: 10,
// //         };

// //         let mut router = Router::new(0, config);
// //         let link = router.link();
// //         let handle = thread::spawn(move || {
// //             (0..count)
// //                 .map(|i| Link::new(&format!("link-{}", i), link.clone()).unwrap())
// //                 .collect()
// //         });

// //         router.run(count).unwrap();
// //         let links = handle.join().unwrap();
// //         (router, links)
// //     }

// //     /// Creates a connection
// //     fn connection(client_id: &str, clean: bool) -> (Connection, Receiver<Notification>) {
// //         let (tx, rx) = flume::bounded(10);
// //         let connection = Connection::new(client_id, clean, tx, Arc::new(AtomicBool::new(false)));
// //         (connection, rx)
// //     }

// //     /// Raw publish message
// //     fn publish(topic: &str) -> BytesMut {
// //         let mut publish = Publish::new(topic, QoS::AtLeastOnce, vec![1, 2, 3]);
// //         publish.pkid = 1;

// //         let mut o = BytesMut::new();
// //         publish.write(&mut o).unwrap();
// //         o
// //     }

// //     /// Raw publish message
// //     fn subscribe(topic: &str) -> BytesMut {
// //         let mut subscribe = Subscribe::new(topic, QoS::AtLeastOnce);
// //         subscribe.pkid = 1;

// //         let mut o = BytesMut::new();
// //         subscribe.write(&mut o).unwrap();
// //         o
// //     }

// //     /// When there is new data on a subscription's commitlog, it's
// //     /// consumer should start triggering data requests to pull data
// //     /// from commitlog
// //     #[test]
// //     fn new_connection_data_triggers_acks_of_self_and_data_of_consumer() {
// //         let (mut router, mut links) = router(2);
// //         let (mut l1tx, _l1rx) = links.pop_front().unwrap();
// //         let (mut l2tx, l2rx) = links.pop_front().unwrap();

// //         l2tx.subscribe("hello/world").unwrap();
// //         l1tx.publish("hello/world", vec![1, 2, 3]).unwrap();
// //         let _ = router.run(1);

// //         // Suback
// //         match l2rx.recv().unwrap() {
// //             Notification::DeviceAcks(_) => {}
// //             v => panic!("{:?}", v),
// //         }

// //         // Consumer data
// //         match l2rx.recv().unwrap() {
// //             Notification::DeviceData { cursor, .. } => assert_eq!(cursor, (0, 1)),
// //             v => panic!("{:?}", v),
// //         }

// //         // No acks for qos0 publish
// //     }

// //     #[test]
// //     fn half_open_connections_are_handled_correctly() {
// //         let config = RouterConfig {
// //             data_filter: "hello/world".to_owned(),
// //             wildcard_filters: vec![],
// //             instant_ack: true,
// //             max_segment_size: 10 * 1024,
// //             max_segment_count: 10 * 1024,
// //             max_connections: 10,
// //         };

// //         let mut router = Router::new(0, config);
// //         let (c, rx) = connection("test", true);
// //         router.handle_new_connection(c);

// //         let id = *router.connection_map.get("test").unwrap();
// //         router.handle_device_payload(id, subscribe("hello/data"));
// //         router.handle_device_payload(id, publish("hello/data"));

// //         let trackers = router.trackers.get(id).unwrap();
// //         assert!(trackers.get_data_requests().len() > 0);
// //         dbg!(trackers);

// //         // A new connection with same client id
// //         let (c, rx) = connection("test", true);
// //         router.handle_new_connection(c);

// //         let id = *router.connection_map.get("test").unwrap();
// //         let trackers = router.trackers.get(id).unwrap();
// //         dbg!(trackers);
// //     }
// // }

/// Now, in milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs `f` on a thread named `name`; `stopped` is set to `true` when the
/// thread ends, by returning or by a panic (statebroker patch 44).
pub(crate) fn spawn_watched(
    name: String,
    stopped: tokio::sync::watch::Sender<bool>,
    f: impl FnOnce() + Send + 'static,
) {
    /// Sets `stopped` when dropped: at the thread's end, unwinding too.
    struct Stopped(tokio::sync::watch::Sender<bool>);
    impl Drop for Stopped {
        fn drop(&mut self) {
            self.0.send_replace(true);
        }
    }
    thread::Builder::new()
        .name(name)
        .spawn(move || {
            let _stopped = Stopped(stopped);
            f();
        })
        .unwrap();
}

#[cfg(test)]
mod topic_text_tests {
    use super::topic_text;

    /// statebroker patch 40: the fast path answers as `from_utf8` does,
    /// for ASCII, other UTF-8, U+0000 and bytes that are not UTF-8.
    #[test]
    fn topic_text_reads_as_from_utf8() {
        let cases: [&[u8]; 7] = [
            b"",
            b"a/b/c",
            b"sensors/0123456789abcdef/temperature",
            "k\u{00e9}ys/\u{2603}".as_bytes(),
            b"with\0nul/inside",
            b"\xff\xfe",
            b"ascii then \xc3",
        ];
        for topic in cases {
            assert_eq!(
                topic_text(topic).map_err(|e| e.valid_up_to()),
                std::str::from_utf8(topic).map_err(|e| e.valid_up_to()),
                "{topic:?}"
            );
        }
    }
}
