//! `INFO [section]`
//!
//! As Redis's INFO: a bulk string of `# Section` headers and `name:value`
//! lines, CR LF separated, for people and tools (statebroker-cli, the web
//! view). Sections: `server` (node id, the store's clock, clock skew
//! allowed), `keyspace` (keys, bytes of keys and values,
//! KEYNOTIFY registrations) and `quota` (the limits); no argument, `all` or
//! `default` gives all three, an unknown section an empty string (as
//! Redis does). Not in the public protocol article; unknown to the 2023
//! topic.

use super::{Answer, Parse};
use crate::error::Error;
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// A parsed INFO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info<'a> {
    /// The section asked for, if any.
    pub section: Option<&'a [u8]>,
}

impl<'a> Info<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Info<'a>, Error> {
        let section = parse.optional();
        parse.finish()?;
        Ok(Info { section })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        let wanted = |name: &str| match self.section {
            None => true,
            Some(s) => {
                s.eq_ignore_ascii_case(name.as_bytes())
                    || s.eq_ignore_ascii_case(b"all")
                    || s.eq_ignore_ascii_case(b"default")
            }
        };
        let config = state.config();
        let node = config.node_id.clone();
        let clock = state.clock_now(ctx.now);
        let mut sections: Vec<String> = Vec::new();
        if wanted("server") {
            sections.push(format!(
                "# Server\r\nstatestore_version:{}\r\nnode_id:{node}\r\nclock:{}\r\nmax_clock_skew_ms:{}\r\n",
                env!("CARGO_PKG_VERSION"),
                clock.format(&node),
                config.max_clock_skew_ms,
            ));
        }
        if wanted("keyspace") {
            sections.push(format!(
                "# Keyspace\r\nkeys:{}\r\nbytes:{}\r\nwatches:{}\r\n",
                state.len(),
                state.bytes(),
                state.watch_count(),
            ));
        }
        if wanted("quota") {
            let q = &config.quota;
            sections.push(format!(
                "# Quota\r\nmax_keys:{}\r\nmax_bytes:{}\r\nmax_key_size:{}\r\nmax_value_size:{}\r\nmax_watches_per_client:{}\r\nmax_watches_per_user:{}\r\nmax_watch_bytes_per_user:{}\r\nmax_watches:{}\r\n",
                q.max_keys,
                q.max_bytes,
                q.max_key_size,
                q.max_value_size,
                config.max_watches_per_client,
                config.max_watches_per_user,
                config.max_watch_bytes_per_user,
                config.max_watches,
            ));
        }
        Ok(Answer {
            frame: Frame::Bulk(sections.join("\r\n").into_bytes()),
            version: clock,
        })
    }
}
