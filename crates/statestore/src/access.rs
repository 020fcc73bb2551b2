//! Which keys a caller may read and write.
//!
//! The store knows nothing of policies: the broker hands each request a
//! [`KeyAccess`] (its authorization policy applied to the caller), and the
//! store asks it about the key the command names. GET and KEYNOTIFY need
//! read access, SET, DEL and VDEL write access; a refusal is exactly
//! `-ERR not authorized`, with nothing executed. SCAN is never refused: its
//! pages hold only the keys the caller may read. PING and INFO name no key.

use crate::command::Command;
use crate::error::Error;

/// What a caller may do with keys.
pub trait KeyAccess: std::fmt::Debug + Sync {
    /// Whether the caller may see `key` and its value.
    fn may_read(&self, key: &[u8]) -> bool;
    /// Whether the caller may change `key`.
    fn may_write(&self, key: &[u8]) -> bool;
}

/// Checks `command` against `access`.
pub(crate) fn check(command: &Command<'_>, access: &dyn KeyAccess) -> Result<(), Error> {
    let allowed = match command {
        Command::Get(c) => access.may_read(c.key),
        Command::KeyNotify(c) => access.may_read(c.key),
        Command::Set(c) => access.may_write(c.key),
        Command::Del(c) => access.may_write(c.key),
        Command::VDel(c) => access.may_write(c.key),
        Command::Scan(_) | Command::Ping(_) | Command::Info(_) => true,
    };
    if allowed {
        Ok(())
    } else {
        Err(Error::NotAuthorized)
    }
}

#[cfg(test)]
mod tests {
    use crate::resp3::encode_request;
    use crate::{Caller, Config, KeyAccess, Request, Store};

    /// Reads keys starting with `r` or `w`, writes keys starting with `w`.
    #[derive(Debug)]
    struct Prefixes;

    impl KeyAccess for Prefixes {
        fn may_read(&self, key: &[u8]) -> bool {
            key.starts_with(b"r") || key.starts_with(b"w")
        }
        fn may_write(&self, key: &[u8]) -> bool {
            key.starts_with(b"w")
        }
    }

    fn run(store: &mut Store, args: &[&str], access: bool) -> Vec<u8> {
        let payload = encode_request(args);
        let request = Request {
            payload: &payload,
            timestamp: Some("1700000000000:0:c"),
            access: access.then_some(&Prefixes as &dyn KeyAccess),
            ..Request::default()
        };
        let me = Caller {
            client_id: "c",
            connection: 1,
            owner: "c",
        };
        store.execute(&request, me, 1_700_000_000_000).payload
    }

    #[test]
    fn each_command_needs_its_access_and_scan_shows_only_readable_keys() {
        let mut store = Store::new(Config::default());
        for key in ["r1", "w1", "x1"] {
            assert_eq!(run(&mut store, &["SET", key, "v"], false), b"+OK\r\n");
        }
        let denied = b"-ERR not authorized\r\n".to_vec();
        assert_eq!(run(&mut store, &["SET", "r1", "new"], true), denied);
        assert_eq!(run(&mut store, &["DEL", "r1"], true), denied);
        assert_eq!(run(&mut store, &["VDEL", "r1", "v"], true), denied);
        assert_eq!(run(&mut store, &["GET", "x1"], true), denied);
        assert_eq!(run(&mut store, &["KEYNOTIFY", "x1"], true), denied);
        assert_eq!(run(&mut store, &["GET", "r1"], true), b"$1\r\nv\r\n");
        assert_eq!(run(&mut store, &["SET", "w1", "w"], true), b"+OK\r\n");
        assert_eq!(
            run(&mut store, &["GET", "r1"], false),
            b"$1\r\nv\r\n",
            "nothing executed"
        );
        let page = crate::command::Page::decode(&run(&mut store, &["SCAN", "*"], true)).unwrap();
        let mut keys = page.keys;
        keys.sort();
        assert_eq!(keys, vec![b"r1".to_vec(), b"w1".to_vec()]);
    }
}
