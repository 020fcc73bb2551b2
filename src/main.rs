//! `statebroker`: an MQTT 5 / 3.1.1 broker with the Azure IoT Operations
//! state store inside.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use broker::config::{Mode, PersistenceSettings};
use broker::{Broker, RunningBroker, Settings};
use clap::Parser;

mod health;
mod logging;
mod passwd;

/// mimalloc instead of glibc's malloc: a state store request allocates and
/// frees a few dozen small blocks (packets, properties, answers), and
/// glibc's allocator took 18% of the broker's instructions at 64 busy
/// connections.
#[global_allocator]
static ALLOCATOR: Allocator = Allocator;

/// [`mimalloc::MiMalloc`], but a block that needs no more alignment than
/// `malloc` gives (as std's own `System` decides) comes from `mi_malloc`:
/// `MiMalloc` asks `mi_malloc_aligned` for every block, ~20 instructions
/// more each, three blocks a state store request.
struct Allocator;

/// What `mi_malloc` aligns every block of at least this size to
/// (`MI_MAX_ALIGN_SIZE` on the 64-bit targets).
const MALLOC_ALIGN: usize = 16;

// SAFETY: every method hands on to mimalloc, which meets `GlobalAlloc`'s
// contract; `mi_malloc`/`mi_zalloc`/`mi_realloc` only where `layout` asks
// for no more alignment than they give.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
            // SAFETY: see the impl.
            unsafe { libmimalloc_sys::mi_malloc(layout.size()).cast() }
        } else {
            // SAFETY: the caller's contract, handed on.
            unsafe { mimalloc::MiMalloc.alloc(layout) }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
            // SAFETY: see the impl.
            unsafe { libmimalloc_sys::mi_zalloc(layout.size()).cast() }
        } else {
            // SAFETY: the caller's contract, handed on.
            unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract, handed on (`mi_free` frees
        // either kind of block).
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN && layout.align() <= new_size {
            // SAFETY: see the impl.
            unsafe { libmimalloc_sys::mi_realloc(ptr.cast(), new_size).cast() }
        } else {
            // SAFETY: the caller's contract, handed on.
            unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
        }
    }
}

use logging::{Format, Logging};

