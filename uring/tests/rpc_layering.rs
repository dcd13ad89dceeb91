//! `uring/src/rpc` is a stack of layers, not a ring: each module names only modules
//! below it in [`LAYERS`]. This test reads the sources and checks every path that
//! leaves a module (`super::x`, `crate::rpc::x`, `super::super::x` from a child
//! module, and names re-exported by `rpc/mod.rs`), tests included; doc comments may
//! link anywhere. A new module must be given its place here.
//!
//! Some modules' files form layers of their own ([`CHILD_LAYERS`]): a child file names
//! only siblings below it, and nothing of its parent, which sits on top of them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The modules of `rpc`, lowest first.
const LAYERS: &[&str] = &[
    // Errors, buffers and device memory.
    "error",
    "recycle",
    "device",
    // What a call carries, who makes calls, what answers them.
    "message",
    "rref",
    "client",
    "handler",
    // The transport seam and the built-in transports.
    "transport",
    "tcp_transport",
    "shm_transport",
    // Tensors into and out of frames, mpt's extra connections.
    "tensors",
    "mpt",
    // Options (their defaults are the modules' above) and the fault-injection decorator
    // they configure.
    "options",
    "faults",
    // Narrow shared pieces: the offer, the group and handlers, the counts, the mailbox.
    "offer",
    "registry",
    "counters",
    "mailbox",
    // Calls in flight, frame building.
    "calls",
    "outgoing",
    // Pipes served by threads (`ClientLane`, `InboundLane`: see `CHILD_LAYERS`), how
    // calls reach them, the handshake thread, the pool.
    "lane",
    "dispatch",
    "io",
    // The agent's RRefs: core's machine driven over reserved handlers (above the pipes
    // it sends on; the pool hands it `to_here` requests).
    "rref_runtime",
    "pool",
    // One driver for the core's store-step machines, the handle, start-up, the
    // backend registry.
    "deadline",
    "drive",
    "agent",
    "startup",
    "backend",
];

