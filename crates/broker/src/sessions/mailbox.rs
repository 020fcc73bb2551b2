//! The way to a connection task: what the broker tells it, the publishes
//! it delivers directly, and the bound on what may wait for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use router::protocol::{ByteString, Publish, PublishProperties};
use tokio::sync::mpsc;

/// What the broker tells a connection task.
#[derive(Debug)]
// Nearly every message is a delivery: boxing it would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum ToConnection {
    /// Deliver this publish. Boxed: the channel allocates room for 32
    /// messages at a time, so the message's size sets what every idle
    /// connection's mailbox costs (6.8 KB unboxed, 0.6 KB boxed).
    Deliver(Box<Direct>),
    /// Another connection took the client id over: end with "session taken over".
    TakenOver,
    /// Deliveries waiting for the client passed its queue's bound: end the
    /// connection (MQTT 5: 0x97 quota exceeded).
    Overflow,
    /// A fault: end the connection with this reason (see [`crate::faults`]).
    Disconnect(router::protocol::DisconnectReasonCode),
    /// The node stopped serving (a cluster node lost its membership): end
    /// the connection (MQTT 5: 0x9C use another server).
    SendAway,
    /// The session's previous node has handed over what it had queued for
    /// it (a cluster node, see `cluster::handover`; the handed-over
    /// messages came before this): what the router gives the session may
    /// go out now, after them.
    HandoverDone,
    /// Answers this connection's held acknowledgements wait for are out,
    /// but did not come here (they went to another client's Response
    /// Topic, through the router, or nowhere): what `connection/hold.rs`
    /// holds for them may go. Sent after the store's answered position
    /// moved past them, at most once a group commit per client.
    AnswersOut,
}

/// The bound on what waits for one connection: direct deliveries queued,
/// written and not yet acknowledged, in messages and bytes (topic and
/// payload). A delivery that would pass it is dropped, and the connection
/// is told to end.
#[derive(Debug)]
pub struct QueueBound {
    messages: AtomicUsize,
    bytes: AtomicUsize,
    max_messages: usize,
    max_bytes: usize,
    overflowed: AtomicBool,
}

impl QueueBound {
    /// A bound of `max_messages` and `max_bytes`.
    pub fn new(max_messages: usize, max_bytes: usize) -> Arc<QueueBound> {
        Arc::new(QueueBound {
            messages: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_messages,
            max_bytes,
            overflowed: AtomicBool::new(false),
        })
    }

    /// Takes room for a message of `size` bytes; `false` when there is none.
    pub(crate) fn reserve(&self, size: usize) -> bool {
        let messages = self.messages.fetch_add(1, Ordering::AcqRel) + 1;
        let bytes = self.bytes.fetch_add(size, Ordering::AcqRel) + size;
        if messages > self.max_messages || bytes > self.max_bytes {
            self.release(size);
            return false;
        }
        true
    }

    /// Gives back the room of a message of `size` bytes (written at QoS 0,
    /// acknowledged, or discarded).
    pub fn release(&self, size: usize) {
        self.messages.fetch_sub(1, Ordering::AcqRel);
        self.bytes.fetch_sub(size, Ordering::AcqRel);
    }

    /// Marks the bound as passed; `true` the first time (then the
    /// connection is told, once).
    pub(super) fn overflow_once(&self) -> bool {
        !self.overflowed.swap(true, Ordering::AcqRel)
    }

    /// Messages and bytes held now.
    pub(crate) fn held(&self) -> (usize, usize) {
        (
            self.messages.load(Ordering::Acquire),
            self.bytes.load(Ordering::Acquire),
        )
    }
}

impl Direct {
    /// A plain QoS 1 message on `topic`, for tests.
    #[cfg(test)]
    pub(crate) fn qos1(topic: &'static [u8], payload: Bytes) -> Direct {
        Direct {
            topic: Bytes::from_static(topic),
            payload,
            properties: PublishProperties::default().into(),
            qos: 1,
            handed_over: false,
            retain: false,
            kept_pkid: None,
            on_done: None,
        }
    }

    /// `publish`, handed over from another node for one client's session
    /// (its `handed_over` field set): at its QoS, but a QoS 2 message in
    /// flight to the client under `kept_pkid` (see [`Direct::kept_pkid`]).
    pub fn handed_over(
        publish: Publish,
        properties: Option<PublishProperties>,
        kept_pkid: Option<u16>,
    ) -> Direct {
        Direct {
            topic: publish.topic,
            payload: publish.payload,
            properties: properties.unwrap_or_default().into(),
            qos: if kept_pkid.is_some() {
                2
            } else {
                publish.qos as u8
            },
            handed_over: true,
            retain: publish.retain,
            kept_pkid,
            on_done: None,
        }
    }

