//! What etcd members and nodes share: loopback ports, a child process that
//! can be killed, paused and resumed, log files, the keep-the-files switch.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// Set to `1` (any value but `0` or empty) to keep the temp dirs (data and
/// logs) after the harness is dropped; their paths are printed to stderr.
pub const KEEP_ENV: &str = "STATEBROKER_HARNESS_KEEP";

/// Whether [`KEEP_ENV`] asks to keep the temp dirs.
pub fn keep_files() -> bool {
    std::env::var_os(KEEP_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// A free TCP port on 127.0.0.1: binds port 0, reads the port the kernel
/// chose, and releases it.
///
/// The port is free when this returns, not necessarily when the caller
/// binds it: anything on the machine may take it in between (an outgoing
/// connection's ephemeral port, another test binary). Within this process
/// no port is handed out twice, so parallel tests in one test binary never
/// collide; [`crate::EtcdCluster::start`] retries on a clash with other
/// processes, other callers should too, or bind port 0 themselves.
///
/// # Panics
///
/// If no socket can be bound on 127.0.0.1 at all.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut port = 0;
    // Past ~1000 tries the process has used most of the ephemeral range;
    // hand out a repeat rather than spin.
    for _ in 0..1000 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("cannot bind a socket on 127.0.0.1: {e}"));
        port = listener
            .local_addr()
            .expect("a bound socket has an address")
            .port();
        if handed_out.insert(port) {
            break;
        }
    }
    port
}

/// Waits until something accepts TCP connections on `127.0.0.1:port`.
pub fn wait_tcp(port: u16, timeout: Duration) -> io::Result<()> {
    wait_tcp_while(port, timeout, || Ok(()))
}

/// [`wait_tcp`], giving up early when `alive` returns an error (the process
/// that should listen has exited).
pub(crate) fn wait_tcp_while(
    port: u16,
    timeout: Duration,
    mut alive: impl FnMut() -> io::Result<()>,
) -> io::Result<()> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_millis(500)),
        ) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "nothing accepts connections on {addr} after {timeout:?} (last error: {e})"
                    ),
                ));
            }
            Err(_) => {}
        }
        alive()?;
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The last `lines` lines of a log file (at most its last 256 KiB), or a
/// note saying why there are none.
pub fn tail_file(path: &Path, lines: usize) -> String {
    const MAX: u64 = 256 * 1024;
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(MAX)))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(no log at {}: {e})", path.display()),
    }
}

/// Finds `program` on `PATH`.
pub(crate) fn find_on_path(program: &str, hint: &str) -> io::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(program);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("`{program}` is not on PATH: {hint}"),
    ))
}

/// Seconds since the Unix epoch, for log markers.
fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Whether a process is running, stopped by SIGSTOP, or gone (killed by the
/// harness or exited by itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcState {
    Running,
    Paused,
    Down,
}

/// A child process whose stdout and stderr go to a log file; killed on drop.
#[derive(Debug, Default)]
pub(crate) struct Proc {
    child: Option<Child>,
    paused: bool,
    /// How many times it was started.
    pub(crate) starts: u32,
}

impl Proc {
    /// Starts `cmd` with stdin from /dev/null and stdout and stderr appended
    /// to `log` (after a marker line). Kills the running one first.
    pub(crate) fn spawn(&mut self, mut cmd: Command, log: &Path) -> io::Result<()> {
        self.kill()?;
        let mut file = OpenOptions::new().create(true).append(true).open(log)?;
        self.starts += 1;
        writeln!(
            file,
            "=== statebroker-cluster-harness: start #{} at {:.3} (unix): {:?}",
            self.starts,
            unix_time(),
            cmd
        )?;
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start {:?}: {e}", cmd.get_program()),
            )
        })?;
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Running, paused or down; reaps the child if it exited by itself.
    pub(crate) fn state(&mut self) -> ProcState {
        match self.exit_status() {
            Some(_) => ProcState::Down,
            None if self.child.is_none() => ProcState::Down,
            None if self.paused => ProcState::Paused,
            None => ProcState::Running,
        }
    }

    /// The exit status if the child has exited (it is then reaped; the
    /// status stays available until the next spawn or kill).
    pub(crate) fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGKILL and wait for it (works on a paused process too). A no-op if
    /// there is none; returns the exit status of the one killed.
    pub(crate) fn kill(&mut self) -> io::Result<Option<ExitStatus>> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        self.paused = false;
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        child.kill()?;
        child.wait().map(Some)
    }

    /// SIGTERM, then SIGKILL if it has not exited after `grace`.
    /// SIGTERM (after SIGCONT if paused), not waiting.
    pub(crate) fn term(&mut self) -> io::Result<()> {
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        if self.paused {
            signal(child.id(), libc::SIGCONT)?;
            self.paused = false;
        }
        signal(child.id(), libc::SIGTERM)
    }

    pub(crate) fn terminate(&mut self, grace: Duration) -> io::Result<Option<ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        if let Some(status) = child.try_wait()? {
            self.child = None;
            return Ok(Some(status));
        }
        if self.paused {
            signal(child.id(), libc::SIGCONT)?;
            self.paused = false;
        }
        signal(child.id(), libc::SIGTERM)?;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(Some(status));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill()
    }

    /// SIGSTOP, then wait (up to 2 s) until the kernel shows it stopped:
    /// a thread in uninterruptible sleep (an fsync) stops only after it.
    pub(crate) fn pause(&mut self, what: &str) -> io::Result<()> {
        let pid = self.live_pid(what)?;
        signal(pid, libc::SIGSTOP)?;
        self.paused = true;
        wait_stopped(pid, true);
        Ok(())
    }

    /// SIGCONT, then wait (up to 2 s) until it is no longer shown stopped.
    pub(crate) fn resume(&mut self, what: &str) -> io::Result<()> {
        let pid = self.live_pid(what)?;
        signal(pid, libc::SIGCONT)?;
        self.paused = false;
        wait_stopped(pid, false);
        Ok(())
    }

    fn live_pid(&mut self, what: &str) -> io::Result<u32> {
        match (self.exit_status(), self.pid()) {
            (None, Some(pid)) => Ok(pid),
            (Some(status), _) => Err(io::Error::other(format!("{what} is not running: {status}"))),
            (None, None) => Err(io::Error::other(format!("{what} is not running (killed)"))),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Polls /proc/PID/stat until the process is (or is no longer) stopped, for
/// at most 2 s; gives up quietly where there is no /proc.
fn wait_stopped(pid: u32, stopped: bool) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return;
        };
        // The state letter follows the parenthesised command name.
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].trim_start().chars().next());
        if matches!(state, Some('T' | 't')) == stopped {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Sends `sig` to `pid`.
pub(crate) fn signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(io::Error::other)?;
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Removes `dir` on drop unless [`keep_files`]; then, or when the thread is
/// panicking, says where the files are.
pub(crate) fn finish_dir(dir: tempfile::TempDir, what: &str) {
    if keep_files() {
        let path = dir.keep();
        eprintln!(
            "statebroker-cluster-harness: kept {what} files in {}",
            path.display()
        );
    } else if std::thread::panicking() {
        eprintln!(
            "statebroker-cluster-harness: removing {what} files in {} (set {KEEP_ENV}=1 to keep them)",
            dir.path().display()
        );
    }
}
