//! The commands, one module each, and how their arguments are read.
//!
//! | request | success | other outcomes |
//! |---|---|---|
//! | `SET key value [NX \| NEX] [PX ms]` | `+OK` | not applied: `:-1` |
//! | `GET key` | `$len value` | missing: `$-1` |
//! | `DEL key` | `:1` | missing: `:0` |
//! | `VDEL key value` | `:1` | missing: `:0`; other value: `:-1` |
//! | `KEYNOTIFY key [STOP]` | `+OK` | STOP of a key not watched: `:0` |
//! | `SCAN pattern [token]` | `*1 *K keys…` (last page) or `*2 *K keys… token` | |
//! | `PING [message]` | `+PONG`, or the message | |
//! | `INFO [section]` | `$len` Redis-style `# Section` / `name:value` lines | |
//!
//! On the current request topic verbs and options are case-insensitive (the
//! official clients send upper case). On the 2023 topic the rules of that
//! generation apply: verbs are lower-case only (`set`, `get`, `del`, `vdel`;
//! `SET` or `seT` is an unknown command) and options upper-case only (`NX`,
//! `NEX`, `PX`; `nx` is a syntax error).

mod del;
mod get;
mod info;
mod keynotify;
mod ping;
mod scan;
mod set;
mod vdel;

pub use del::Del;
pub use get::Get;
pub use info::Info;
pub use keynotify::KeyNotify;
pub use ping::Ping;
pub use scan::{Page, STEPS_PER_PAGE, Scan};
pub use set::{Condition, Set};
pub use vdel::VDel;

use crate::error::Error;
use crate::plan::{Context, Plan, Planner};
use crate::state::{Ctx, State};