    /// Runs its [`OnDone`], if it has one.
    pub fn done(&self) {
        if let Some(on_done) = &self.on_done {
            on_done.run();
        }
    }

    /// What the message counts against its connection's [`QueueBound`].
    pub fn size(&self) -> usize {
        self.topic.len() + self.payload.len()
    }
}

/// The way to a connection task: its channel, and the bound on what waits.
#[derive(Debug, Clone)]
pub struct Mailbox {
    pub(super) tx: mpsc::UnboundedSender<ToConnection>,
    pub(super) bound: Arc<QueueBound>,
}

impl Mailbox {
    /// A mailbox that sends on `tx` within `bound`.
    pub fn new(tx: mpsc::UnboundedSender<ToConnection>, bound: Arc<QueueBound>) -> Mailbox {
        Mailbox { tx, bound }
    }
}

/// Why a direct delivery did not happen.
#[derive(Debug)]
pub enum Undelivered {
    /// The client is not connected, or none of its subscriptions matches:
    /// the message is given back (to route it, or drop it).
    NoRecipient(Box<Direct>),
    /// The client's queue is full: the message was dropped and the
    /// connection told to end.
    Overflow,
}

/// A publish for one client, delivered by its connection task.
#[derive(Debug, Clone)]
pub struct Direct {
    /// The topic.
    pub topic: Bytes,
    /// The payload.
    pub payload: Bytes,
    /// MQTT 5 properties (subscription identifiers are added on delivery).
    pub properties: DirectProperties,
    /// QoS 0 or 1; 2 only with [`Direct::kept_pkid`].
    pub qos: u8,
    /// Another cluster node handed it over for this client's session
    /// alone (see `cluster::handover`): never published on its topic.
    pub handed_over: bool,
    /// The RETAIN flag it goes with: a handed-over message's, as the other
    /// node's router had it for the client (set for a retained message on
    /// a Retain As Published subscription); `false` for the others.
    pub retain: bool,
    /// A QoS 2 message handed over while in flight to the client under
    /// this packet id (the id of the node the session left, which the
    /// client may keep until a PUBREL, MQTT 5 4.3.3): sent again under it
    /// at QoS 2 with DUP, so that a client that has it takes it as the
    /// same message. `None` for every other message.
    pub kept_pkid: Option<u16>,
    /// What to do once no copy of it is needed anywhere (see [`OnDone`]).
    pub on_done: Option<OnDone>,
}

/// What to do once a direct delivery needs no copy anywhere: the client
/// acknowledged it, it was written at QoS 0, or it was discarded (too
/// large for the client), or handed to the node the session moved to. A
/// cluster node removes the copy etcd kept of a message it took from
/// there (see `cluster::awaited`). Runs at most once per delivery; a
/// message kept for the session's next connection keeps it.
///
/// A thin pointer (a box in an `Arc`): every answer's `Direct` carries
/// the field, and its size is copied with each move of the message.
#[derive(Clone)]
pub struct OnDone(Arc<Box<dyn Fn() + Send + Sync>>);

impl OnDone {
    pub fn new(done: impl Fn() + Send + Sync + 'static) -> OnDone {
        OnDone(Arc::new(Box::new(done)))
    }

    pub fn run(&self) {
        (self.0)();
    }
}

impl std::fmt::Debug for OnDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnDone")
    }
}

/// A direct delivery's MQTT 5 properties.
#[derive(Debug, Clone)]
pub enum DirectProperties {
    /// A publish's own.
    Publish(PublishProperties),
    /// Properties most of which are the same for every message of a kind (a
    /// state store answer, a notification): those are `&'static`, written
    /// by the encoder, not owned anew for each message (an answer's took 7
    /// allocations).
    Fixed {
        fixed: &'static FixedProperties,
        correlation_data: Option<Bytes>,
        /// The one User Property that varies, after the fixed ones.
        varying: (&'static str, statestore::hlc::Stamp),
        subscription_identifiers: Vec<usize>,
    },
}

/// What every message of a kind carries (see [`DirectProperties::Fixed`]),
/// with its encoding, made once.
#[derive(Debug)]
pub struct FixedProperties {
    pub content_type: &'static str,
    pub user_properties: &'static [(&'static str, &'static str)],
    /// The Content Type property encoded, and the User Properties: each
    /// written with one copy (as separate properties they were 13 writes
    /// of a few bytes each, a `memcpy` call apiece).
    encoded: std::sync::OnceLock<(Vec<u8>, Vec<u8>)>,
}

impl FixedProperties {
    pub const fn new(
        content_type: &'static str,
        user_properties: &'static [(&'static str, &'static str)],
    ) -> FixedProperties {
        FixedProperties {
            content_type,
            user_properties,
            encoded: std::sync::OnceLock::new(),
        }
    }

