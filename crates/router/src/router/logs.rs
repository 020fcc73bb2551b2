use super::Ack;
use slab::Slab;
use tracing::{info, trace};

use crate::protocol::{
    has_wildcards, matches, ConnAck, ConnAckProperties, PingResp, PubAck, PubComp, PubCompReason,
    PubRec, PubRel, Publish, PublishProperties, SubAck, UnsubAck,
};
use crate::router::{DataRequest, FilterIdx, SubscriptionMeter, Waiters};
use crate::{ConnectionId, Filter, MessageId, Offset, Receipt, RouterConfig, Topic};

use crate::segments::{CommitLog, Position};
use crate::Storage;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

type PubWithProp = (Publish, Option<PublishProperties>);

/// A message read from a log: the publish, and the number the journal
/// keeps it under, if it does (statebroker patch 16).
pub type ReadMessage = (PubWithProp, Option<MessageId>);

/// Topics whose matching filters are cached at most (statebroker patch 8).
const MAX_CACHED_TOPICS: usize = 100_000;

/// The message logs the router holds (one per filter in use, plus the
/// private logs of restored sessions) and the bytes of topic and payload
/// in them, kept up to date by the router thread for readers on other
/// threads (statebroker patch 20).
#[derive(Debug, Default)]
pub struct LogCounts {
    logs: std::sync::atomic::AtomicUsize,
    bytes: std::sync::atomic::AtomicU64,
    /// Statebroker patch 23: entries pushed out of a log before a
    /// subscriber read them, counted as it reads on past them.
    dropped: std::sync::atomic::AtomicU64,
    /// Statebroker patch 23: publishes refused (`QueueFull::Refuse`).
    refused: std::sync::atomic::AtomicU64,
}

