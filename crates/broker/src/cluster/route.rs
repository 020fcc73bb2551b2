//! Where a node's state store requests go: to etcd's leader when the node
//! knows which member leads, otherwise to any member that answers.
//!
//! A linearizable read that reaches a follower waits while the follower
//! asks the leader for a read index, and a write that reaches a follower
//! is forwarded to the leader: one more round trip between members per
//! request. etcd's client spreads requests over all members, so two in
//! three paid it. Measured at 1 connection on 3 members (Intel Xeon, 2
//! cores, `etcd-txn-bench`, alternated three times): a read's p50 417-450
//! µs at the leader against 522-596 µs spread (585-590 µs at a follower),
//! a compare-and-put's 1,001-1,032 against 1,111-1,147 µs.
//!
//! [`super::endpoints::follow`] asks every member for its status each
//! second (and at once when a request failed); the member that answers
//! that it leads becomes the route, on that probe's own connection to it.
//! The route is left, and requests go to every member again, when a newer
//! term appears (see [`super::leader`]: the route's leader may be gone) or
//! a request on it fails; the next round names the leader again.
//! `[clustering] requests_to_leader = false` keeps requests spread.
//!
//! Only the batched reads and writes of keys' records take the route
//! (every GET, SET, DEL): the node's other etcd requests (sessions,
//! queued messages, leases, watches) are not on a client's answer path.

use etcd_client::{Client, KvClient};
use parking_lot::Mutex;

/// The way to etcd for keys' records.
pub(super) struct Route {
    /// The client's channel to every member that answers.
    any: KvClient,
    /// The leader, when known.
    leader: Mutex<Option<Leading>>,
    /// `requests_to_leader`.
    enabled: bool,
    /// Answers decoded, at most (as `any`'s).
    decoding_limit: usize,
}

/// A member that said it leads.
struct Leading {
    endpoint: String,
    /// The term it said it leads in.
    term: u64,
    kv: KvClient,
}

/// What a request is sent through.
pub(super) struct Way {
    pub(super) kv: KvClient,
    /// Sent to the leader: a failure leaves the route.
    pub(super) direct: bool,
}

impl Route {
    /// Requests go through `any` until a leader is named (and always,
    /// unless `enabled`); a leader's answers are decoded up to
    /// `decoding_limit`, as `any`'s.
    pub(super) fn new(any: KvClient, enabled: bool, decoding_limit: usize) -> Route {
        Route {
            any,
            leader: Mutex::new(None),
            enabled,
            decoding_limit,
        }
    }

    /// The way for a request sent while the greatest term seen is `term`:
    /// the leader's if it led in that term.
    pub(super) fn way(&self, term: u64) -> Way {
        match &*self.leader.lock() {
            Some(leader) if leader.term >= term => Way {
                kv: leader.kv.clone(),
                direct: true,
            },
            _ => Way {
                kv: self.any.clone(),
                direct: false,
            },
        }
    }

    /// The member at `endpoint` (reached through `client`, a connection to
    /// it alone) says it leads in `term`.
    pub(super) fn lead(&self, endpoint: &str, term: u64, client: &Client) {
        if !self.enabled {
            return;
        }
        let mut leader = self.leader.lock();
        if let Some(known) = &mut *leader
            && known.endpoint == endpoint
        {
            known.term = known.term.max(term);
            return;
        }
        if leader.as_ref().is_some_and(|known| known.term > term) {
            // A member that has not heard of the newer leader yet.
            return;
        }
        tracing::info!(
            endpoint,
            term,
            "clustering: state store requests go to etcd's leader"
        );
        *leader = Some(Leading {
            endpoint: endpoint.to_owned(),
            term,
            kv: client
                .kv_client()
                .max_decoding_message_size(self.decoding_limit),
        });
    }

    /// No member says it leads, or a request sent to the leader failed:
    /// requests go to every member until one does again.
    pub(super) fn leave(&self) {
        if let Some(leader) = self.leader.lock().take() {
            tracing::debug!(
                endpoint = leader.endpoint,
                "clustering: state store requests go to every etcd member until the leader is known again"
            );
        }
    }

    /// The leader's endpoint, if requests go to it now (for tests).
    #[cfg(test)]
    fn endpoint(&self, term: u64) -> Option<String> {
        self.leader
            .lock()
            .as_ref()
            .filter(|leader| leader.term >= term)
            .map(|leader| leader.endpoint.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of a member nobody runs: its channel connects lazily, so
    /// nothing is sent.
    async fn client(port: u16) -> Client {
        Client::connect([format!("http://127.0.0.1:{port}")], None)
            .await
            .expect("a lazy channel")
    }

    fn direct(route: &Route, term: u64) -> bool {
        route.way(term).direct
    }

    #[tokio::test]
    async fn requests_follow_the_member_that_leads_in_the_newest_term() {
        let any = client(1).await;
        let route = Route::new(any.kv_client(), true, 1 << 20);
        assert!(!direct(&route, 1), "no leader known: every member");

        let a = client(2).await;
        route.lead("a", 5, &a);
        assert!(direct(&route, 5));
        assert_eq!(route.endpoint(5).as_deref(), Some("a"));
        assert!(
            !direct(&route, 6),
            "a newer term seen: the leader may be gone"
        );

        // A member that has not heard of a newer leader does not take over.
        let b = client(3).await;
        route.lead("b", 4, &b);
        assert_eq!(route.endpoint(5).as_deref(), Some("a"));
        // The one that leads in a newer term does.
        route.lead("b", 6, &b);
        assert_eq!(route.endpoint(6).as_deref(), Some("b"));
        // The same leader in a later term goes on.
        route.lead("b", 7, &b);
        assert_eq!(route.endpoint(7).as_deref(), Some("b"));

        route.leave();
        assert!(!direct(&route, 7), "left: every member");
        route.lead("a", 8, &a);
        assert_eq!(route.endpoint(8).as_deref(), Some("a"));
    }

    #[tokio::test]
    async fn turned_off_requests_stay_spread() {
        let any = client(1).await;
        let route = Route::new(any.kv_client(), false, 1 << 20);
        route.lead("a", 5, &client(2).await);
        assert!(!direct(&route, 5));
        assert!(!direct(&route, 0));
    }
}