    /// The encoded Content Type, and the encoded User Properties.
    fn encoded(&self) -> &(Vec<u8>, Vec<u8>) {
        self.encoded.get_or_init(|| {
            use crate::codec::{put_property_string, put_user_property};
            let mut head = bytes::BytesMut::new();
            put_property_string(&mut head, 0x03, self.content_type.as_bytes());
            let mut users = bytes::BytesMut::new();
            for (k, v) in self.user_properties {
                put_user_property(&mut users, k, v);
            }
            (head.to_vec(), users.to_vec())
        })
    }
}

impl Default for DirectProperties {
    fn default() -> Self {
        DirectProperties::Publish(PublishProperties::default())
    }
}

impl From<PublishProperties> for DirectProperties {
    fn from(properties: PublishProperties) -> Self {
        DirectProperties::Publish(properties)
    }
}

impl DirectProperties {
    /// The Subscription Identifiers of the subscriptions it is delivered
    /// for.
    pub fn set_subscription_identifiers(&mut self, ids: Vec<usize>) {
        match self {
            DirectProperties::Publish(p) => p.subscription_identifiers = ids,
            DirectProperties::Fixed {
                subscription_identifiers,
                ..
            } => *subscription_identifiers = ids,
        }
    }

    pub fn subscription_identifiers(&self) -> &[usize] {
        match self {
            DirectProperties::Publish(p) => &p.subscription_identifiers,
            DirectProperties::Fixed {
                subscription_identifiers,
                ..
            } => subscription_identifiers,
        }
    }

    /// As a publish's properties (to route the message, or look at it).
    pub fn into_publish(self) -> PublishProperties {
        match self {
            DirectProperties::Publish(p) => p,
            DirectProperties::Fixed {
                fixed,
                correlation_data,
                varying,
                subscription_identifiers,
            } => {
                let mut user_properties: Vec<(ByteString, ByteString)> = fixed
                    .user_properties
                    .iter()
                    .map(|&(k, v)| (ByteString::from_static(k), ByteString::from_static(v)))
                    .collect();
                user_properties.push((
                    ByteString::from_static(varying.0),
                    ByteString::from(varying.1.as_str()),
                ));
                PublishProperties {
                    content_type: Some(ByteString::from_static(fixed.content_type)),
                    correlation_data,
                    subscription_identifiers,
                    user_properties,
                    ..PublishProperties::default()
                }
            }
        }
    }
}

impl crate::codec::EncodeProperties for DirectProperties {
    fn encoded_len(&self) -> usize {
        match self {
            DirectProperties::Publish(p) => p.encoded_len(),
            DirectProperties::Fixed {
                fixed,
                correlation_data,
                varying,
                subscription_identifiers,
            } => FixedView {
                fixed,
                correlation_data: correlation_data.as_deref(),
                varying: (varying.0, &varying.1),
                subscription_identifiers,
            }
            .encoded_len(),
        }
    }

    fn put(&self, out: &mut bytes::BytesMut) {
        match self {
            DirectProperties::Publish(p) => p.put(out),
            DirectProperties::Fixed {
                fixed,
                correlation_data,
                varying,
                subscription_identifiers,
            } => FixedView {
                fixed,
                correlation_data: correlation_data.as_deref(),
                varying: (varying.0, &varying.1),
                subscription_identifiers,
            }
            .put(out),
        }
    }
}

/// [`DirectProperties::Fixed`]'s parts, borrowed: what the encoder writes
/// (an [`super::Answer`] is encoded from its own parts the same way).
pub(super) struct FixedView<'a> {
    pub fixed: &'static FixedProperties,
    pub correlation_data: Option<&'a [u8]>,
    pub varying: (&'static str, &'a str),
    pub subscription_identifiers: &'a [usize],
}

impl crate::codec::EncodeProperties for FixedView<'_> {
    fn encoded_len(&self) -> usize {
        use crate::codec::{string_len, subscription_identifiers_len, user_property_len};
        string_len(self.fixed.content_type.len())
            + self.correlation_data.map_or(0, |c| string_len(c.len()))
            + subscription_identifiers_len(self.subscription_identifiers)
            + self
                .fixed
                .user_properties
                .iter()
                .map(|(k, v)| user_property_len(k, v))
                .sum::<usize>()
            + user_property_len(self.varying.0, self.varying.1)
    }

    fn put(&self, out: &mut bytes::BytesMut) {
        use crate::codec::{put_property_string, put_subscription_identifiers, put_user_property};
        // The order PublishProperties' encoding keeps.
        let (head, users) = self.fixed.encoded();
        out.extend_from_slice(head);
        if let Some(c) = self.correlation_data {
            put_property_string(out, 0x09, c);
        }
        put_subscription_identifiers(out, self.subscription_identifiers);
        out.extend_from_slice(users);
        put_user_property(out, self.varying.0, self.varying.1);
    }
}
