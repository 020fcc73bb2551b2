//! What of the router's state outlives the process, and how it comes back
//! (statebroker patch 16).
//!
//! The router calls its [`Journal`] (the broker's persistence implements
//! it) at each change a restart must not lose, on the router thread, as it
//! makes the change:
//!
//! - a **persistent session** (one that outlives its connection) is saved
//!   whole whenever it changes: at CONNECT, SUBSCRIBE, UNSUBSCRIBE and when
//!   its connection ends, and removed when it ends or expires;
//! - a **retained message** is saved when it is published (an empty
//!   retained publish removes it);
//! - a **QoS 1/2 publish that reaches persistent sessions** is saved once
//!   for them, under a [`MessageId`] that travels with it through the
//!   router's logs, and each session's copy is released when its client
//!   acknowledges the delivery ([`Journal::delivered`]).
//!
//! What the journal returns for a change is a [`Receipt`]: the
//! acknowledgement the change asked for (SUBACK, UNSUBACK, PUBACK, PUBREC)
//! leaves the router as [`crate::Notification::DurableAck`] with it, and the
//! connection holds it (and what follows it) until the journal says the
//! receipt is durable. So an acknowledgement still means "on disk".
//!
//! At start, [`crate::RouterHandle::restore`] gives the router back what the
//! journal kept: retained messages, and sessions with their subscriptions
//! and the messages they still wait for.

use std::num::NonZeroU64;
use std::time::Duration;

use crate::protocol::{Publish, PublishProperties};
use crate::subscriptions::{SessionRecord, SubOptions};

/// A change the journal made durable, or will: what an acknowledgement
/// waits for. Receipts are numbered in the order the journal took them;
/// "durable up to n" covers every receipt up to n.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Receipt(NonZeroU64);

impl Receipt {
    /// The receipt numbered `n` (none for 0).
    pub fn new(n: u64) -> Option<Receipt> {
        NonZeroU64::new(n).map(Receipt)
    }

    /// Its number.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl From<NonZeroU64> for Receipt {
    fn from(n: NonZeroU64) -> Receipt {
        Receipt(n)
    }
}

impl From<Receipt> for NonZeroU64 {
    fn from(receipt: Receipt) -> NonZeroU64 {
        receipt.0
    }
}

/// The number a saved message is kept under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId(pub u64);

/// A message as the journal keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The publish, at the QoS it was published with.
    pub publish: Publish,
    /// Its MQTT 5 properties.
    pub properties: Option<PublishProperties>,
}

/// Where the router's durable changes go. Called on the router thread: an
/// implementation queues its writes and returns at once.
pub trait Journal: Send + Sync {
    /// `client`'s persistent session is now `session`; `None`: it ended
    /// (with whatever was saved for it).
    fn session(&self, client: &str, session: Option<&SessionRecord>) -> Option<Receipt>;

    /// The retained message of `topic` is now `message` (`None`: removed).
    fn retained(&self, topic: &str, message: Option<&Message>) -> Option<Receipt>;

    /// `message` (QoS 1 or 2) reaches the persistent sessions of `clients`:
    /// save a copy for each until it is delivered. Returns its number and,
    /// if its acknowledgement is to wait for the save, the receipt (`None`:
    /// saved in the background, not waited for; `None` in all: not saved).
    fn queued(&self, clients: &[&str], message: &Message) -> Option<(MessageId, Option<Receipt>)>;

    /// `client` has `message` (it acknowledged the delivery, or got it at
    /// QoS 0): its copy is no longer needed. A message never saved for
    /// `client` is no error.
    fn delivered(&self, client: &str, message: MessageId);

    /// Whether it keeps queued messages at all ([`Journal::queued`]); one
    /// that keeps only sessions spares the router looking for the kept
    /// sessions each QoS 1/2 publish reaches (patch 26).
    fn keeps_messages(&self) -> bool {
        true
    }
}

/// A persistent session as the journal kept it, to rebuild at start.
#[derive(Debug, Clone)]
pub struct RestoredSession {
    /// Its client id.
    pub client_id: String,
    /// Its subscriptions, with their options.
    pub filters: Vec<(String, SubOptions)>,
    /// How much longer it is kept (`None`: for ever).
    pub expires_in: Option<Duration>,
    /// Its own `queue_full` (`None`: the router's).
    pub queue_full: Option<crate::QueueFull>,
    /// The messages it still waits for, in order, each delivered at the
    /// QoS and with the Subscription Identifiers of the subscriptions that
    /// match it (those no subscription matches are left out by the caller).
    pub waiting: Vec<(MessageId, Message)>,
}

/// What the journal kept, given back at start (before any client connects).
#[derive(Debug, Clone, Default)]
pub struct Restore {
    /// Retained messages (their expiry already reduced by the time they
    /// waited).
    pub retained: Vec<Message>,
    /// Persistent sessions.
    pub sessions: Vec<RestoredSession>,
}
