//! The code's layers stay true: in every crate of the workspace, the
//! top-level modules import each other without a circle (data flows one
//! way; see docs/architecture.md).
//!
//! A module's imports are the `crate::<module>` paths in its files
//! (comments and `#[cfg(test)] mod tests` left out). A circle fails the
//! test with the modules on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The `.rs` files under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src` belongs to (`lib` for lib.rs).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a file");
    let name = first.as_os_str().to_string_lossy();
    name.strip_suffix(".rs").unwrap_or(&name).to_owned()
}

/// The modules `code` names as `crate::<module>`, comments and test
/// modules left out.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut in_tests = false;
    let mut lines = code.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            // Test modules end the file in this code base.
            in_tests = true;
        }
        if in_tests || trimmed.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// The circles (strongly connected components of more than one module).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Kosaraju: order by finish time, then walk the reversed graph.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
    ) {
        if !seen.insert(node.to_owned()) {
            return;
        }
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, seen, order);
        }
        order.push(node.to_owned());
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for node in graph.keys() {
        visit(node, graph, &mut seen, &mut order);
    }
    let mut reversed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, tos) in graph {
        for to in tos {
            reversed.entry(to.clone()).or_default().insert(from.clone());
        }
    }
    let mut assigned = BTreeSet::new();
    let mut found = Vec::new();
    for node in order.iter().rev() {
        if assigned.contains(node) {
            continue;
        }
        let mut component = Vec::new();
        let mut stack = vec![node.clone()];
        while let Some(n) = stack.pop() {
            if !assigned.insert(n.clone()) {
                continue;
            }
            component.push(n.clone());
            for prev in reversed.get(&n).into_iter().flatten() {
                stack.push(prev.clone());
            }
        }
        if component.len() > 1 {
            component.sort();
            found.push(component);
        }
    }
    found
}

#[test]
fn no_crate_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut srcs = vec![root.join("src")];
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/");
    srcs.extend(crates.flatten().map(|c| c.path().join("src")));
    let mut checked = 0;
    let mut failures = Vec::new();
    for src in srcs.into_iter().filter(|s| s.is_dir()) {
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &files {
            let module = module_of(&src, file);
            let code = std::fs::read_to_string(file).expect("readable");
            let deps = graph.entry(module.clone()).or_default();
            deps.extend(imports(&code).into_iter().filter(|m| *m != module));
        }
        // Only modules of this crate count (not `crate::SomeType` paths).
        let modules: BTreeSet<String> = graph.keys().cloned().collect();
        for deps in graph.values_mut() {
            deps.retain(|d| modules.contains(d));
        }
        checked += graph.len();
        for circle in circles(&graph) {
            failures.push(format!("{}: {}", src.display(), circle.join(" <-> ")));
        }
    }
    assert!(
        checked > 50,
        "only {checked} modules found: is the layout as expected?"
    );
    assert!(
        failures.is_empty(),
        "import circles:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_checker_finds_a_circle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        graph.entry(from.into()).or_default().insert(to.into());
        graph.entry(to.into()).or_default();
    }
    assert_eq!(circles(&graph), vec![vec!["a", "b", "c"]]);
    let code = "use crate::config::X;\n// crate::faults in a comment\nfn f() { crate::metrics::g() }\n#[cfg(test)]\nmod tests {\n use crate::shared;\n}\n";
    assert_eq!(
        imports(code),
        ["config", "metrics"]
            .map(String::from)
            .into_iter()
            .collect()
    );
}