/// An MQTT 5 and 3.1.1 broker (rumqttd's router) with the Azure IoT
/// Operations state store built in: key/value requests over MQTT with RESP3
/// payloads, HLC versions, fencing tokens, expiry, KEYNOTIFY and SCAN.
///
/// Without arguments it listens on loopback only (127.0.0.1:1883 and
/// [::1]:1883, as mosquitto 2 does) with the embedded default configuration
/// (the repository's rumqttd.toml; see --print-default-config); to accept
/// other hosts: --listen 0.0.0.0:1883, with users in a password file
/// (`statebroker passwd FILE USER`, `[broker] password_file`) or
/// --allow-anonymous.
/// Log filter: `[log] level` (default "info"), or RUST_LOG, e.g.
/// RUST_LOG=debug or RUST_LOG=broker=debug; the router's per-packet lines
/// and the storage engine's notes stay at WARN unless named
/// (RUST_LOG=debug,router=debug,fjall=info,lsm_tree=info).
///
/// Signals: SIGTERM or Ctrl-C stop it cleanly; SIGHUP re-reads the
/// configuration file and applies what can change while running (the log
/// filter, the password file, the authorization policy, TLS certificates),
/// naming in ERROR lines what needs a restart; a file with any error (a
/// missing password file, a broken policy, an unreadable certificate) is
/// refused as a whole.
#[derive(Parser, Debug)]
#[command(version, about, long_about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Configuration file in rumqttd.toml format, layered over the defaults.
    /// Environment variables STATEBROKER__<SECTION>__<KEY> override it.
    #[arg(short, long, value_name = "FILE", env = "STATEBROKER_CONFIG")]
    config: Option<PathBuf>,

    /// Listen on HOST:PORT instead of the configured listeners (a host
    /// name listens on each of its addresses). May be given more than once.
    #[arg(short, long, value_name = "HOST:PORT")]
    listen: Vec<String>,

    /// Keep persisted keys, retained messages and persistent sessions in
    /// this directory (default: `statebroker-data` next to the config file,
    /// or in the working directory).
    #[arg(short, long, value_name = "DIR", conflicts_with = "in_memory")]
    data_dir: Option<PathBuf>,

    /// Keep everything in memory only (no data directory), whatever the
    /// configuration says.
    #[arg(long)]
    in_memory: bool,

    /// Start even though the data directory has lost data: its journal
    /// (*.jnl) was deleted, or holds less than the last clean shutdown
    /// left. Without it such a start is refused, naming what is missing;
    /// with it the broker goes on with what the storage engine can still
    /// read and logs what was accepted. For one start: the next one checks
    /// again.
    #[arg(long, conflicts_with = "in_memory")]
    accept_data_loss: bool,

    /// Serve /metrics, /healthz, /readyz and the web view on this address
    /// instead of the configured `[http] listen` (default 127.0.0.1:9883).
    /// The web view answers only for localhost and IP addresses; to open
    /// it under a DNS name, list the name in `[http] allowed_hosts` (or
    /// STATEBROKER__HTTP__ALLOWED_HOSTS=broker.example,other.example).
    #[arg(long, value_name = "ADDR", conflicts_with = "no_http")]
    http: Option<SocketAddr>,

    /// No HTTP endpoint (no metrics, no health checks).
    #[arg(long)]
    no_http: bool,

    /// Log lines as text or as one JSON object per line (default: the
    /// configuration's `[log] format`, "text").
    #[arg(long, value_name = "FORMAT")]
    log_format: Option<Format>,

    /// Let clients without username or certificate connect on every
    /// listener (by default only loopback listeners let them in).
    #[arg(long)]
    allow_anonymous: bool,

    /// Join a cluster as node ID: several nodes sharing one state store in
    /// etcd (with --etcd-endpoints; sets `[clustering] node_id`, also the
    /// node id of the versions this node hands out). Needs a binary built
    /// with `--features cluster`.
    #[arg(long, value_name = "ID")]
    cluster_node_id: Option<String>,

    /// etcd's client URLs, comma-separated (sets `[clustering]
    /// etcd_endpoints`), e.g. http://10.0.0.1:2379,http://10.0.0.2:2379.
    #[arg(long, value_name = "URL,URL,...")]
    etcd_endpoints: Option<String>,

    /// Print the embedded default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Add a user to a password file, or change their password (mosquitto's
    /// format: PBKDF2-SHA512, so mosquitto reads it too). Creates the file.
    #[command(after_help = PASSWD_EXAMPLES)]
    Passwd {
        /// The password file (`[broker] password_file`).
        file: std::path::PathBuf,
        /// The user name.
        user: String,
        /// Read the password from the first line of standard input instead
        /// of prompting.
        #[arg(long)]
        password_stdin: bool,
        /// Remove the user instead.
        #[arg(long, conflicts_with = "password_stdin")]
        delete: bool,
    },
    /// Exit 0 if the running broker is ready, 1 if not: for a container's
    /// HEALTHCHECK. The broker, started with STATEBROKER_HEALTH_FILE set,
    /// writes there where to ask once it has started (its HTTP endpoint's
    /// /readyz, or with --no-http its first MQTT listener), and removes it
    /// when it stops; this reads the same file, so the check follows the
    /// configured port, whatever set it.
    Healthcheck {
        /// The health file.
        #[arg(env = "STATEBROKER_HEALTH_FILE", value_name = "FILE")]
        file: PathBuf,
    },
}

