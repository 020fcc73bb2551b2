//! A request's reply: where its response goes and who asked, and what
//! the metrics and the live list are told of how it ended.

use statestore::{Caller, Outcome, Request};

use super::StateStoreService;
use crate::clock::now_ms;
use crate::store::binding::ReplyTo;

/// Where a response goes, and who asked: the requester's client id
/// borrowed from the request while the answer goes at once, copied for an
/// answer that waits ([`Reply::detach`]).
#[derive(Debug, Clone)]
pub(in crate::store) struct Reply<'a> {
    /// `None`: the caller is the broker's own tool, answered directly.
    pub(in crate::store) to: Option<ReplyTo>,
    pub(in crate::store) requester: std::borrow::Cow<'a, str>,
    /// For metrics: the command, whether it succeeded, when it arrived.
    pub(in crate::store) command: &'static str,
    pub(super) ok: bool,
    pub(super) started: crate::clock::Ticks,
    /// For the live list, when someone watches: the key and the outcome.
    pub(super) shown: Option<(Option<String>, String)>,
}

impl StateStoreService {
    /// Where the answer of `request` goes, before it is known; with the
    /// key for the live list when the activity wants it (someone watches,
    /// or the backlog's sample is due; the outcome is filled in by
    /// [`settle`]).
    pub(in crate::store) fn reply_pending<'c>(
        &self,
        request: &Request<'_>,
        caller: Caller<'c>,
        reply_to: Option<ReplyTo>,
        command: &'static str,
    ) -> Reply<'c> {
        let now = (crate::clock::Ticks::now(), now_ms());
        self.reply_pending_at(request, caller, reply_to, command, now)
    }

    /// [`Self::reply_pending`] of a request that started at `started`,
    /// the machine's wall clock then `machine_ms` (each clock read once a
    /// request).
    pub(super) fn reply_pending_at<'c>(
        &self,
        request: &Request<'_>,
        caller: Caller<'c>,
        reply_to: Option<ReplyTo>,
        command: &'static str,
        (started, machine_ms): (crate::clock::Ticks, u64),
    ) -> Reply<'c> {
        let shown = self.activity.wanted_at(machine_ms).then(|| {
            let key = statestore::resp3::parse_request(request.payload)
                .ok()
                .and_then(|args| args.get(1).map(|k| String::from_utf8_lossy(k).into_owned()));
            (key, String::new())
        });
        Reply {
            to: reply_to,
            requester: std::borrow::Cow::Borrowed(caller.client_id),
            command,
            ok: true,
            started,
            shown,
        }
    }

    /// The reply of an outcome served at once.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(in crate::store) fn reply<'c>(
        &self,
        request: &Request<'_>,
        caller: Caller<'c>,
        reply_to: Option<ReplyTo>,
        outcome: &Outcome,
    ) -> Reply<'c> {
        let mut reply = self.reply_pending(
            request,
            caller,
            reply_to,
            outcome.command.unwrap_or_else(|| verb_of(request.payload)),
        );
        settle(&mut reply, outcome.error);
        reply
    }
}

impl Reply<'_> {
    /// The same reply, owning its requester's client id: it outlives the
    /// request (it waits for the disk, or for etcd).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(in crate::store) fn detach(mut self) -> Reply<'static> {
        self.take_detached()
    }

    /// [`Reply::detach`] of a lent reply: its destination and what the
    /// live list shows taken out of it.
    pub(super) fn take_detached(&mut self) -> Reply<'static> {
        Reply {
            requester: std::borrow::Cow::Owned(std::mem::take(&mut self.requester).into_owned()),
            to: self.to.take(),
            command: self.command,
            ok: self.ok,
            started: self.started,
            shown: self.shown.take(),
        }
    }
}

/// Fills in how a request ended: for metrics and the live list.
pub(super) fn settle(reply: &mut Reply<'_>, error: Option<statestore::Error>) {
    reply.ok = error.is_none();
    if error == Some(statestore::Error::QuotaExceeded) {
        quota_reached(&reply.requester, reply.command);
    }
    if let Some((_, result)) = &mut reply.shown {
        *result = error.map_or_else(|| "ok".to_owned(), |e| e.to_string());
    }
}

/// A request refused for a quota of the store (`[statestore.quota]`: keys,
/// bytes, a key's or value's size, watches): a WARN at most every 10 s
/// with how many were refused since, for the operator of a store that is
/// full. A client's other refusals are its own business (DEBUG).
fn quota_reached(client_id: &str, command: &str) {
    static LAST: parking_lot::Mutex<(Option<std::time::Instant>, u64)> =
        parking_lot::Mutex::new((None, 0));
    let mut last = LAST.lock();
    last.1 += 1;
    let now = std::time::Instant::now();
    if last
        .0
        .is_none_or(|at| now.duration_since(at) >= std::time::Duration::from_secs(10))
    {
        tracing::warn!(
            client_id = ?client_id,
            command,
            refused = std::mem::take(&mut last.1),
            "state store requests refused: a quota of [statestore.quota] is reached \
             (keys, bytes, a key's or value's size, or watches)"
        );
        last.0 = Some(now);
    }
}

/// The verb of a request the store refused before it knew the command (a
/// wrong number of arguments, say), when it is one the store serves: for
/// the live list and the metrics, which otherwise say `unknown`.
pub(super) fn verb_of(payload: &[u8]) -> &'static str {
    statestore::resp3::parse_request(payload)
        .ok()
        .and_then(|args| {
            let verb = args.first()?;
            statestore::command::Command::NAMES
                .into_iter()
                .find(|name| verb.eq_ignore_ascii_case(name.as_bytes()))
        })
        .unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::verb_of;
    use statestore::resp3::encode_request;

    #[test]
    fn a_refused_request_is_named_by_its_verb_when_known() {
        assert_eq!(verb_of(&encode_request(&["GET", "k", "extra"])), "GET");
        assert_eq!(verb_of(&encode_request(&["keynotify"])), "KEYNOTIFY");
        assert_eq!(verb_of(&encode_request(&["FLUSHALL"])), "unknown");
        assert_eq!(verb_of(b"not resp3"), "unknown");
    }
}
