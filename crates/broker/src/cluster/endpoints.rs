//! Which etcd members this node's client sends requests to.
//!
//! etcd's client (`etcd-client`'s balanced channel) fails a request it
//! sends to a member that is down rather than trying another one
//! (etcdv3/etcd-client#39): with one member of three down and a quorum
//! intact, about one request in three failed. `/readyz` flapped (its
//! read failed: "etcd does not answer"), and a node started with the dead
//! member among its endpoints failed to start three times in four.
//!
//! So the node keeps in the channel only the members that answer: at
//! start, those of `etcd_endpoints` that answer a status call (all of
//! them if none does: the start then fails as before, saying so); then,
//! every second and at once when a request fails, it asks each member on a
//! connection of its own, takes one that stops answering out of the
//! channel (a WARN), and puts it back once it answers again (an INFO). The
//! last member in the channel is never taken out. The member that answers
//! that it leads becomes the route of the keys' reads and writes (see
//! [`super::route`]).

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, StatusResponse};

use super::leader::Leader;
use super::route::Route;

/// How often each member is asked.
const EVERY: Duration = Duration::from_secs(1);

/// One member, asked on a connection of its own.
struct Probe {
    endpoint: String,
    client: Option<Client>,
}

impl Probe {
    /// The member's status, if it answers within `timeout`.
    async fn status(
        &mut self,
        options: &ConnectOptions,
        timeout: Duration,
    ) -> Option<StatusResponse> {
        let asked = async {
            if self.client.is_none() {
                self.client = Client::connect([self.endpoint.as_str()], Some(options.clone()))
                    .await
                    .ok();
            }
            let client = self.client.as_mut()?;
            client.status().await.ok()
        };
        tokio::time::timeout(timeout, asked).await.ok().flatten()
    }

    /// Whether the member says it leads.
    fn leads(status: &StatusResponse) -> bool {
        status
            .header()
            .is_some_and(|h| h.member_id() != 0 && h.member_id() == status.leader())
    }
}

/// A probe of each of `endpoints`, not connected yet.
fn probes(endpoints: &[String]) -> Vec<Probe> {
    endpoints
        .iter()
        .map(|endpoint| Probe {
            endpoint: endpoint.clone(),
            client: None,
        })
        .collect()
}

/// Each member's status, if it answers, asked at once.
async fn ask_all(
    probes: &mut [Probe],
    options: &ConnectOptions,
    timeout: Duration,
) -> Vec<Option<StatusResponse>> {
    futures_util::future::join_all(probes.iter_mut().map(|p| p.status(options, timeout))).await
}

/// The members of `endpoints` that answer now (all of them if none does),
/// in their order.
pub(super) async fn answering(
    endpoints: &[String],
    options: &ConnectOptions,
    timeout: Duration,
) -> Vec<String> {
    let answers = ask_all(&mut probes(endpoints), options, timeout).await;
    let up: Vec<String> = endpoints
        .iter()
        .zip(answers)
        .filter(|(_, status)| status.is_some())
        .map(|(endpoint, _)| endpoint.clone())
        .collect();
    if up.is_empty() {
        endpoints.to_vec()
    } else {
        up
    }
}

/// What [`follow`] keeps up to date.
pub(super) struct Following {
    /// The client whose channel holds the members that answer.
    pub(super) client: Client,
    /// `etcd_endpoints`.
    pub(super) endpoints: Vec<String>,
    /// The members in the channel at the start.
    pub(super) in_use: Vec<String>,
    pub(super) options: ConnectOptions,
    /// How long a member may take to answer.
    pub(super) timeout: Duration,
    /// The route of the keys' requests: to the member that leads.
    pub(super) route: std::sync::Arc<Route>,
    /// Takes in the terms the members answer with.
    pub(super) leader: std::sync::Arc<Leader>,
}

/// Keeps the channel to the members of `endpoints` that answer, and the
/// route to the one that leads: each second, and when `recheck` is
/// notified; ends when `stop` fires.
pub(super) async fn follow(
    following: Following,
    recheck: std::sync::Arc<tokio::sync::Notify>,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    let Following {
        client,
        endpoints,
        in_use,
        options,
        timeout,
        route,
        leader,
    } = following;
    let mut probes = probes(&endpoints);
    let mut in_use: BTreeSet<String> = in_use.into_iter().collect();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = recheck.notified() => {}
            _ = stop.changed() => return,
        }
        let answers = ask_all(&mut probes, &options, timeout).await;
        let mut led = false;
        for (probe, status) in probes.iter().zip(&answers) {
            let Some(status) = status else { continue };
            leader.observe(status.header());
            if Probe::leads(status)
                && let Some(client) = &probe.client
            {
                route.lead(&probe.endpoint, status.raft_term(), client);
                led = true;
            }
        }
        if !led {
            route.leave();
        }
        for (endpoint, status) in endpoints.iter().zip(answers) {
            let up = status.is_some();
            let used = in_use.contains(endpoint);
            if up && !used && client.add_endpoint(endpoint).await.is_ok() {
                in_use.insert(endpoint.clone());
                tracing::info!(
                    endpoint,
                    "clustering: etcd member answers again: requests go to it again"
                );
            } else if !up
                && used
                && in_use.len() > 1
                && client.remove_endpoint(endpoint).await.is_ok()
            {
                in_use.remove(endpoint);
                tracing::warn!(
                    endpoint,
                    "clustering: etcd member does not answer: requests go to the others until it does"
                );
            }
        }
    }
}