/// `passwd --help`'s examples, one command a line.
const PASSWD_EXAMPLES: &str = "Examples:
  statebroker passwd /etc/statebroker/passwd alice
  echo \"$PASSWORD\" | statebroker passwd users alice --password-stdin
  statebroker passwd users alice --delete";

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Passwd {
        file,
        user,
        password_stdin,
        delete,
    }) = &cli.command
    {
        return match passwd::run(file, user, *password_stdin, *delete) {
            Ok(what) => {
                eprintln!("{what}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("statebroker passwd: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(Command::Healthcheck { file }) = &cli.command {
        return match health::check(file) {
            Ok(what) => {
                println!("ready: {what}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("not ready: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if cli.print_default_config {
        print!("{}", broker::config::DEFAULT_CONFIG);
        return ExitCode::SUCCESS;
    }
    let settings = match load(&cli) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("statebroker: {e}");
            return ExitCode::from(2);
        }
    };
    // The files it names (passwords, policy, certificates) are part of the
    // configuration: checked before anything starts or opens the data
    // directory, as a reload checks them.
    if let Err(errors) = broker::reload::read_named_files(&settings) {
        for e in errors {
            eprintln!("statebroker: {e}");
        }
        return ExitCode::from(2);
    }
    let format = cli
        .log_format
        .unwrap_or_else(|| Format::from_config(&settings.log.format));
    let logging = match Logging::init(format, &settings.log.level) {
        Ok(logging) => logging,
        Err(e) => {
            eprintln!("statebroker: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match runtime_builder().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run(cli, settings, logging));
    // `stopped` is logged once the storage engine is synced and closed:
    // nothing left needs an orderly end. Dropping the runtime would wait
    // for each task of its blocking pool still running (and each worker
    // to finish dropping its tasks); the process ends now instead.
    runtime.shutdown_background();
    code
}

/// The scheduler: one worker per core the process may use, and on a single
/// core tokio's current-thread scheduler instead of a multi-thread one with
/// one worker.
///
/// Why: a multi-thread worker keeps at most 256 ready tasks in its local
/// queue and moves the rest to a global queue that it visits only every
/// few dozen polls, while connections woken by the network keep refilling
/// the local queue. Pinned to one core with 1,024 busy connections, the
/// median request waited 4 ms and the slowest 1 % 173 ms. The current-thread
/// scheduler polls ready tasks in the order they woke: the same throughput,
/// p99 24.5 ms, close to the 19.7 ms every request must wait on average when
/// 1,024 requests share 52,000 answers a second.
fn runtime_builder() -> tokio::runtime::Builder {
    match std::thread::available_parallelism() {
        Ok(cores) if cores.get() == 1 => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
}

/// The configuration file with the command line's overrides.
fn load(cli: &Cli) -> Result<Settings, String> {
    let mut listen = Vec::new();
    for spec in &cli.listen {
        let addrs = spec
            .to_socket_addrs()
            .map_err(|e| format!("--listen {spec}: not a HOST:PORT that resolves ({e})"))?;
        for addr in addrs {
            if !listen.contains(&addr) {
                listen.push(addr);
            }
        }
    }
    // The clustering flags are the environment's overrides, given last.
    let mut flags = Vec::new();
    if let Some(id) = &cli.cluster_node_id {
        flags.push(("STATEBROKER__CLUSTERING__NODE_ID".to_owned(), id.clone()));
    }
    if let Some(endpoints) = &cli.etcd_endpoints {
        flags.push((
            "STATEBROKER__CLUSTERING__ETCD_ENDPOINTS".to_owned(),
            endpoints.clone(),
        ));
    }
    let env = std::env::vars().chain(flags);
    let mut settings =
        Settings::load_with_env(cli.config.as_deref(), &listen, env).map_err(|e| e.to_string())?;
    if cli.in_memory {
        settings.persistence = None;
    }
    if cli.allow_anonymous {
        for listener in &mut settings.listeners {
            listener.allow_anonymous = true;
        }
    }
    if cli.no_http {
        settings.http = None;
    } else if let Some(addr) = cli.http {
        settings.http = Some(addr);
    }
    if let Some(dir) = &cli.data_dir {
        let mode = settings
            .persistence
            .as_ref()
            .map_or(Mode::Fsync, |p| p.mode);
        settings.persistence = Some(PersistenceSettings {
            data_dir: dir.clone(),
            mode,
            accept_data_loss: false,
        });
    }
    if cli.accept_data_loss {
        match settings.persistence.as_mut() {
            Some(persistence) => persistence.accept_data_loss = true,
            None => {
                return Err("--accept-data-loss: there is no data directory (--in-memory, or [persistence] data_dir = \"\")".into());
            }
        }
    }
    Ok(settings)
}

async fn run(cli: Cli, settings: Settings, logging: Logging) -> ExitCode {
    let mut signals = match Signals::register() {
        Ok(signals) => signals,
        Err(e) => {
            tracing::error!("cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    let running = match Broker::start(settings.clone()).await {
        Ok(running) => running,
        Err(e) => {
            tracing::error!("cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let health_file = health::file_from_env();
    if let Some(path) = &health_file {
        let target = match running.http_addr() {
            Some(addr) => health::Target::Http(addr),
            None => health::Target::Mqtt(running.local_addr()),
        };
        health::announce(path, &target);
    }
    let mut router_stopped = running.router_stopped();
    let signal = loop {
        tokio::select! {
            signal = signals.next() => match signal {
                Signal::Reload => reload(&cli, &running, &logging),
                Signal::Stop(name) => break Some(name),
            },
            _ = router_stopped.wait_for(|stopped| *stopped) => break None,
        }
    };
    match signal {
        Some(signal) => tracing::info!(signal, "stopping"),
        None => tracing::error!(
            "the router stopped (a bug: see the panic above): nothing MQTT works without it; stopping with an error, for a supervisor to restart the broker"
        ),
    }
    if let Some(path) = &health_file {
        health::withdraw(path);
    }
    running.shutdown(Duration::from_secs(5)).await;
    tracing::info!("stopped");
    if signal.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// SIGHUP: re-reads the configuration and checks all it names as a start
/// would; then applies what a running broker can (the log level here; the
/// password file, the policy and the TLS files in the broker: see
/// `broker::reload`). A configuration with any error is refused as a whole:
/// nothing changes. Every changed setting only a restart applies is named
/// in an ERROR line. The last line says which of the three happened:
/// `configuration reloaded: ...` (all applied), `configuration applied in
/// part` (ERROR), `configuration refused` (ERROR), or `configuration
/// unchanged`.
fn reload(cli: &Cli, running: &RunningBroker, logging: &Logging) {
    let refused = |errors: &[String]| {
        for e in errors {
            tracing::error!("SIGHUP: {e}");
        }
        tracing::error!(
            "SIGHUP: configuration refused, nothing applied: the running configuration stays in force until the errors above are fixed and SIGHUP is sent again"
        );
    };
    let new = match load(cli) {
        Ok(new) => new,
        Err(e) => return refused(&[e]),
    };
    let mut errors = Vec::new();
    let level = logging.prepare(&new.log.level).map_err(|e| errors.push(e));
    let prepared = running.prepare_reload(&new).map_err(|e| errors.extend(e));
    let (Ok(level), Ok(prepared)) = (level, prepared) else {
        return refused(&errors);
    };
    let mut not_applied = prepared.needs_restart().to_vec();
    for setting in &not_applied {
        tracing::error!(
            setting,
            "SIGHUP: {setting} changed, but it cannot change while the broker runs: not applied, the running value stays until a restart"
        );
    }
    if matches!(level, logging::Level::Overridden) {
        tracing::error!(
            "SIGHUP: [log] level changed, but the RUST_LOG environment variable is set and wins over it: not applied (unset RUST_LOG and restart)"
        );
        not_applied.push("[log] level".to_owned());
    }
    let mut changed = prepared.apply();
    match logging.apply(level) {
        Ok(true) => changed.push("log.level".to_owned()),
        Ok(false) => {}
        Err(e) => {
            tracing::error!("SIGHUP: [log] level not applied: {e}");
            not_applied.push("[log] level".to_owned());
        }
    }
    let list = |names: &[String]| {
        if names.is_empty() {
            "nothing".to_owned()
        } else {
            names.join(", ")
        }
    };
    if !not_applied.is_empty() {
        tracing::error!(
            "SIGHUP: configuration applied in part: applied {}; not applied (named above): {}",
            list(&changed),
            list(&not_applied)
        );
    } else if changed.is_empty() {
        tracing::info!("SIGHUP: configuration unchanged: nothing to apply");
    } else {
        tracing::info!("SIGHUP: configuration reloaded: {}", list(&changed));
    }
}

enum Signal {
    Reload,
    Stop(&'static str),
}

/// The signals the broker handles, registered once (so none is missed
/// between two waits).
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn register() -> std::io::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                term: signal(SignalKind::terminate())?,
                hup: signal(SignalKind::hangup())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// Waits for Ctrl-C or SIGTERM (stop) or SIGHUP (reload).
    async fn next(&mut self) -> Signal {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => Signal::Stop("SIGINT"),
                _ = self.term.recv() => Signal::Stop("SIGTERM"),
                _ = self.hup.recv() => Signal::Reload,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            Signal::Stop("Ctrl-C")
        }
    }
}