/// Modules whose child files form layers, lowest first; the files of one layer know
/// nothing of each other. The module's own file (`x/mod.rs`) is on top.
const CHILD_LAYERS: &[(&str, &[&[&str]])] = &[
    // `spin`: how long a lane's waiters spin; `io`: `LaneIo`, the I/O both lane types
    // share; `client`: `ClientLane`, the side that calls; `inbound`: `InboundLane`, the
    // side that serves. `lane/mod.rs`: the registry of lanes and starting them.
    ("lane", &[&["spin", "io"], &["client", "inbound"]]),
    // A message into a frame, below the pipe that receives with it.
    ("shm_transport", &[&["decode"], &["blocking"]]),
];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The identifiers that follow `prefix` in `code`, including each name of a
/// `prefix{a, b::c}` group.
fn names_after(code: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find(prefix) {
        let at = from + found;
        from = at + prefix.len();
        let before = code[..at].chars().last();
        let rest = &code[from..];
        // `super::super::x` is not `super::x`; a longer identifier is not this prefix.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            || rest.starts_with(prefix)
        {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    names.push(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

/// `rpc/mod.rs`'s `pub use module::{Name, ...}`: which module each re-exported name is
/// from.
fn reexports(mod_rs: &str) -> BTreeMap<String, String> {
    let mut from = BTreeMap::new();
    let mut text = mod_rs;
    while let Some(at) = text.find("pub use ") {
        text = &text[at + "pub use ".len()..];
        let end = text.find(';').unwrap_or(text.len());
        let item = &text[..end];
        if let Some((module, names)) = item.split_once("::") {
            let names = names.trim_matches(|c: char| c == '{' || c == '}' || c.is_whitespace());
            for name in names.split(',') {
                let name = name.trim();
                if !name.is_empty() {
                    from.insert(name.to_string(), module.trim().to_string());
                }
            }
        }
    }
    from
}

/// The code of a file without comments (doc links may point anywhere).
fn code_of(text: &str) -> String {
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn rpc_modules_form_layers_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/rpc");
    let mod_rs = std::fs::read_to_string(root.join("mod.rs")).expect("rpc/mod.rs is readable");
    let reexported = reexports(&mod_rs);
    let rank = |module: &str| LAYERS.iter().position(|m| *m == module);
    let mut files = Vec::new();
    sources(&root, &mut files);
    files.sort();
    let mut edges: BTreeSet<(String, String)> = BTreeSet::new();
    let mut unplaced = Vec::new();
    for path in &files {
        let relative = path.strip_prefix(&root).expect("under rpc/");
        let parts: Vec<String> = relative
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if parts == ["mod"] {
            continue;
        }
        // The module a file belongs to, and how its paths reach `rpc`.
        let module = parts[0].clone();
        let (super_is_rpc, super_super_is_rpc) = match parts.len() {
            1 => (true, false),
            // `startup/mod.rs` is `startup`; `lane/client.rs` is a child of `lane`.
            2 if parts[1] == "mod" => (true, false),
            2 => (false, true),
            _ => (false, false),
        };
        if rank(&module).is_none() {
            unplaced.push(module.clone());
            continue;
        }
        let code = code_of(&std::fs::read_to_string(path).expect("source is readable"));
        let mut named = names_after(&code, "crate::rpc::");
        if super_is_rpc {
            named.extend(names_after(&code, "super::"));
        }
        if super_super_is_rpc {
            named.extend(names_after(&code, "super::super::"));
        }
        for name in named {
            let target = if rank(&name).is_some() {
                Some(name)
            } else {
                reexported.get(&name).cloned()
            };
            if let Some(target) = target {
                if target != module {
                    edges.insert((module.clone(), target));
                }
            }
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules of uring/src/rpc with no place in LAYERS: {unplaced:?}; add them where \
         they belong"
    );
    let upward: Vec<String> = edges
        .iter()
        .filter(|(from, to)| rank(to) >= rank(from))
        .map(|(from, to)| format!("{from} -> {to}"))
        .collect();
    assert!(
        upward.is_empty(),
        "these modules of uring/src/rpc name a module at or above their layer (a cycle in \
         the making): {upward:?}; move the shared piece down, or pass it in"
    );
    // The check saw the stack: each layer above the first names something below it.
    assert!(
        edges.len() > LAYERS.len(),
        "only {} edges found: is the parser still reading the sources?",
        edges.len()
    );
}

#[test]
fn the_parser_sees_groups_and_skips_longer_prefixes() {
    let code =
        "use super::{calls::Pending, error};\nuse super::super::agent::X;\nx(super::lane::f);";
    assert_eq!(names_after(code, "super::"), ["calls", "error", "lane"]);
    assert_eq!(names_after(code, "super::super::"), ["agent"]);
    let reexports = reexports("pub use a::{B, C};\npub use d::E;");
    assert_eq!(reexports.get("C").map(String::as_str), Some("a"));
    assert_eq!(reexports.get("E").map(String::as_str), Some("d"));
}

/// The layer of `file` among the children of `module` in [`CHILD_LAYERS`].
fn child_rank(module: &str, file: &str) -> Option<usize> {
    let (_, layers) = CHILD_LAYERS.iter().find(|(m, _)| *m == module)?;
    layers.iter().position(|layer| layer.contains(&file))
}

#[test]
fn layered_modules_children_form_layers_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/rpc");
    let mut edges = Vec::new();
    for (module, layers) in CHILD_LAYERS {
        let dir = root.join(module);
        let mut files = Vec::new();
        sources(&dir, &mut files);
        files.sort();
        let mut children = Vec::new();
        for path in &files {
            let relative = path.strip_prefix(&dir).expect("under the module");
            let name = relative
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if name == "mod" {
                continue;
            }
            let Some(own) = child_rank(module, &name) else {
                panic!(
                    "rpc/{module}/{name}.rs has no place in CHILD_LAYERS; add it where it \
                     belongs"
                );
            };
            let code = code_of(&std::fs::read_to_string(path).expect("source is readable"));
            let mut named = names_after(&code, "super::");
            named.extend(names_after(&code, &format!("crate::rpc::{module}::")));
            for target in named {
                match child_rank(module, &target) {
                    Some(rank) if rank < own => edges.push((name.clone(), target)),
                    Some(_) => panic!(
                        "rpc/{module}/{name}.rs names its sibling {target}, at or above its \
                         layer (a cycle in the making)"
                    ),
                    None => panic!(
                        "rpc/{module}/{name}.rs names {target} of its parent, which sits \
                         above it; move the piece down, or pass it in"
                    ),
                }
            }
            children.push(name);
        }
        let listed: usize = layers.iter().map(|layer| layer.len()).sum();
        assert_eq!(
            children.len(),
            listed,
            "rpc/{module}: files {children:?}, but CHILD_LAYERS lists {layers:?}"
        );
    }
    // The check saw the files: the upper layers name the lower ones.
    assert!(
        edges.len() >= CHILD_LAYERS.len(),
        "only {edges:?} found: is the parser still reading the sources?"
    );
}
