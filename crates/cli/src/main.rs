//! `statebroker-cli`: the state store from the command line, as `redis-cli`
//! is for Redis. It speaks only the public protocol, so it works against
//! statebroker and against a real Azure IoT Operations broker alike.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

mod faults;
mod output;

use statebroker_cli::{client, tls};

use client::{Client, Failure, Target};
use output::{EXIT_ERR, Format, Printer};

/// Exit status when there was no answer (no connection, or timeout).
const EXIT_NO_ANSWER: u8 = 2;

/// A command-line client for the Azure IoT Operations state store.
///
/// Values go to stdout as they are (followed by a newline); `-v` adds the
/// version and the response's properties; `--json` prints one JSON object
/// per answer. An `-ERR` answer goes to stderr with exit status 1; no
/// connection, or no answer within --timeout, exits with status 2.
#[derive(Parser, Debug)]
#[command(
    version,
    about,
    long_about,
    disable_help_flag = true,
    after_help = "Examples:
  statebroker-cli set greeting hello --px 60000
  statebroker-cli get greeting
  statebroker-cli -v get greeting          # value, version, properties
  statebroker-cli keys 'sensor*'           # every page of SCAN
  statebroker-cli watch door window        # one line per change, until Ctrl-C
  statebroker-cli -i worker-1 lock jobs --ttl 10000      # prints the fencing token
  statebroker-cli set job-7 done --fencing-token 000001763800000000:00000:worker-1
  statebroker-cli -i worker-1 lock jobs --release
  statebroker-cli raw SET k v NX PX 5000
  statebroker-cli -h broker.local -p 1883 -u alice -P secret get k
  statebroker-cli -h broker.local -p 8883 --cafile ca.pem -u alice -P secret get k
  statebroker-cli -p 8883 --cafile ca.pem --cert me.pem --key me.key keys
  statebroker-cli faults add --commands GET --keys 'slow*' --delay-ms 50..500
  statebroker-cli faults disconnect sensor-7 --reason-code 0x98
  statebroker-cli faults status"
)]
struct Cli {
    #[command(flatten)]
    connection: Connection,

    /// Print the version and the response's properties too.
    #[arg(short, long, global = true)]
    verbose: bool,

    /// One JSON object per answer (for scripts).
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

/// How to connect (as mosquitto's clients spell it).
#[derive(Args, Debug)]
struct Connection {
    /// Broker host.
    #[arg(short = 'h', long, default_value = "localhost", global = true)]
    host: String,

    /// Broker port.
    #[arg(short, long, default_value_t = 1883, global = true)]
    port: u16,

    /// Username.
    #[arg(short, long, global = true)]
    username: Option<String>,

    /// Password (see also --password-file).
    #[arg(short = 'P', long, global = true, conflicts_with = "password_file")]
    password: Option<String>,

    /// Read the password from the first line of FILE.
    #[arg(long, value_name = "FILE", global = true)]
    password_file: Option<PathBuf>,

    /// MQTT client id (the caller the store sees; lock holders use it).
    /// Default: statebroker-cli-<random>.
    #[arg(short = 'i', long, global = true)]
    id: Option<String>,

    /// Seconds to wait for the connection and for each answer.
    #[arg(long, default_value_t = 10.0, global = true)]
    timeout: f64,

    /// Connect over TLS (the broker's certificate checked against the
    /// system's roots, or --cafile). Usually with -p 8883.
    #[arg(long, global = true)]
    tls: bool,

    /// CA certificates (PEM) the broker's certificate must be signed by;
    /// implies --tls.
    #[arg(long, value_name = "FILE", global = true)]
    cafile: Option<PathBuf>,