impl LogCounts {
    /// Logs held now.
    pub fn logs(&self) -> usize {
        self.logs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes held in them now ([`Storage::size`] of each entry: topic,
    /// payload and 4).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Messages pushed out of a filter's log before a subscriber read
    /// them, each counted once per subscriber it never reached, when that
    /// subscriber reads on past them (statebroker patch 23). Entries that
    /// subscriber would have skipped anyway (its own with No Local,
    /// expired ones) count too.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Publishes refused because they would have pushed out of a log a
    /// message a kept session has not had yet ([`crate::QueueFull::Refuse`],
    /// statebroker patch 23).
    pub fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn count_dropped(&self, n: u64) {
        self.dropped
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn count_refused(&self) {
        self.refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub struct PublishData {
    pub publish: Publish,
    pub properties: Option<PublishProperties>,
    pub timestamp: Instant,
    /// Client id of the publisher, for No Local (statebroker patch 2).
    pub origin: Option<std::sync::Arc<str>>,
    /// The number the journal keeps it under for persistent sessions
    /// (statebroker patch 16).
    pub queued: Option<MessageId>,
}

impl From<PubWithProp> for PublishData {
    fn from((publish, properties): PubWithProp) -> Self {
        PublishData {
            publish,
            properties,
            timestamp: Instant::now(),
            origin: None,
            queued: None,
        }
    }
}

// TODO: remove this from here
impl Storage for PublishData {
    // TODO: calculate size of publish properties as well!
    fn size(&self) -> usize {
        let publish = &self.publish;
        4 + publish.topic.len() + publish.payload.len()
    }
}

/// Stores 'device' data and 'actions' data in native commitlog
/// organized by subscription filter. Device data is replicated
/// while actions data is not
pub struct DataLog {
    pub config: RouterConfig,
    /// Native commitlog data organized by subscription. Contains
    /// device data and actions data logs.
    ///
    /// Device data is replicated while actions data is not.
    /// Also has waiters used to wake connections/replicator tracker
    /// which are caught up with all the data on 'Filter' and waiting
    /// for new data
    pub native: Slab<Data<PublishData>>,
    /// Map of subscription filter name to filter index
    filter_indexes: HashMap<Filter, FilterIdx>,
    /// Those of `filter_indexes` with wildcards: a topic is matched against
    /// these, and looked up among the others (statebroker patch 24).
    wild_indexes: HashMap<Filter, FilterIdx>,
    retained_publishes: HashMap<Topic, PublishData>,
    /// How many retained messages are held, for readers on other threads
    /// (statebroker patch 14).
    pub retained_count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Topic and payload bytes of the retained messages (statebroker patch
    /// 46).
    retained_bytes: usize,
    /// List of filters associated with a topic (foldhash, randomly seeded
    /// per process, as hashbrown's default: statebroker patch 39)
    publish_filters: hashbrown::HashMap<Topic, Vec<FilterIdx>>,
    /// Logs that no topic matches, by name: the messages a restored session
    /// still waited for (statebroker patch 16).
    private_logs: HashMap<Filter, FilterIdx>,
    /// Bytes held in all the logs (statebroker patch 20).
    held: u64,
    /// The number of logs and `held`, for readers on other threads.
    pub counts: std::sync::Arc<LogCounts>,
}

/// The logs a publish goes to: most publishes match a few.
pub type Matched = smallvec::SmallVec<[FilterIdx; 4]>;

impl DataLog {
    pub fn new(config: RouterConfig) -> io::Result<DataLog> {
        let mut native = Slab::new();
        let mut filter_indexes = HashMap::new();
        let mut wild_indexes = HashMap::new();
        let retained_publishes = HashMap::new();
        let publish_filters = hashbrown::HashMap::new();

        if let Some(warmup_filters) = config.initialized_filters.clone() {
            for filter in warmup_filters {
                let data = Data::new(&filter, &config);

                // Add commitlog to datalog and add datalog index to filter to
                // datalog index map
                let idx = native.insert(data);
                if has_wildcards(&filter) {
                    wild_indexes.insert(filter.clone(), idx);
                }
                filter_indexes.insert(filter, idx);
            }
        }

        let datalog = DataLog {
            config,
            native,
            publish_filters,
            filter_indexes,
            wild_indexes,
            retained_publishes,
            retained_count: Default::default(),
            retained_bytes: 0,
            private_logs: HashMap::new(),
            held: 0,
            counts: Default::default(),
        };
        datalog.count_logs();
        Ok(datalog)
    }

    /// Publishes the number of logs and their bytes (statebroker patch 20).
    fn count_logs(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counts.logs.store(self.native.len(), Relaxed);
        self.counts.bytes.store(self.held, Relaxed);
    }

    /// Appends `item` to the log at `filter_idx`, waking its waiters into
    /// `notifications`; `None` if there is no such log.
    pub fn append(
        &mut self,
        filter_idx: FilterIdx,
        item: PublishData,
        notifications: &mut VecDeque<(ConnectionId, DataRequest)>,
    ) -> Option<(Offset, &Filter)> {
        let data = self.native.get_mut(filter_idx)?;
        let before = data.log.size();
        let (offset, _) = data.append(item, notifications);
        self.held = self.held - before + data.log.size();
        self.count_logs();
        let data = self.native.get(filter_idx)?;
        Some((offset, &data.filter))
    }

    /// What appending an entry of `size` bytes to the log at `filter_idx`
    /// would push out: the absolute offset of the oldest entry kept after
    /// it, if older ones would go, and the log's filter (statebroker
    /// patch 23).
    pub fn evicts_below(&self, filter_idx: FilterIdx, size: usize) -> Option<(u64, &Filter)> {
        let data = self.native.get(filter_idx)?;
        let below = data.log.evicts_below(size as u64)?;
        Some((below, &data.filter))
    }

    pub fn meter(&mut self, filter: &str) -> Option<&mut SubscriptionMeter> {
        let data = self.native.get_mut(*self.filter_indexes.get(filter)?)?;
        Some(&mut data.meter)
    }

    pub fn waiters(&self, filter: &Filter) -> Option<&Waiters<DataRequest>> {
        self.native
            .get(*self.filter_indexes.get(filter)?)
            .map(|data| &data.waiters)
    }

    pub fn remove_waiters_for_id(
        &mut self,
        id: ConnectionId,
        filter: &Filter,
    ) -> Option<DataRequest> {
        let data = self.native.get_mut(self.index_of(filter)?).unwrap();
        let waiters = data.waiters.get_mut();

        waiters
            .iter()
            .position(|&(conn_id, _)| conn_id == id)
            .and_then(|index| {
                waiters
                    .swap_remove_back(index)
                    .map(|(_, data_req)| data_req)
            })
    }

    /// The logs a publish on `topic` goes to: a copy of the cache's list,
    /// not a borrow, since the caller appends to those logs while it
    /// walks it (statebroker patch 39: a copy without an allocation).
    pub fn matches(&mut self, topic: &str) -> Option<Matched> {
        match &self.publish_filters.get(topic) {
            Some(v) => Some(Matched::from_slice(v)),
            None => {
                // A filter without wildcards matches the very same topic
                // only: one look-up, and the wildcard filters matched one by
                // one. Every filter was matched: with 200,000 kept sessions
                // each on its own `devices/<id>/cmd`, a publish on a topic
                // not yet cached took 0.9 s (statebroker patch 24).
                let exact = self
                    .filter_indexes
                    .get(topic)
                    .filter(|_| !has_wildcards(topic))
                    .copied();
                let v: Vec<usize> = exact
                    .into_iter()
                    .chain(
                        self.wild_indexes
                            .iter()
                            .filter(|(filter, _)| matches(topic, filter))
                            .map(|(_, filter_idx)| *filter_idx),
                    )
                    .collect();

                if !v.is_empty() {
                    // A cache: bounded, so that publishers of ever new topics
                    // cannot grow it without end (statebroker patch 8).
                    if self.publish_filters.len() >= MAX_CACHED_TOPICS {
                        self.publish_filters.clear();
                    }
                    self.publish_filters.insert(topic.to_owned(), v.clone());
                }

                Some(Matched::from_vec(v))
            }
        }
    }

    /// Frees the log of `filter` (no subscription uses it any more);
    /// returns the index it had (statebroker patch 8).
    pub fn remove_filter(&mut self, filter: &str) -> Option<FilterIdx> {
        let idx = match self.filter_indexes.remove(filter) {
            Some(idx) => {
                self.wild_indexes.remove(filter);
                idx
            }
            None => self.private_logs.remove(filter)?,
        };
        if let Some(data) = self.native.try_remove(idx) {
            self.held -= data.log.size();
        }
        self.count_logs();
        // The topic -> filters cache may name it: rebuilt on demand.
        self.publish_filters.clear();
        Some(idx)
    }

    /// The log of `filter`, or the private log of that name.
    fn index_of(&self, filter: &str) -> Option<FilterIdx> {
        self.filter_indexes
            .get(filter)
            .or_else(|| self.private_logs.get(filter))
            .copied()
    }

    /// A log that no topic matches, named `name` (a name that is not a
    /// valid filter, so that no subscription can share it), holding
    /// `messages`; returns its index and the position of its first message
    /// (statebroker patch 16).
    pub fn private_log(
        &mut self,
        name: &str,
        messages: impl IntoIterator<Item = PublishData>,
    ) -> (FilterIdx, Offset) {
        let idx = match self.private_logs.get(name) {
            Some(&idx) => idx,
            None => {
                let idx = self.native.insert(Data::new(name, &self.config));
                self.private_logs.insert(name.to_owned(), idx);
                idx
            }
        };
        let start = self.native[idx].log.next_offset();
        let mut woken = VecDeque::new();
        for message in messages {
            self.append(idx, message, &mut woken);
        }
        self.count_logs();
        (idx, start)
    }

    pub fn next_native_offset(&mut self, filter: &str) -> (FilterIdx, Offset) {
        let publish_filters = &mut self.publish_filters;
        let filter_indexes = &mut self.filter_indexes;

        let (filter_idx, data) = match filter_indexes.get(filter) {
            Some(idx) => (*idx, self.native.get(*idx).unwrap()),
            None => {
                let data = Data::new(filter, &self.config);

                // Add commitlog to datalog and add datalog index to filter to
                // datalog index map
                let idx = self.native.insert(data);
                self.filter_indexes.insert(filter.to_owned(), idx);
                let counts = &self.counts;
                counts
                    .logs
                    .store(self.native.len(), std::sync::atomic::Ordering::Relaxed);

                // Match new filter to existing topics and add to publish_filters if it matches
                // (without wildcards, only its own topic: statebroker patch 24)
                if has_wildcards(filter) {
                    self.wild_indexes.insert(filter.to_owned(), idx);
                    for (topic, filters) in publish_filters.iter_mut() {
                        if matches(topic, filter) {
                            filters.push(idx);
                        }
                    }
                } else if let Some(filters) = publish_filters.get_mut(filter) {
                    filters.push(idx);
                }

                (idx, self.native.get(idx).unwrap())
            }
        };

        (filter_idx, data.log.next_offset())
    }

    /// Reads up to `len` entries from `offset`, leaving out expired messages
    /// and those published by `exclude_origin` (No Local).
    pub fn native_readv(
        &self,
        filter_idx: FilterIdx,
        offset: Offset,
        len: u64,
        exclude_origin: Option<&str>,
    ) -> io::Result<(Position, Vec<(ReadMessage, Offset)>)> {
        // unwrap to get index of `self.native` is fine here, because when a new subscribe packet
        // arrives in `Router::handle_device_payload`, it first calls the function
        // `next_native_offset` which creates a new commitlog if one doesn't exist. So any new
        // reads will definitely happen on a valid filter.
        let Some(data) = self.native.get(filter_idx) else {
            return Err(io::Error::new(io::ErrorKind::NotFound, "filter log freed"));
        };
        let mut o = Vec::new();
        // TODO: `readv` is infallible but its current return type does not
        // reflect that. Consequently, this method is also infallible.
        // Encoding this information is important so that calling function
        // has more information on how this method behaves.
        let next = data.log.readv(offset, len, &mut o)?;

        let now = Instant::now();
        o.retain_mut(|(pubdata, _)| {
            if exclude_origin.is_some() && pubdata.origin.as_deref() == exclude_origin {
                return false;
            }
            // Keep data if no properties exists, which implies no message expiry!
            let Some(properties) = pubdata.properties.as_mut() else {
                return true;
            };

            // Keep data if there is no message_expiry_interval
            let Some(message_expiry_interval) = properties.message_expiry_interval.as_mut() else {
                return true;
            };

            let time_spent = (now - pubdata.timestamp).as_secs() as u32;

            let is_valid = time_spent < *message_expiry_interval;

            // ignore expired messages
            if is_valid {
                // set message_expiry_interval to (original value - time spent waiting in server)
                // ref: https://docs.oasis-open.org/mqtt/mqtt/v5.0/os/mqtt-v5.0-os.html#_Toc3901112
                *message_expiry_interval -= time_spent;
            }

            is_valid
        });

        // no need to include timestamp when returning
        let o = o
            .into_iter()
            .map(|(pubdata, offset)| {
                let read = ((pubdata.publish, pubdata.properties), pubdata.queued);
                (read, offset)
            })
            .collect();

        Ok((next, o))
    }

    pub fn shadow(&mut self, filter: &str) -> Option<PubWithProp> {
        let data = self.native.get_mut(*self.filter_indexes.get(filter)?)?;
        data.log.last().map(|p| (p.publish, p.properties))
    }

    /// This method is called when the subscriber has caught up with the commit log. In which case,
    /// instead of actively checking for commits in each `Router::run_inner` iteration, we instead
    /// wait and only try reading again when new messages have been added to the commit log. This
    /// methods converts a `DataRequest` (which actively reads the commit log in `Router::consume`)
    /// to a `Waiter` (which only reads when notified).
    pub fn park(&mut self, id: ConnectionId, request: DataRequest) {
        // calling unwrap on index here is fine, because only place this function is called is in
        // `Router::consume` method, when the status after reading from commit log of the same
        // filter as `request` is "done", that is, the subscriber has caught up. In other words,
        // there has been atleast 1 call to `native_readv` for the same filter, which means if
        // `native_readv` hasn't paniced, so this won't panic either.
        // A request whose filter's log was freed has nothing to wait for.
        if let Some(data) = self.native.get_mut(request.filter_idx) {
            data.waiters.register(id, request);
        }
    }

    /// Cleanup a connection from all the waiters
    pub fn clean(&mut self, id: ConnectionId) -> Vec<DataRequest> {
        let mut inflight = Vec::new();
        for (_, data) in self.native.iter_mut() {
            inflight.append(&mut data.waiters.remove(id));
        }

        inflight
    }

    pub fn insert_to_retained_publishes(
        &mut self,
        publish: Publish,
        publish_properties: Option<PublishProperties>,
        topic: Topic,
    ) {
        self.retained_bytes += topic.len() + publish.payload.len();
        let pub_with_props = (publish, publish_properties);
        if let Some(old) = self.retained_publishes.insert(topic, pub_with_props.into()) {
            self.retained_bytes -= retained_size(&old);
        }
        self.count_retained();
    }

    pub fn remove_from_retained_publishes(&mut self, topic: Topic) {
        if let Some(old) = self.retained_publishes.remove(&topic) {
            self.retained_bytes -= retained_size(&old);
        }
        self.count_retained();
    }

    /// Drops the retained messages whose Message Expiry has passed.
    fn discard_expired_retained(&mut self, now: Instant) {
        let mut freed = 0;
        self.retained_publishes.retain(|_, pubdata| {
            let keep = remaining_expiry(pubdata, now) != Some(0);
            if !keep {
                freed += retained_size(pubdata);
            }
            keep
        });
        self.retained_bytes -= freed;
        self.count_retained();
    }

    /// Which bound keeping `payload_len` bytes as `topic`'s retained
    /// message would pass (0: no bound): a new topic beyond `max_count`
    /// messages, or more bytes of topics and payloads than `max_bytes`
    /// (a replacement that does not grow them always fits); expired
    /// messages are discarded before a refusal. Statebroker patch 46.
    pub fn retain_refused(
        &mut self,
        topic: &str,
        payload_len: usize,
        max_count: usize,
        max_bytes: usize,
    ) -> Option<&'static str> {
        let refused = self.retained_bound_exceeded(topic, payload_len, max_count, max_bytes);
        if refused.is_some() {
            self.discard_expired_retained(Instant::now());
            return self.retained_bound_exceeded(topic, payload_len, max_count, max_bytes);
        }
        refused
    }

    /// Which bound one more retained message on `topic` would exceed, as
    /// the retained messages are now.
    fn retained_bound_exceeded(
        &self,
        topic: &str,
        payload_len: usize,
        max_count: usize,
        max_bytes: usize,
    ) -> Option<&'static str> {
        let old = self.retained_publishes.get(topic).map(retained_size);
        if max_count > 0 && old.is_none() && self.retained_publishes.len() >= max_count {
            return Some("max_retained_messages");
        }
        let after = self.retained_bytes - old.unwrap_or(0) + topic.len() + payload_len;
        if max_bytes > 0 && after > max_bytes && after > self.retained_bytes {
            return Some("max_retained_bytes");
        }
        None
    }

    /// Topic and payload bytes of the retained messages.
    pub fn retained_bytes(&self) -> usize {
        self.retained_bytes
    }

    fn count_retained(&self) {
        self.retained_count.store(
            self.retained_publishes.len(),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    pub fn read_retained_messages(&mut self, filter: &str) -> Vec<PubWithProp> {
        trace!(info = "reading retain msg", filter = &filter);
        let now = Instant::now();

        // Discard expired retained messages. The stored interval stays as
        // published: each reader gets the interval less the time the
        // message waited (statebroker patch 5; the stored value used to be
        // decremented on every read, so a message expired early).
        self.discard_expired_retained(now);

        self.retained_publishes
            .iter()
            .filter(|(topic, _)| matches(topic, filter))
            .map(|(_, p)| {
                let mut properties = p.properties.clone();
                if let Some(left) = remaining_expiry(p, now)
                    && let Some(props) = properties.as_mut()
                {
                    props.message_expiry_interval = Some(left);
                }
                (p.publish.clone(), properties)
            })
            .collect()
    }
}

/// Seconds left of a message's expiry interval at `now` (0: expired), or
/// `None` for a message that does not expire.
fn remaining_expiry(pubdata: &PublishData, now: Instant) -> Option<u32> {
    let interval = pubdata.properties.as_ref()?.message_expiry_interval?;
    let waited = now.saturating_duration_since(pubdata.timestamp).as_secs();
    Some(u32::try_from(u64::from(interval).saturating_sub(waited)).unwrap_or(0))
}

pub struct Data<T> {
    filter: Filter,
    pub log: CommitLog<T>,
    pub waiters: Waiters<DataRequest>,
    meter: SubscriptionMeter,
}

impl<T> Data<T>
where
    T: Storage + Clone,
{
    pub fn new(filter: &str, router_config: &RouterConfig) -> Data<T> {
        let mut max_segment_size = router_config.max_segment_size;
        let mut max_mem_segments = router_config.max_segment_count;

        // Override segment config for selected filter
        if let Some(config) = &router_config.custom_segment {
            for (f, segment_config) in config {
                if matches(filter, f) {
                    info!("Overriding segment config for filter: {}", filter);
                    max_segment_size = segment_config.max_segment_size;
                    max_mem_segments = segment_config.max_segment_count;
                }
            }
        }

        // max_segment_size: usize, max_mem_segments: usize
        let log = CommitLog::new(max_segment_size, max_mem_segments).unwrap();

        // Grown as connections wait (statebroker patch 24: 10 reserved up
        // front were 1.4 KB per filter log, 280 MB with 200,000 of them).
        let waiters = Waiters::with_capacity(0);
        let metrics = SubscriptionMeter::default();
        Data {
            filter: filter.to_owned(),
            log,
            waiters,
            meter: metrics,
        }
    }

    /// Writes to all the filters that are mapped to this publish topic
    /// and wakes up consumers that are matching this topic (if they exist)
    pub fn append(
        &mut self,
        item: T,
        notifications: &mut VecDeque<(ConnectionId, DataRequest)>,
    ) -> (Offset, &Filter) {
        let size = item.size();
        let offset = self.log.append(item);
        if let Some(mut parked) = self.waiters.take() {
            notifications.append(&mut parked);
        }

        self.meter.count += 1;
        self.meter.total_size += size;

        (offset, &self.filter)
    }
}

/// A QoS 2 publish waiting for its PUBREL, with the number the journal
/// keeps it under (statebroker patch 16).
pub type Recorded = (Publish, Option<PublishProperties>, Option<MessageId>);

/// What a recorded publish counts against the bounds of unreleased QoS 2
/// publishes: topic, payload and the properties' variable parts.
fn recorded_size((publish, properties, _): &Recorded) -> usize {
    publish_size(publish, properties.as_ref())
}

fn publish_size(publish: &Publish, properties: Option<&PublishProperties>) -> usize {
    let properties = properties.map_or(0, |p| {
        p.user_properties
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
            + p.response_topic.as_ref().map_or(0, |t| t.len())
            + p.correlation_data.as_ref().map_or(0, |c| c.len())
            + p.content_type.as_ref().map_or(0, |t| t.len())
    });
    publish.topic.len() + publish.payload.len() + properties
}

/// A session's QoS 2 publishes waiting for their PUBREL (statebroker patch
/// 6), with their bytes, counted into the router's total of such bytes
/// for as long as they are held, whether by a connection or by a kept
/// session (patch 47).
#[derive(Debug)]
pub struct Held {
    items: VecDeque<Recorded>,
    bytes: usize,
    total: Arc<AtomicUsize>,
}

impl Held {
    /// None yet, counted into `total`.
    pub fn new(total: Arc<AtomicUsize>) -> Held {
        Held {
            items: VecDeque::new(),
            bytes: 0,
            total,
        }
    }

    /// Bytes held ([`recorded_size`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What `publish` would count, recorded.
    pub fn size_of(publish: &Publish, properties: Option<&PublishProperties>) -> usize {
        publish_size(publish, properties)
    }

    fn contains(&self, pkid: u16) -> bool {
        self.items.iter().any(|(p, _, _)| p.pkid == pkid)
    }

    fn push(&mut self, recorded: Recorded) {
        let size = recorded_size(&recorded);
        self.bytes += size;
        self.total.fetch_add(size, Ordering::Relaxed);
        self.items.push_back(recorded);
    }

    fn take(&mut self, pkid: u16) -> Option<Recorded> {
        let at = self.items.iter().position(|(p, _, _)| p.pkid == pkid)?;
        let recorded = self.items.remove(at)?;
        let size = recorded_size(&recorded);
        self.bytes -= size;
        self.total.fetch_sub(size, Ordering::Relaxed);
        Some(recorded)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Acks log for a subscription
#[derive(Debug)]
pub struct AckLog {
    // Committed acks per connection, each with what it waits for in the
    // journal, if anything (statebroker patch 16).
    committed: VecDeque<(Ack, Option<Receipt>)>,
    // Recorded qos 2 publishes
    recorded: Held,
}

impl AckLog {
    /// New log; the QoS 2 publishes it records count into `held_total`
    /// (patch 47).
    pub fn new(held_total: Arc<AtomicUsize>) -> AckLog {
        AckLog {
            committed: VecDeque::with_capacity(100),
            recorded: Held::new(held_total),
        }
    }

    /// Bytes of the QoS 2 publishes recorded (patch 47).
    pub fn held_bytes(&self) -> usize {
        self.recorded.bytes()
    }

    pub fn connack(&mut self, id: ConnectionId, ack: ConnAck, props: Option<ConnAckProperties>) {
        let ack = Ack::ConnAck(id, ack, props);
        self.committed.push_back((ack, None));
    }

    /// A SUBACK, to hold until `receipt` is durable (statebroker patch 16).
    pub fn suback(&mut self, ack: SubAck, receipt: Option<Receipt>) {
        let ack = Ack::SubAck(ack);
        self.committed.push_back((ack, receipt));
    }

    /// A PUBACK, to hold until `receipt` is durable (statebroker patch 16).
    pub fn puback(&mut self, ack: PubAck, receipt: Option<Receipt>) {
        let ack = Ack::PubAck(ack);
        self.committed.push_back((ack, receipt));
    }

    /// Whether a QoS 2 publish with packet id `pkid` is recorded (its
    /// PUBREL has not come yet).
    pub fn is_recorded(&self, pkid: u16) -> bool {
        self.recorded.contains(pkid)
    }

    /// Records a QoS 2 publish until its PUBREL. A retransmission of a
    /// publish still recorded (same packet id) is acknowledged again but
    /// not recorded twice, so it is delivered once (statebroker patch 6).
    /// The PUBREC is held until `receipt` is durable (patch 16).
    /// A PUBREC that refuses the publish (a reason code of 0x80 or more):
    /// nothing recorded, no PUBREL to wait for (statebroker patch 23).
    pub fn pubrec_refused(&mut self, ack: PubRec) {
        self.committed.push_back((Ack::PubRec(ack), None));
    }

    pub fn pubrec(&mut self, recorded: Recorded, ack: PubRec, receipt: Option<Receipt>) {
        if !self.is_recorded(recorded.0.pkid) {
            self.recorded.push(recorded);
        }
        self.committed.push_back((Ack::PubRec(ack), receipt));
    }

    /// The QoS 2 publishes waiting for PUBREL (kept for a persistent
    /// session across connections, statebroker patch 6).
    pub fn take_recorded(&mut self) -> Held {
        let empty = Held::new(Arc::clone(&self.recorded.total));
        std::mem::replace(&mut self.recorded, empty)
    }

    /// Restores what [`AckLog::take_recorded`] took.
    pub fn restore_recorded(&mut self, recorded: Held) {
        self.recorded = recorded;
    }

    pub fn pubrel(&mut self, ack: PubRel) {
        let ack = Ack::PubRel(ack);
        self.committed.push_back((ack, None));
    }

    /// PUBREL `pkid`: releases the publish recorded with that packet id
    /// (whatever its position: the client may release in any order) and
    /// answers PUBCOMP, with "packet identifier not found" when there is
    /// none (statebroker patch 6; the router used to release the oldest
    /// publish whatever the packet id, and disconnect when there was none).
    pub fn pubcomp(&mut self, pkid: u16) -> Option<Recorded> {
        let recorded = self.recorded.take(pkid);
        let reason = match recorded {
            Some(_) => PubCompReason::Success,
            None => PubCompReason::PacketIdentifierNotFound,
        };
        self.committed
            .push_back((Ack::PubComp(PubComp { pkid, reason }), None));
        recorded
    }

    pub fn pingresp(&mut self, ack: PingResp) {
        let ack = Ack::PingResp(ack);
        self.committed.push_back((ack, None));
    }

    /// An UNSUBACK, to hold until `receipt` is durable (statebroker patch 16).
    pub fn unsuback(&mut self, ack: UnsubAck, receipt: Option<Receipt>) {
        let ack = Ack::UnsubAck(ack);
        self.committed.push_back((ack, receipt));
    }

    pub fn readv(&mut self) -> &mut VecDeque<(Ack, Option<Receipt>)> {
        &mut self.committed
    }
}

/// What a retained message counts against `max_retained_bytes`.
fn retained_size(data: &PublishData) -> usize {
    data.publish.topic.len() + data.publish.payload.len()
}

#[cfg(test)]
mod test {
    use super::DataLog;
    use crate::router::shared_subs::Strategy;
    use crate::RouterConfig;

    /// Small logs (1 KiB segments), no limits.
    fn config() -> RouterConfig {
        RouterConfig {
            max_segment_size: 1024,
            max_connections: 10,
            max_segment_count: 10,
            max_outgoing_packet_count: 1024,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Strategy::RoundRobin,
            max_subscriptions_per_client: 0,
            max_kept_sessions: 0,
            queue_full: Default::default(),
            max_retained_messages: 0,
            max_retained_bytes: 0,
            internal_prefix: String::new(),
            max_unreleased_qos2_bytes: 0,
            max_unreleased_qos2_bytes_total: 0,
        }
    }

    #[test]
    fn publish_filters_updating_correctly_on_new_topic_subscription() {
        let mut data = DataLog::new(config()).unwrap();
        data.next_native_offset("topic/a");
        data.matches("topic/a");

        data.next_native_offset("topic/+");

        assert_eq!(data.publish_filters.get("topic/a").unwrap().len(), 2);
    }

    /// A topic is looked up among the filters without wildcards and
    /// matched against those with (statebroker patch 24): the same logs as
    /// matching every filter, the cache kept up to date as filters come
    /// and go.
    #[test]
    fn a_topic_finds_its_exact_filter_and_the_matching_wildcards() {
        let mut data = DataLog::new(config()).unwrap();
        let mut idx = |filter: &str| data.next_native_offset(filter).0;
        let (exact, other, plus, hash, sys) =
            (idx("a/b"), idx("a/c"), idx("a/+"), idx("#"), idx("$SYS/x"));
        let mut sorted = |topic: &str| {
            let mut v = data.matches(topic).unwrap().into_vec();
            v.sort();
            v
        };
        let mut want = vec![exact, plus, hash];
        want.sort();
        assert_eq!(sorted("a/b"), want);
        assert!(!sorted("a/b").contains(&other));
        assert_eq!(sorted("$SYS/x"), vec![sys], "no leading wildcard for $");
        assert_eq!(sorted("a/b/c"), vec![hash]);
        // Cached "a/b": a new exact filter for it, and one for another topic.
        let again = data.next_native_offset("a/b/c").0;
        assert_eq!(data.publish_filters.get("a/b").unwrap().len(), 3);
        // Patch 39: a cached topic's logs come without an allocation.
        assert!(!data.matches("a/b").unwrap().spilled());
        let mut v = data.matches("a/b/c").unwrap().into_vec();
        v.sort();
        let mut want = vec![hash, again];
        want.sort();
        assert_eq!(v, want);
        data.remove_filter("a/+");
        assert!(!data.matches("a/b").unwrap().contains(&plus));
        assert!(!data.wild_indexes.contains_key("a/+"));
    }

    #[test]
    fn publish_filters_updating_correctly_on_new_publish() {
        let mut data = DataLog::new(config()).unwrap();
        data.next_native_offset("+/+");

        data.matches("topic/a");

        assert_eq!(data.publish_filters.get("topic/a").unwrap().len(), 1);
    }

    //     #[test]
    //     fn appends_are_written_to_correct_commitlog() {
    //         pretty_env_logger::init();
    //         let config = RouterConfig {
    //             instant_ack: true,
    //             max_segment_size: 1024,
    //             max_connections: 10,
    //             max_mem_segments: 10,
    //             max_disk_segments: 0,
    //             max_read_len: 1024,
    //             log_dir: None,
    //             dynamic_log: true,
    //         };

    //         let mut data = DataLog::new(config).unwrap();
    //         data.next_native_offset("/devices/2321/actions");
    //         for i in 0..2 {
    //             let publish = Publish::new("/devices/2321/events/imu/jsonarray", QoS::AtLeastOnce, vec![1, 2, 3]);
    //             let v = data.native_append(publish);
    //             dbg!(v);
    //         }

    //         for i in 0..2 {
    //             let publish = Publish::new("/devices/2321/actions", QoS::AtLeastOnce, vec![1, 2, 3]);
    //             let v = data.native_append(publish);
    //             dbg!(v);
    //         }
    //     }
}
