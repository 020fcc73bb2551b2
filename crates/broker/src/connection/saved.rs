//! Messages saved for persistent sessions (see [`crate::durable`]), as one
//! connection sees them: a publish of its client that reaches a persistent
//! session is saved, and marked, before it goes on to the router; a saved
//! message delivered to its client has its copy removed once the client
//! acknowledges it (PUBACK, or PUBREC at QoS 2), or at once when it went at
//! QoS 0 or was discarded.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use router::protocol::{Publish, PublishProperties};

use crate::durable::{Durable, tag};
use crate::sessions::Sessions;

pub(crate) struct Saved {
    durable: Option<Arc<Durable>>,
    /// The number of each saved message in flight, by packet id.
    awaiting: HashMap<u16, u64>,
    /// Messages given back after a restart that reached this connection:
    /// a second copy (through another subscription of the client) is not
    /// delivered.
    restored: HashSet<u64>,
}

impl Saved {
    /// Without `durable` (no data directory) nothing is saved.
    pub fn new(durable: Option<Arc<Durable>>) -> Saved {
        Saved {
            durable,
            awaiting: HashMap::new(),
            restored: HashSet::new(),
        }
    }

    /// `client`'s QoS 1/2 publish on `topic`, going to the router: saved
    /// and marked if it reaches persistent sessions. Returns the
    /// persistence sequence number to wait for (0: nothing).
    pub fn publishing(
        &self,
        sessions: &Sessions,
        client: &str,
        topic: &str,
        publish: &Publish,
        properties: &mut Option<PublishProperties>,
    ) -> u64 {
        let Some(durable) = &self.durable else {
            return 0;
        };
        let recipients = sessions.persistent_recipients(client, topic);
        if recipients.is_empty() {
            return 0;
        }
        match durable.queue(&recipients, publish, properties.as_ref()) {
            Some((seq, wait)) => {
                crate::metrics::queued_saved(recipients.len());
                tag::mark(properties, seq);
                wait
            }
            None => 0,
        }
    }

    /// A delivery from the router to the client `own_hex`: the broker's
    /// marks taken off. Returns the number the message is saved under, and
    /// whether it must not be delivered (a second copy of a restored one).
    pub fn delivering(
        &mut self,
        publish: &mut Publish,
        properties: &mut Option<PublishProperties>,
        own_hex: &str,
    ) -> (Option<u64>, bool) {
        let marks = tag::take(publish, properties, own_hex);
        let again = match marks.queued {
            Some(seq) if marks.restored => !self.restored.insert(seq),
            _ => false,
        };
        (marks.queued, again)
    }

    /// Saved message `seq` went to `client` as packet `pkid` (`None`: at
    /// QoS 0, or not at all).
    pub fn sent(&mut self, client: &str, seq: u64, pkid: Option<u16>) {
        match pkid {
            Some(pkid) => {
                self.awaiting.insert(pkid, seq);
            }
            None => self.delivered(client, seq),
        }
    }

    /// `client` acknowledged the router's delivery `pkid`.
    pub fn acknowledged(&mut self, client: &str, pkid: u16) {
        if let Some(seq) = self.awaiting.remove(&pkid) {
            self.delivered(client, seq);
        }
    }

    fn delivered(&self, client: &str, seq: u64) {
        if let Some(durable) = &self.durable {
            durable.delivered(client, seq);
        }
    }
}