    /// Client certificate (PEM), for a broker that asks for one; with --key.
    #[arg(
        long = "cert",
        id = "tls_cert",
        value_name = "FILE",
        global = true,
        requires = "tls_key"
    )]
    cert: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(
        long = "key",
        id = "tls_key",
        value_name = "FILE",
        global = true,
        requires = "tls_cert"
    )]
    key: Option<PathBuf>,

    /// Print help.
    #[arg(long, action = clap::ArgAction::Help, global = true)]
    help: Option<bool>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// GET KEY: print its value (nothing, and exit status 0, when missing;
    /// `-v` says `(nil)`).
    Get { key: String },
    /// SET KEY VALUE: store a value (VALUE `-`: read from stdin; or
    /// --file FILE; --hex: VALUE is hexadecimal, for bytes that are not
    /// text).
    Set {
        key: String,
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        value: Option<String>,
        #[command(flatten)]
        input: ValueInput,
        /// Expire after MS milliseconds (at least 1).
        #[arg(long, value_name = "MS", value_parser = milliseconds)]
        px: Option<u64>,
        /// Only if the key does not exist.
        #[arg(long, conflicts_with = "nex")]
        nx: bool,
        /// Only if the key does not exist or holds this same value.
        #[arg(long)]
        nex: bool,
        /// Keep the key on disk across restarts (aio-persistence).
        #[arg(long)]
        persist: bool,
        /// A fencing token (an HLC, as `lock` prints it).
        #[arg(long, value_name = "HLC")]
        fencing_token: Option<String>,
    },
    /// DEL KEY: prints 1 (deleted) or 0 (missing).
    Del {
        key: String,
        /// A fencing token, for a key protected by one.
        #[arg(long, value_name = "HLC")]
        fencing_token: Option<String>,
    },
    /// VDEL KEY VALUE: delete only if it holds VALUE; prints 1, 0 (missing)
    /// or -1 (another value).
    Vdel {
        key: String,
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        value: Option<String>,
        #[command(flatten)]
        input: ValueInput,
        /// A fencing token, for a key protected by one.
        #[arg(long, value_name = "HLC")]
        fencing_token: Option<String>,
    },
    /// The keys matching PATTERN (a glob: * ? [set] [a-z] [!set]), every
    /// SCAN page, one per line.
    Keys {
        #[arg(default_value = "*")]
        pattern: String,
    },
    /// Watch keys (KEYNOTIFY): one line per change (operation, key, value,
    /// version) until Ctrl-C or the connection ends.
    Watch {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Acquire a lease lock named NAME for --ttl milliseconds (or renew
    /// it, for the same client id) and print its fencing token; exit
    /// status 1 if another client holds it.
    Lock {
        name: String,
        /// Lease length in milliseconds.
        #[arg(long, value_name = "MS", required_unless_present = "release")]
        ttl: Option<u64>,
        /// Release the lock instead (only the holder's client id can).
        #[arg(long)]
        release: bool,
    },
    /// Send any command as it is: raw GET k, raw SET k v NX PX 100, …
    Raw {
        #[arg(required = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish,
    /// powershell): `statebroker-cli completions bash >
    /// /etc/bash_completion.d/statebroker-cli`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff): `statebroker-cli man | man -l -`.
    Man,
    /// statebroker only: faults on demand through its HTTP endpoint
    /// (--http ADDR; the broker needs `[faults] enabled = true`).
    Faults(faults::Faults),
}

/// `--px`: a positive number of milliseconds (the store refuses 0 with a
/// bare "syntax error").
fn milliseconds(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("an expiry of 0 ms is not allowed: give at least 1 (milliseconds), or leave --px out for a key that does not expire".into()),
        Ok(ms) => Ok(ms),
        Err(_) => Err(format!("`{text}` is not a number of milliseconds")),
    }
}

/// Where a value comes from, besides the command line.
#[derive(Args, Debug)]
struct ValueInput {
    /// The value is hexadecimal (`--hex 00ff10`), for bytes that are not
    /// text.
    #[arg(long)]
    hex: bool,
    /// Read the value from FILE (as it is, bytes included).
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
}

impl ValueInput {
    /// The value's bytes: from `--file`, stdin (`-`), hexadecimal
    /// (`--hex`), or the argument as it is.
    fn read(&self, value: Option<&str>) -> Result<Vec<u8>, String> {
        let raw = match (&self.file, value) {
            (Some(file), _) => {
                std::fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?
            }
            (None, Some("-")) => {
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
                    .map_err(|e| format!("cannot read the value from stdin: {e}"))?;
                bytes
            }
            (None, Some(value)) => value.as_bytes().to_vec(),
            (None, None) => return Err("a value is needed (VALUE, - for stdin, or --file)".into()),
        };
        if !self.hex {
            return Ok(raw);
        }
        let text = String::from_utf8_lossy(&raw);
        let digits: String = text.split_whitespace().collect();
        hex::decode(&digits).map_err(|e| format!("--hex: the value is not hexadecimal ({e})"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.command {
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut command, "statebroker-cli", &mut script);
            // A closed pipe (`| head`) is not worth a message.
            let _ = std::io::stdout().write_all(&script);
            return ExitCode::SUCCESS;
        }
        Command::Man => {
            let command = <Cli as clap::CommandFactory>::command();
            let mut page = Vec::new();
            if let Err(e) = clap_mangen::Man::new(command).render(&mut page) {
                eprintln!("statebroker-cli: {e}");
                return ExitCode::FAILURE;
            }
            let _ = std::io::stdout().write_all(&page);
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("statebroker-cli: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("statebroker-cli: {failure}");
            ExitCode::from(EXIT_NO_ANSWER)
        }
    }
}

fn target(c: &Connection) -> Result<Target, Failure> {
    let password = match (&c.password, &c.password_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| Failure::Connection(format!("cannot read {}: {e}", file.display())))?;
            Some(text.lines().next().unwrap_or_default().to_owned())
        }
        (None, None) => None,
    };
    let login = match (&c.username, password) {
        (Some(u), p) => Some((u.clone(), p.unwrap_or_default())),
        (None, Some(_)) => {
            return Err(Failure::Connection(
                "a password needs a username (-u)".into(),
            ));
        }
        (None, None) => None,
    };
    if !(c.timeout > 0.0 && c.timeout.is_finite()) {
        return Err(Failure::Connection(
            "--timeout must be a positive number of seconds".into(),
        ));
    }
    Ok(Target {
        host: c.host.clone(),
        port: c.port,
        client_id: c
            .id
            .clone()
            .unwrap_or_else(|| format!("statebroker-cli-{:08x}", fastrand::u32(..))),
        login,
        timeout: Duration::from_secs_f64(c.timeout),
        tls: (c.tls || c.cafile.is_some() || c.cert.is_some()).then(|| tls::TlsOptions {
            ca: c.cafile.clone(),
            cert: c.cert.clone(),
            key: c.key.clone(),
        }),
    })
}

async fn run(cli: Cli) -> Result<u8, Failure> {
    let target = target(&cli.connection)?;
    if let Command::Faults(faults) = cli.command {
        let (login, timeout) = (target.login, target.timeout);
        return tokio::task::spawn_blocking(move || faults::run(faults, login, timeout))
            .await
            .map_err(|e| Failure::Connection(e.to_string()));
    }
    // A value to send is read before connecting (a usage error then
    // costs no connection).
    let input_value = match &cli.command {
        Command::Set { value, input, .. } | Command::Vdel { value, input, .. } => {
            Some(input.read(value.as_deref()).map_err(Failure::Connection)?)
        }
        _ => None,
    };
    let mut client = Client::connect(&target).await?;
    let format = if cli.json {
        Format::Json
    } else if cli.verbose {
        Format::Verbose
    } else {
        Format::Plain
    };
    let mut out = Printer::new(format);
    let code = match cli.command {
        Command::Get { key } => {
            let answer = client.request(&[b"GET", key.as_bytes()], &[]).await?;
            out.value(&answer)
        }
        Command::Set {
            key,
            value: _,
            input: _,
            px,
            nx,
            nex,
            persist,
            fencing_token,
        } => {
            let value = input_value.unwrap_or_default();
            let px = px.map(|ms| ms.to_string());
            let mut args: Vec<&[u8]> = vec![b"SET", key.as_bytes(), &value];
            if nx {
                args.push(b"NX");
            }
            if nex {
                args.push(b"NEX");
            }
            if let Some(px) = &px {
                args.extend([&b"PX"[..], px.as_bytes()]);
            }
            let mut extra = fencing(fencing_token);
            if persist {
                extra.push(("aio-persistence", "true".to_owned()));
            }
            let answer = client.request(&args, &extra).await?;
            out.reply(&answer)
        }
        Command::Del { key, fencing_token } => {
            let answer = client
                .request(&[b"DEL", key.as_bytes()], &fencing(fencing_token))
                .await?;
            out.reply(&answer)
        }
        Command::Vdel {
            key,
            value: _,
            input: _,
            fencing_token,
        } => {
            let value = input_value.unwrap_or_default();
            let answer = client
                .request(&[b"VDEL", key.as_bytes(), &value], &fencing(fencing_token))
                .await?;
            out.reply(&answer)
        }
        Command::Keys { pattern } => keys(&mut client, &mut out, &pattern).await?,
        Command::Watch { keys } => watch(&mut client, &mut out, &keys).await?,
        Command::Lock { name, ttl, release } => {
            lock(&mut client, &mut out, &name, ttl, release).await?
        }
        Command::Raw { args } => {
            let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
            let answer = client.request(&args, &[]).await?;
            out.reply(&answer)
        }
        Command::Faults(_) | Command::Completions { .. } | Command::Man => {
            unreachable!("answered before connecting")
        }
    };
    let _ = std::io::stdout().flush();
    client.disconnect().await;
    Ok(code)
}

fn fencing(token: Option<String>) -> Vec<(&'static str, String)> {
    token.map(|t| vec![("__ft", t)]).unwrap_or_default()
}

/// Every SCAN page.
async fn keys(client: &mut Client, out: &mut Printer, pattern: &str) -> Result<u8, Failure> {
    use statestore::resp3::Reply;
    let mut token: Option<Vec<u8>> = None;
    loop {
        let mut args: Vec<&[u8]> = vec![b"SCAN", pattern.as_bytes()];
        if let Some(t) = &token {
            args.push(t);
        }
        let answer = client.request(&args, &[]).await?;
        let (keys, next) = match &answer.reply {
            Reply::Array(parts) => match parts.as_slice() {
                [Reply::Array(keys)] => (keys, None),
                [Reply::Array(keys), Reply::Bulk(next)] => (keys, Some(next.clone())),
                _ => return Err(Failure::Protocol(format!("{:?}", answer.reply))),
            },
            Reply::Error(_) => return Ok(out.reply(&answer)),
            other => return Err(Failure::Protocol(format!("{other:?}"))),
        };
        for key in keys {
            if let Reply::Bulk(key) = key {
                out.key(key);
            }
        }
        match next {
            Some(next) => token = Some(next),
            None => return Ok(0),
        }
    }
}

/// KEYNOTIFY each key, then print changes until Ctrl-C.
async fn watch(client: &mut Client, out: &mut Printer, keys: &[String]) -> Result<u8, Failure> {
    let Some(mut notifications) = client.notifications() else {
        return Ok(0);
    };
    for key in keys {
        let answer = client.request(&[b"KEYNOTIFY", key.as_bytes()], &[]).await?;
        if let statestore::resp3::Reply::Error(_) = answer.reply {
            return Ok(out.reply(&answer));
        }
    }
    out.note(&format!("watching {} key(s); Ctrl-C to stop", keys.len()));
    loop {
        tokio::select! {
            Some(n) = notifications.recv() => out.notification(&n),
            why = client.lost() => {
                eprintln!("statebroker-cli: {why}");
                return Ok(EXIT_NO_ANSWER);
            }
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
}

/// Acquire (or renew) with `SET NAME <client id> NEX PX ttl`; release with
/// `VDEL NAME <client id>`.
async fn lock(
    client: &mut Client,
    out: &mut Printer,
    name: &str,
    ttl: Option<u64>,
    release: bool,
) -> Result<u8, Failure> {
    use statestore::resp3::Reply;
    let holder = client.client_id().to_owned();
    if release {
        let answer = client
            .request(&[b"VDEL", name.as_bytes(), holder.as_bytes()], &[])
            .await?;
        return Ok(match answer.reply {
            Reply::Integer(1) => out.reply(&answer),
            Reply::Integer(0) => {
                eprintln!("statebroker-cli: lock {name} is not held");
                out.reply(&answer);
                EXIT_ERR
            }
            Reply::Integer(_) => {
                eprintln!("statebroker-cli: lock {name} is held by another client, not {holder}");
                EXIT_ERR
            }
            _ => out.reply(&answer),
        });
    }
    let ttl = ttl.unwrap_or_default().max(1).to_string();
    let answer = client
        .request(
            &[
                b"SET",
                name.as_bytes(),
                holder.as_bytes(),
                b"NEX",
                b"PX",
                ttl.as_bytes(),
            ],
            &[],
        )
        .await?;
    Ok(match answer.reply {
        Reply::Simple(_) => {
            out.token(&answer, &holder);
            0
        }
        Reply::Integer(_) => {
            // The holder's client id is the lock's value (the store tells
            // no expiry: the lease ends at most --ttl after its last
            // renewal).
            let held = client.request(&[b"GET", name.as_bytes()], &[]).await?;
            match held.reply {
                Reply::Bulk(holder) => eprintln!(
                    "statebroker-cli: lock {name} is held by {} (version {})",
                    String::from_utf8_lossy(&holder),
                    held.version.as_deref().unwrap_or("?")
                ),
                _ => eprintln!(
                    "statebroker-cli: lock {name} was held by another client; it is free now: try again"
                ),
            }
            EXIT_ERR
        }
        _ => out.reply(&answer),
    })
}
