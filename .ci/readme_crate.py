"""Writes a user's crate from README.md: the first ```toml block (its
dev-dependencies) and the first ```rust block (its test) of the section
"Testing your client against statebroker", with statebroker taken from this
repository by git (file:// URL of its committed HEAD) or by path.

usage: readme_crate.py README.md CRATE_DIR git|path REPO
"""
import pathlib
import re
import sys

readme, crate, how, repo = sys.argv[1:5]
text = pathlib.Path(readme).read_text()
section = re.search(r"^## Testing your client against statebroker\n(.*?)(?=^## )", text, re.S | re.M)
if not section:
    sys.exit("README.md has no section 'Testing your client against statebroker'")
body = section.group(1)
toml = re.search(r"```toml\n(.*?)```", body, re.S)
rust = re.search(r"```rust\n(.*?)```", body, re.S)
if not toml or not rust:
    sys.exit("the section needs a ```toml block (dev-dependencies) and a ```rust block (a test)")
deps = toml.group(1)
source = f'git = "file://{repo}"' if how == "git" else f'path = "{repo}"'
deps, n = re.subn(r"^statebroker = \{ (git|path) = \"[^\"]*\"", f"statebroker = {{ {source}", deps, flags=re.M)
if n != 1:
    sys.exit("the dev-dependencies must name statebroker as `statebroker = { git = \"...\", ... }`")
root = pathlib.Path(crate)
(root / "src").mkdir(parents=True, exist_ok=True)
(root / "tests").mkdir(exist_ok=True)
(root / "Cargo.toml").write_text(
    '[package]\nname = "my-client"\nversion = "0.1.0"\nedition = "2024"\n\n[workspace]\n\n' + deps
)
(root / "src" / "lib.rs").write_text("//! A state store client (the test is in tests/).\n")
(root / "tests" / "against_statebroker.rs").write_text(rust.group(1))
