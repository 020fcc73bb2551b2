//! `statebroker passwd FILE USER`: adds or changes a user in a password
//! file (mosquitto's format, see `broker::passwords`), or removes one.

use std::io::{BufRead, IsTerminal};
use std::path::Path;

/// Runs the subcommand; returns what it did, for the terminal.
pub fn run(file: &Path, user: &str, password_stdin: bool, delete: bool) -> Result<String, String> {
    let existing = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !delete => String::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    broker::passwords::Passwords::parse(&existing)
        .map_err(|e| format!("{} is not a password file: {e}", file.display()))?;
    let (text, what) = if delete {
        let kept: Vec<&str> = existing
            .lines()
            .filter(|l| l.split_once(':').is_none_or(|(u, _)| u != user) || l.starts_with('#'))
            .collect();
        if kept.len() == existing.lines().count() {
            return Err(format!("no user {user} in {}", file.display()));
        }
        (
            kept.join("\n") + "\n",
            format!("removed {user} from {}", file.display()),
        )
    } else {
        let password = read_password(password_stdin)?;
        let text = broker::passwords::set_user(&existing, user, password.as_bytes())?;
        (
            text,
            format!(
                "{user} set in {} (SIGHUP the broker to apply)",
                file.display()
            ),
        )
    };
    write_private(file, &text)?;
    Ok(what)
}

fn read_password(from_stdin: bool) -> Result<String, String> {
    let password = if from_stdin || !std::io::stdin().is_terminal() {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .map_err(|e| format!("cannot read the password: {e}"))?;
        line.trim_end_matches(['\n', '\r']).to_owned()
    } else {
        let first = rpassword::prompt_password("Password: ").map_err(|e| e.to_string())?;
        let again = rpassword::prompt_password("Password again: ").map_err(|e| e.to_string())?;
        if first != again {
            return Err("the passwords differ".to_owned());
        }
        first
    };
    if password.is_empty() {
        return Err("an empty password".to_owned());
    }
    Ok(password)
}

/// Writes through a temporary file and a rename (never half a file), with
/// permissions 0600 on Unix.
fn write_private(file: &Path, text: &str) -> Result<(), String> {
    let tmp = file.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let result = options.open(&tmp).and_then(|mut f| {
        std::io::Write::write_all(&mut f, text.as_bytes())?;
        f.sync_all()
    });
    result
        .and_then(|()| std::fs::rename(&tmp, file))
        .map_err(|e| format!("cannot write {}: {e}", file.display()))
}