/// Which generation of the protocol a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// `statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke`
    #[default]
    V1,
    /// `$services/statestore/_any_/command/invoke/request` (the 2023 article)
    Legacy2023,
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command<'a> {
    /// `SET`
    Set(Set<'a>),
    /// `GET`
    Get(Get<'a>),
    /// `DEL`
    Del(Del<'a>),
    /// `VDEL`
    VDel(VDel<'a>),
    /// `KEYNOTIFY`
    KeyNotify(KeyNotify<'a>),
    /// `SCAN`
    Scan(Scan<'a>),
    /// `PING`
    Ping(Ping<'a>),
    /// `INFO`
    Info(Info<'a>),
}

pub use crate::plan::Answer;

/// A command on one key's entry: planned against it (see [`crate::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCommand<'a> {
    /// `SET`
    Set(Set<'a>),
    /// `GET`
    Get(Get<'a>),
    /// `DEL`
    Del(Del<'a>),
    /// `VDEL`
    VDel(VDel<'a>),
}

impl<'a> KeyCommand<'a> {
    /// The command, if it is one on a key's entry; `None` for KEYNOTIFY,
    /// SCAN, PING and INFO.
    pub fn of(command: Command<'a>) -> Option<KeyCommand<'a>> {
        match command {
            Command::Set(c) => Some(KeyCommand::Set(c)),
            Command::Get(c) => Some(KeyCommand::Get(c)),
            Command::Del(c) => Some(KeyCommand::Del(c)),
            Command::VDel(c) => Some(KeyCommand::VDel(c)),
            _ => None,
        }
    }

    /// The key.
    pub fn key(&self) -> &'a [u8] {
        match self {
            KeyCommand::Set(c) => c.key,
            KeyCommand::Get(c) => c.key,
            KeyCommand::Del(c) => c.key,
            KeyCommand::VDel(c) => c.key,
        }
    }

    /// The verb.
    pub fn name(&self) -> &'static str {
        match self {
            KeyCommand::Set(_) => "SET",
            KeyCommand::Get(_) => "GET",
            KeyCommand::Del(_) => "DEL",
            KeyCommand::VDel(_) => "VDEL",
        }
    }

    /// Whether the command can change its key (GET cannot).
    pub fn writes(&self) -> bool {
        !matches!(self, KeyCommand::Get(_))
    }

    /// Decides the answer and the change against `current`, the key's
    /// entry (`None`: the key does not exist, or expired).
    pub fn plan(
        &self,
        current: Option<&crate::db::Entry>,
        ctx: &Context<'_>,
        planner: &dyn Planner,
    ) -> Result<Plan<'a>, Error> {
        match self {
            KeyCommand::Set(set) => set.plan(current, ctx, planner),
            KeyCommand::Get(_) => Ok(get::plan(current)),
            KeyCommand::Del(_) => del::plan(current, ctx, None),
            KeyCommand::VDel(vdel) => del::plan(current, ctx, Some(vdel.value)),
        }
    }
}

impl<'a> Command<'a> {
    /// Parses the arguments of a RESP3 request.
    ///
    /// ```
    /// use statestore::command::{Command, Dialect};
    /// use statestore::Error;
    /// let cmd = Command::parse(&[b"get", b"k"], Dialect::V1).unwrap();
    /// assert!(matches!(cmd, Command::Get(_)));
    /// assert_eq!(Command::parse(&[b"GET", b"k"], Dialect::Legacy2023), Err(Error::UnknownCommand));
    /// assert_eq!(Command::parse(&[b"GET"], Dialect::V1), Err(Error::WrongNumberOfArguments));
    /// ```
    pub fn parse(args: &[&'a [u8]], dialect: Dialect) -> Result<Command<'a>, Error> {
        let (verb, rest) = args.split_first().ok_or(Error::Syntax)?;
        let mut parse = Parse {
            args: rest.iter(),
            dialect,
        };
        let verb_is = |name: &str| match dialect {
            Dialect::V1 => verb.eq_ignore_ascii_case(name.as_bytes()),
            Dialect::Legacy2023 => *verb == name.to_ascii_lowercase().as_bytes(),
        };
        let command = if verb_is("SET") {
            Command::Set(Set::parse(&mut parse)?)
        } else if verb_is("GET") {
            Command::Get(Get::parse(&mut parse)?)
        } else if verb_is("DEL") {
            Command::Del(Del::parse(&mut parse)?)
        } else if verb_is("VDEL") {
            Command::VDel(VDel::parse(&mut parse)?)
        } else if dialect == Dialect::V1 && verb_is("KEYNOTIFY") {
            Command::KeyNotify(KeyNotify::parse(&mut parse)?)
        } else if dialect == Dialect::V1 && verb_is("SCAN") {
            Command::Scan(Scan::parse(&mut parse)?)
        } else if dialect == Dialect::V1 && verb_is("PING") {
            Command::Ping(Ping::parse(&mut parse)?)
        } else if dialect == Dialect::V1 && verb_is("INFO") {
            Command::Info(Info::parse(&mut parse)?)
        } else {
            return Err(Error::UnknownCommand);
        };
        Ok(command)
    }

    /// Every verb [`Command::name`] returns.
    pub const NAMES: [&'static str; 8] = [
        "SET",
        "GET",
        "DEL",
        "VDEL",
        "KEYNOTIFY",
        "SCAN",
        "PING",
        "INFO",
    ];

    /// The verb, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Set(_) => "SET",
            Command::Get(_) => "GET",
            Command::Del(_) => "DEL",
            Command::VDel(_) => "VDEL",
            Command::KeyNotify(_) => "KEYNOTIFY",
            Command::Scan(_) => "SCAN",
            Command::Ping(_) => "PING",
            Command::Info(_) => "INFO",
        }
    }

    /// The key the command names; `None` for SCAN, PING and INFO.
    pub fn key(&self) -> Option<&'a [u8]> {
        match self {
            Command::Set(c) => Some(c.key),
            Command::Get(c) => Some(c.key),
            Command::Del(c) => Some(c.key),
            Command::VDel(c) => Some(c.key),
            Command::KeyNotify(c) => Some(c.key),
            Command::Scan(_) | Command::Ping(_) | Command::Info(_) => None,
        }
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        match self {
            Command::Set(cmd) => cmd.apply(state, ctx),
            Command::Get(cmd) => cmd.apply(state, ctx),
            Command::Del(cmd) => cmd.apply(state, ctx),
            Command::VDel(cmd) => cmd.apply(state, ctx),
            Command::KeyNotify(cmd) => cmd.apply(state, ctx),
            Command::Scan(cmd) => cmd.apply(state, ctx),
            Command::Ping(cmd) => cmd.apply(state, ctx),
            Command::Info(cmd) => cmd.apply(state, ctx),
        }
    }
}

/// Serves a key command on the single node: planned against the key's
/// entry (see [`crate::plan`]) and committed into the node's own keys.
fn apply_key(command: KeyCommand<'_>, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
    let context = crate::plan::Context {
        now: ctx.now,
        timestamp: ctx.timestamp.as_ref(),
        fencing_token: ctx.fencing_token.as_ref(),
        persist: ctx.persist,
    };
    let plan = command.plan(state.get(command.key()), &context, state)?;
    Ok(state.commit(command.key(), plan, &context))
}

/// A cursor over a command's arguments (after the verb).
pub(crate) struct Parse<'a, 'b> {
    args: std::slice::Iter<'b, &'a [u8]>,
    dialect: Dialect,
}

impl<'a> Parse<'a, '_> {
    /// The next argument, which must exist.
    fn required(&mut self) -> Result<&'a [u8], Error> {
        self.args
            .next()
            .copied()
            .ok_or(Error::WrongNumberOfArguments)
    }

    /// The next argument as a key: it must exist and not be empty.
    fn key(&mut self) -> Result<&'a [u8], Error> {
        let key = self.required()?;
        if key.is_empty() {
            return Err(Error::KeyLengthZero);
        }
        Ok(key)
    }

    /// The next argument, if any.
    fn optional(&mut self) -> Option<&'a [u8]> {
        self.args.next().copied()
    }

    /// Whether `arg` is the option `name` under this dialect's case rules.
    fn is_option(&self, arg: &[u8], name: &str) -> bool {
        match self.dialect {
            Dialect::V1 => arg.eq_ignore_ascii_case(name.as_bytes()),
            Dialect::Legacy2023 => arg == name.as_bytes(),
        }
    }

    /// Fails if arguments are left over.
    fn finish(&mut self) -> Result<(), Error> {
        match self.args.next() {
            None => Ok(()),
            Some(_) => Err(Error::WrongNumberOfArguments),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&[u8]]) -> Result<Command<'static>, Error> {
        let args: Vec<&'static [u8]> = args.iter().map(|a| &*Vec::leak(a.to_vec())).collect();
        Command::parse(&args, Dialect::V1)
    }

    fn parse_2023(args: &[&[u8]]) -> Result<Command<'static>, Error> {
        let args: Vec<&'static [u8]> = args.iter().map(|a| &*Vec::leak(a.to_vec())).collect();
        Command::parse(&args, Dialect::Legacy2023)
    }

    #[test]
    fn verbs_are_case_insensitive_on_v1() {
        for verb in [&b"get"[..], b"GET", b"gEt"] {
            assert!(matches!(parse(&[verb, b"k"]), Ok(Command::Get(_))));
        }
        assert!(matches!(
            parse(&[b"keynotify", b"k"]),
            Ok(Command::KeyNotify(_))
        ));
        assert!(matches!(parse(&[b"scan", b"*"]), Ok(Command::Scan(_))));
    }

    #[test]
    fn the_2023_dialect_is_case_sensitive() {
        assert!(matches!(
            parse_2023(&[b"set", b"k", b"v", b"NX"]),
            Ok(Command::Set(_))
        ));
        assert!(matches!(
            parse_2023(&[b"vdel", b"k", b"v"]),
            Ok(Command::VDel(_))
        ));
        assert_eq!(
            parse_2023(&[b"SET", b"k", b"v"]),
            Err(Error::UnknownCommand)
        );
        assert_eq!(
            parse_2023(&[b"seT", b"k", b"v"]),
            Err(Error::UnknownCommand)
        );
        assert_eq!(parse_2023(&[b"set", b"k", b"v", b"nX"]), Err(Error::Syntax));
        assert_eq!(
            parse_2023(&[b"set", b"k", b"v", b"px", b"10"]),
            Err(Error::Syntax)
        );
        assert_eq!(
            parse_2023(&[b"keynotify", b"k"]),
            Err(Error::UnknownCommand)
        );
        assert_eq!(parse_2023(&[b"scan", b"*"]), Err(Error::UnknownCommand));
    }

    /// `NAMES` lists exactly the verbs the parser knows, under the names
    /// `name` gives them.
    #[test]
    fn names_are_the_known_verbs() {
        let mut named = Vec::new();
        for verb in Command::NAMES {
            let args = [verb.as_bytes(), b"k", b"v"];
            let known = (1..=3).find_map(|n| parse(&args[..n]).ok());
            let command = known.unwrap_or_else(|| panic!("{verb} does not parse"));
            assert_eq!(command.name(), verb);
            named.push(verb);
        }
        named.sort_unstable();
        named.dedup();
        assert_eq!(named.len(), Command::NAMES.len());
    }

    #[test]
    fn unknown_verbs_and_empty_requests() {
        assert_eq!(parse(&[b"FLUSHALL"]), Err(Error::UnknownCommand));
        assert_eq!(parse(&[b""]), Err(Error::UnknownCommand));
        assert_eq!(parse(&[]), Err(Error::Syntax));
    }

    #[test]
    fn arity() {
        let wrong = Err(Error::WrongNumberOfArguments);
        assert_eq!(parse(&[b"GET"]), wrong);
        assert_eq!(parse(&[b"GET", b"a", b"b"]), wrong);
        assert_eq!(parse(&[b"DEL"]), wrong);
        assert_eq!(parse(&[b"DEL", b"a", b"b"]), wrong);
        assert_eq!(parse(&[b"VDEL", b"a"]), wrong);
        assert_eq!(parse(&[b"VDEL", b"a", b"b", b"c"]), wrong);
        assert_eq!(parse(&[b"SET", b"a"]), wrong);
        assert_eq!(parse(&[b"SET"]), wrong);
        assert_eq!(parse(&[b"KEYNOTIFY"]), wrong);
        assert_eq!(parse(&[b"KEYNOTIFY", b"k", b"STOP", b"x"]), wrong);
        assert_eq!(parse(&[b"SCAN"]), wrong);
        assert_eq!(parse(&[b"SCAN", b"*", b"0", b"x"]), wrong);
    }

    #[test]
    fn zero_length_keys() {
        let zero = Err(Error::KeyLengthZero);
        assert_eq!(parse(&[b"GET", b""]), zero);
        assert_eq!(parse(&[b"SET", b"", b"v"]), zero);
        assert_eq!(parse(&[b"DEL", b""]), zero);
        assert_eq!(parse(&[b"VDEL", b"", b"v"]), zero);
        assert_eq!(parse(&[b"KEYNOTIFY", b""]), zero);
    }
}
