//! Any binary (a statebroker node, a client process) as a child process
//! that a test can kill, pause, resume and restart.

use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use crate::process::{self, Proc, ProcState, tail_file};

/// Replaced by the node's temp dir in every argument and environment value.
pub const DIR_PLACEHOLDER: &str = "{dir}";

/// What to start: a program, its arguments and environment.
///
/// `{dir}` in an argument or environment value becomes the node's own temp
/// dir, e.g. `.arg("--data-dir={dir}/data")`.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    current_dir: Option<PathBuf>,
    dir: Option<PathBuf>,
}

impl NodeSpec {
    /// Starts `program` (a path, e.g. `env!("CARGO_BIN_EXE_statebroker")`).
    /// The node is named after the program's file name until [`NodeSpec::name`].
    pub fn new(program: impl Into<PathBuf>) -> NodeSpec {
        let program = program.into();
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "node".into());
        NodeSpec {
            name,
            program,
            args: Vec::new(),
            env: Vec::new(),
            current_dir: None,
            dir: None,
        }
    }

    /// The name used in messages, in the nemesis report and in the temp
    /// dir's name (e.g. `n2`).
    pub fn name(mut self, name: impl Into<String>) -> NodeSpec {
        self.name = name.into();
        self
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> NodeSpec {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> NodeSpec
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable (the rest is inherited).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> NodeSpec {
        self.env
            .push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    /// Removes an inherited environment variable.
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> NodeSpec {
        self.env.push((key.as_ref().to_owned(), None));
        self
    }

    /// The working directory (default: the node's temp dir).
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> NodeSpec {
        self.current_dir = Some(dir.into());
        self
    }

    /// Use `dir` (created if missing, never removed) instead of a fresh
    /// temp dir: for a node that must find another's files, or to keep
    /// them.
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> NodeSpec {
        self.dir = Some(dir.into());
        self
    }

    /// Starts it: [`Node::start`].
    pub fn start(self) -> io::Result<Node> {
        Node::start(self)
    }
}

/// A running child process: stdout and stderr appended to `node.log` in its
/// temp dir (across restarts, each start after a marker line). Dropping it
/// kills the process and removes the temp dir (see
/// [`crate::KEEP_ENV`]).
#[derive(Debug)]
pub struct Node {
    spec: NodeSpec,
    path: PathBuf,
    log: PathBuf,
    proc: Proc,
    // Last, so the process is killed before the dir is removed.
    temp: Option<tempfile::TempDir>,
}

impl Node {
    /// Creates the node's dir and starts the program.
    pub fn start(spec: NodeSpec) -> io::Result<Node> {
        let (temp, path) = match &spec.dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                (None, dir.clone())
            }
            None => {
                let safe: String = spec
                    .name
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '-' {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
                let temp = tempfile::Builder::new()
                    .prefix(&format!("statebroker-{safe}-"))
                    .tempdir()?;
                let path = temp.path().to_owned();
                (Some(temp), path)
            }
        };
        let mut node = Node {
            log: path.join("node.log"),
            path,
            spec,
            proc: Proc::default(),
            temp,
        };
        node.spawn()?;
        Ok(node)
    }

    fn command(&self) -> Command {
        let dir = self.path.to_string_lossy();
        let fill = |s: &OsStr| -> OsString {
            match s.to_str() {
                Some(text) if text.contains(DIR_PLACEHOLDER) => {
                    text.replace(DIR_PLACEHOLDER, &dir).into()
                }
                _ => s.to_owned(),
            }
        };
        let mut cmd = Command::new(&self.spec.program);
        cmd.args(self.spec.args.iter().map(|a| fill(a)));
        for (key, value) in &self.spec.env {
            match value {
                Some(value) => cmd.env(key, fill(value)),
                None => cmd.env_remove(key),
            };
        }
        cmd.current_dir(self.spec.current_dir.as_deref().unwrap_or(&self.path));
        cmd
    }

    fn spawn(&mut self) -> io::Result<()> {
        let cmd = self.command();
        self.proc.spawn(cmd, &self.log)
    }

    /// The name from [`NodeSpec::name`].
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// What it was started with.
    pub fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    /// Its dir (the temp dir, or the one given to [`NodeSpec::dir`]).
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// The pid of the current process (None once killed).
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Running, paused or down (killed, or exited by itself).
    pub fn state(&mut self) -> ProcState {
        self.proc.state()
    }

    /// The exit status if the process has exited by itself.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.proc.exit_status()
    }

    /// How many times it was started (1 before any restart).
    pub fn starts(&self) -> u32 {
        self.proc.starts
    }

    /// SIGKILL and wait. A no-op if it is down.
    pub fn kill(&mut self) -> io::Result<()> {
        self.proc.kill().map(drop)
    }

    /// SIGTERM (after SIGCONT if paused); SIGKILL if it has not exited
    /// after `grace`. The exit status, None if it was already down.
    pub fn stop(&mut self, grace: Duration) -> io::Result<Option<ExitStatus>> {
        self.proc.terminate(grace)
    }

    /// SIGTERM, without waiting for the exit (see [`Node::stop`]).
    pub fn term(&mut self) -> io::Result<()> {
        self.proc.term()
    }

    /// SIGSTOP.
    pub fn pause(&mut self) -> io::Result<()> {
        let what = format!("node {}", self.spec.name);
        self.proc.pause(&what)
    }

    /// SIGCONT.
    pub fn resume(&mut self) -> io::Result<()> {
        let what = format!("node {}", self.spec.name);
        self.proc.resume(&what)
    }

    /// Starts it again with the same program, arguments, environment and
    /// dir, killing it first if it runs. Does not wait for it to listen.
    pub fn restart(&mut self) -> io::Result<()> {
        self.spawn()
    }

    /// Waits until something accepts connections on `127.0.0.1:port`;
    /// fails early, with the log tail, if this process exits meanwhile.
    pub fn wait_tcp(&mut self, port: u16, timeout: Duration) -> io::Result<()> {
        let name = self.spec.name.clone();
        let log = self.log.clone();
        let proc = &mut self.proc;
        process::wait_tcp_while(port, timeout, || match proc.state() {
            ProcState::Down => Err(io::Error::other(format!(
                "node {name} is down ({}) while waiting for port {port}; log {}:\n{}",
                proc.exit_status()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| "killed".into()),
                log.display(),
                tail_file(&log, 30)
            ))),
            _ => Ok(()),
        })
        .map_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                io::Error::new(
                    e.kind(),
                    format!(
                        "node {name}: {e}; log {}:\n{}",
                        log.display(),
                        tail_file(&log, 30)
                    ),
                )
            } else {
                e
            }
        })
    }

    /// Path of its log (stdout and stderr).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail_file(&self.log, lines)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- node {} log ({}), last lines:\n{}",
                self.spec.name,
                self.log.display(),
                tail_file(&self.log, 20)
            );
        }
        if let Some(dir) = self.temp.take() {
            process::finish_dir(dir, &format!("node {}", self.spec.name));
        }
    }
}
