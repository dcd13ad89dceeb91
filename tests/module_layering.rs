//! No import circle in any crate of the workspace: a module uses only modules below it.
//!
//! This test reads the sources of every crate (core, uring, rdma, bench, test-support and the
//! `rdzv` binary's `src/`), builds each crate's module graph and fails on any cycle,
//! printing it. The graph's nodes are the modules that have a file (an inline `mod x { }`
//! is part of its file's module); a file's `mod x;` declarations give the tree. Its edges
//! are the paths a file's code names: `crate::…`, `super::…`, `self::…` and the paths
//! that start with one of the module's own children (in `use` items, `pub use` included,
//! and in code), each resolved through the tree and through the `pub use` re-exports it
//! meets, so a name reaches the module that defines it. A use of an ancestor's own items
//! (`super::Item`) is no edge: the ancestor encloses the module. Comments, strings and
//! `$crate` macro paths are not read.
//!
//! It deliberately does not check the order of layers inside a crate (`uring`'s RPC
//! modules have that, in `uring/tests/rpc_layering.rs`), names brought in by `use
//! super::*` beyond the parent itself, or paths to other crates (Cargo forbids circles
//! between crates).
//!
//! Issue 27 broke every circle, so [`KNOWN_CYCLES`] is empty: the test fails on any
//! cycle. (Were one ever tolerated for a while, it would be listed there, and the test
//! fails when a listed one is gone, so the list only shrinks.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles tolerated for now, each as the modules of one circle (`crate::path`, in
/// order). None: every module uses only modules below it.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// The crates and their root files, relative to the workspace.
const CRATES: &[(&str, &str)] = &[
    ("rdzv_core", "core/src/lib.rs"),
    ("rdzv_uring", "uring/src/lib.rs"),
    ("rdzv_rdma", "rdma/src/lib.rs"),
    ("rdzv_test_support", "test-support/src/lib.rs"),
    ("rdzv_bench", "bench/src/lib.rs"),
    ("rdzv", "src/main.rs"),
];

/// A module path inside its crate (`["rpc", "lane"]`); the root is empty.
type ModPath = Vec<String>;

/// One file's module: its code (comments and literals blanked), what it re-exports.
#[derive(Debug, Default)]
struct Module {
    file: PathBuf,
    code: String,
    children: BTreeSet<String>,
    /// `pub use` items: the name they give, and the path they name (absolute in the crate).
    reexports: BTreeMap<String, ModPath>,
    /// Byte ranges of inline `mod x { … }` blocks, for `super::` inside them.
    inline: Vec<(usize, usize)>,
}

/// The code with comments, string and char literals replaced by spaces (byte offsets
/// kept), so that a path inside them is not read.
fn blank(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let fill = |out: &mut Vec<u8>, from: usize, to: usize| {
        for x in &mut out[from..to] {
            if *x != b'\n' {
                *x = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = text[i..].find('\n').map_or(b.len(), |n| i + n);
                fill(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                let mut j = i;
                while j < b.len() {
                    if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                        depth += 1;
                        j += 2;
                    } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                fill(&mut out, i, j.min(b.len()));
                i = j;
            }
            b'r' if (b.get(i + 1) == Some(&b'#') || b.get(i + 1) == Some(&b'"'))
                && (i == 0 || !is_ident(b[i - 1])) =>
            {
                let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = i + 2 + hashes;
                let end = text[start..]
                    .find(&close)
                    .map_or(b.len(), |n| start + n + close.len());
                fill(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(b.len());
                fill(&mut out, i, end);
                i = end;
            }
            b'\'' => {
                // A char literal ('a', '\n', '\u{..}'), not a lifetime ('a).
                let end = if b.get(i + 1) == Some(&b'\\') {
                    text[i + 2..].find('\'').map(|n| i + 2 + n + 1)
                } else if b.get(i + 2) == Some(&b'\'') {
                    Some(i + 3)
                } else {
                    text[i + 1..]
                        .chars()
                        .next()
                        .filter(|c| c.len_utf8() > 1)
                        .and_then(|c| {
                            let after = i + 1 + c.len_utf8();
                            (b.get(after) == Some(&b'\'')).then_some(after + 1)
                        })
                };
                match end {
                    Some(end) => {
                        fill(&mut out, i, end);
                        i = end;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s.bytes().position(|c| !is_ident(c)).unwrap_or(s.len());
    &s[..end]
}

/// The paths of a path expression or `use` tree that starts at `s` (just after a
/// `crate::` or similar), each as its segments; groups `{a, b::{c, d}}` expand.
/// A `*` ends a path as the segment `*`; `as` aliases are returned beside each path.
fn use_tree(s: &str) -> Vec<(Vec<String>, Option<String>)> {
    let mut out = Vec::new();
    tree_into(s, &mut Vec::new(), &mut out);
    out
}

fn tree_into(s: &str, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut rest = s.trim_start();
    let depth = prefix.len();
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            // Split the group at top-level commas.
            let mut level = 0;
            let mut start = 0;
            let mut end = group.len();
            let mut items = Vec::new();
            for (k, c) in group.char_indices() {
                match c {
                    '{' => level += 1,
                    '}' if level == 0 => {
                        end = k;
                        break;
                    }
                    '}' => level -= 1,
                    ',' if level == 0 => {
                        items.push(&group[start..k]);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            items.push(&group[start..end]);
            for item in items {
                let item = item.trim();
                if item.is_empty() {
                    continue;
                }
                if item == "self" {
                    out.push((prefix.clone(), None));
                    continue;
                }
                tree_into(item, prefix, out);
            }
            break;
        }
        if rest.starts_with('*') {
            prefix.push("*".into());
            out.push((prefix.clone(), None));
            break;
        }
        let name = ident(rest);
        if name.is_empty() {
            if prefix.len() > depth {
                out.push((prefix.clone(), None));
            }
            break;
        }
        prefix.push(name.to_string());
        rest = rest[name.len()..].trim_start();
        if let Some(next) = rest.strip_prefix("::") {
            rest = next.trim_start();
            continue;
        }
        let alias = rest
            .strip_prefix("as ")
            .map(|a| ident(a.trim_start()).to_string());
        out.push((prefix.clone(), alias));
        break;
    }
    prefix.truncate(depth);
}

/// Where each occurrence of `word` followed by `::` starts, where it is a path's first
/// segment (not `a::word::`, not `$crate`, not part of a longer name).
fn path_starts(code: &str, word: &str) -> Vec<usize> {
    let needle = format!("{word}::");
    let b = code.as_bytes();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(n) = code[from..].find(&needle) {
        let at = from + n;
        from = at + needle.len();
        let before = code[..at].trim_end().as_bytes().last().copied();
        let touching = at > 0 && (is_ident(b[at - 1]) || b[at - 1] == b'$');
        if touching || before == Some(b':') {
            continue;
        }
        found.push(at);
    }
    found
}

/// The module a path's segments reach from `base`, following children and re-exports:
/// the deepest module it names (an item's module for `a::b::Item`).
fn resolve(
    modules: &BTreeMap<ModPath, Module>,
    base: &ModPath,
    segments: &[String],
    hops: usize,
) -> ModPath {
    let mut at = base.clone();
    for seg in segments {
        let Some(module) = modules.get(&at) else {
            break;
        };
        if module.children.contains(seg) {
            at.push(seg.clone());
            continue;
        }
        if hops < 8 {
            if let Some(target) = module.reexports.get(seg) {
                return resolve(modules, &Vec::new(), target, hops + 1);
            }
        }
        break;
    }
    at
}

/// Reads a crate's module tree from its root file.
fn read_crate(root_file: &Path) -> BTreeMap<ModPath, Module> {
    let mut modules = BTreeMap::new();
    let mut queue = vec![(Vec::<String>::new(), root_file.to_path_buf())];
    while let Some((path, file)) = queue.pop() {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let code = blank(&text);
        let mut module = Module {
            file: file.clone(),
            ..Module::default()
        };
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let dir = file.parent().expect("a file has a directory").to_path_buf();
        let child_dir = if matches!(stem, "mod" | "lib" | "main") {
            dir.clone()
        } else {
            dir.join(stem)
        };
        // Inline modules and `mod x;` declarations.
        for at in path_words(&code, "mod") {
            let after = code[at + 3..].trim_start();
            let name = ident(after);
            if name.is_empty() {
                continue;
            }
            let tail = after[name.len()..].trim_start();
            if tail.starts_with('{') {
                let open = at + 3 + (code[at + 3..].len() - tail.len());
                module.inline.push((open, matching_brace(&code, open)));
                continue;
            }
            if !tail.starts_with(';') {
                continue;
            }
            if module.inline.iter().any(|(s, e)| *s < at && at < *e) {
                continue;
            }
            // A `#[path = "…"]` just before names the file (from the raw text).
            let before = &text[..at];
            let attr_start = before.rfind(';').max(before.rfind('}')).unwrap_or(0);
            let attrs = &before[attr_start..];
            let child_file = match attrs.find("#[path") {
                Some(p) => {
                    let quoted = &attrs[p..];
                    let q1 = quoted.find('"').expect("#[path = \"…\"]") + 1;
                    let q2 = q1 + quoted[q1..].find('"').expect("closing quote");
                    dir.join(&quoted[q1..q2])
                }
                None => {
                    let flat = child_dir.join(format!("{name}.rs"));
                    if flat.exists() {
                        flat
                    } else {
                        child_dir.join(name).join("mod.rs")
                    }
                }
            };
            module.children.insert(name.to_string());
            let mut child = path.clone();
            child.push(name.to_string());
            queue.push((child, child_file));
        }
        module.code = code;
        modules.insert(path, module);
    }
    // Re-exports, once the tree is known.
    let paths: Vec<ModPath> = modules.keys().cloned().collect();
    for path in &paths {
        let code = modules[path].code.clone();
        let mut reexports = BTreeMap::new();
        for at in path_words(&code, "pub") {
            let mut rest = code[at + 3..].trim_start();
            if let Some(vis) = rest.strip_prefix('(') {
                let close = vis.find(')').unwrap_or(0) + 2;
                rest = rest[close..].trim_start();
            }
            let Some(item) = rest.strip_prefix("use ") else {
                continue;
            };
            let item = item[..item.find(';').unwrap_or(item.len())].trim();
            for (segments, alias) in use_tree(item) {
                let Some(absolute) = absolute(&modules, path, at, &segments) else {
                    continue;
                };
                // A glob re-export names no single item; its uses resolve to the module.
                if absolute.last().map(String::as_str) == Some("*") {
                    continue;
                }
                let name = alias.unwrap_or_else(|| absolute.last().cloned().unwrap_or_default());
                if name != "self" && !name.is_empty() {
                    reexports.insert(name, absolute);
                }
            }
        }
        let module = modules.get_mut(path).expect("known");
        module.reexports = reexports;
    }
    modules
}

/// Where the keyword `word` stands alone in `code`.
fn path_words(code: &str, word: &str) -> Vec<usize> {
    let b = code.as_bytes();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(n) = code[from..].find(word) {
        let at = from + n;
        from = at + word.len();
        let left = at == 0 || !is_ident(b[at - 1]);
        let right = b.get(at + word.len()).is_none_or(|c| !is_ident(*c));
        if left && right {
            found.push(at);
        }
    }
    found
}

fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0;
    for (k, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// A path's segments made absolute in the crate, for a path written at byte `at` of the
/// module `path`'s file (inline modules count for `super::`). `None` for a path that
/// leaves the crate.
fn absolute(
    modules: &BTreeMap<ModPath, Module>,
    path: &ModPath,
    at: usize,
    segments: &[String],
) -> Option<ModPath> {
    let module = &modules[path];
    let first = segments.first()?;
    let inline_depth = module
        .inline
        .iter()
        .filter(|(s, e)| *s < at && at < *e)
        .count();
    match first.as_str() {
        "crate" => Some(segments[1..].to_vec()),
        "self" => {
            let mut out = path.clone();
            out.extend(segments[1..].iter().cloned());
            Some(out)
        }
        "super" => {
            let supers = segments.iter().take_while(|s| *s == "super").count();
            let up = supers.saturating_sub(inline_depth);
            if up > path.len() {
                return None;
            }
            let mut out = path[..path.len() - up].to_vec();
            out.extend(segments[supers..].iter().cloned());
            Some(out)
        }
        name if module.children.contains(name) && inline_depth == 0 => {
            let mut out = path.clone();
            out.extend(segments.iter().cloned());
            Some(out)
        }
        _ => None,
    }
}

/// The module graph: an edge `a -> b` for each path in `a`'s file that reaches `b`.
fn edges(modules: &BTreeMap<ModPath, Module>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut graph: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (path, module) in modules {
        let code = &module.code;
        let mut starts: Vec<usize> = ["crate", "super", "self"]
            .iter()
            .flat_map(|w| path_starts(code, w))
            .collect();
        for child in &module.children {
            starts.extend(path_starts(code, child));
        }
        let targets = graph.entry(path.clone()).or_default();
        for at in starts {
            for (segments, _) in use_tree(&code[at..]) {
                let Some(absolute) = absolute(modules, path, at, &segments) else {
                    continue;
                };
                let target = resolve(modules, &Vec::new(), &absolute, 0);
                // A module's ancestors enclose it: `super::Item` for an item the parent
                // defines is its context, not a use of a module beside it.
                if !path.starts_with(&target) {
                    targets.insert(target);
                }
            }
        }
    }
    graph
}

/// Strongly connected components with more than one module (Tarjan).
fn circles(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<BTreeSet<ModPath>> {
    struct State<'a> {
        graph: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<BTreeSet<ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a ModPath) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        let empty = BTreeSet::new();
        let next = s.graph.get(v).unwrap_or(&empty);
        for w in next {
            let Some((w, _)) = s.graph.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.insert(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.out
}

/// One shortest cycle through `from` inside `component`.
fn a_cycle(
    graph: &BTreeMap<ModPath, BTreeSet<ModPath>>,
    component: &BTreeSet<ModPath>,
    from: &ModPath,
) -> Vec<ModPath> {
    let mut previous: BTreeMap<ModPath, ModPath> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([from.clone()]);
    while let Some(v) = queue.pop_front() {
        for w in graph.get(&v).into_iter().flatten() {
            if !component.contains(w) {
                continue;
            }
            if w == from {
                let mut cycle = vec![v.clone()];
                let mut at = v.clone();
                while let Some(p) = previous.get(&at) {
                    cycle.push(p.clone());
                    at = p.clone();
                }
                cycle.reverse();
                return cycle;
            }
            if !previous.contains_key(w) && w != from {
                previous.insert(w.clone(), v.clone());
                queue.push_back(w.clone());
            }
        }
    }
    vec![from.clone()]
}

fn name(krate: &str, path: &ModPath) -> String {
    std::iter::once(krate.to_string())
        .chain(path.iter().cloned())
        .collect::<Vec<_>>()
        .join("::")
}

/// Every crate's graph, with module names prefixed by the crate's.
fn workspace_graph() -> (
    BTreeMap<String, BTreeSet<String>>,
    BTreeMap<String, PathBuf>,
) {
    // `RDZV_LAYERING_ROOT` points the check at another checkout (e.g. to see that it
    // finds the circles of an older commit).
    let root = std::env::var_os("RDZV_LAYERING_ROOT")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let root = root.as_path();
    let mut graph = BTreeMap::new();
    let mut files = BTreeMap::new();
    for (krate, file) in CRATES {
        let modules = read_crate(&root.join(file));
        for (path, module) in &modules {
            files.insert(name(krate, path), module.file.clone());
        }
        for (from, targets) in edges(&modules) {
            graph.insert(
                name(krate, &from),
                targets.iter().map(|t| name(krate, t)).collect(),
            );
        }
    }
    (graph, files)
}

#[test]
fn no_module_is_in_an_import_circle() {
    let (graph, files) = workspace_graph();
    assert!(
        files.len() > 100 && graph.values().map(BTreeSet::len).sum::<usize>() > 200,
        "only {} modules and few edges found: is the parser still reading the sources?",
        files.len()
    );
    let as_paths: BTreeMap<ModPath, BTreeSet<ModPath>> = graph
        .iter()
        .map(|(k, v)| (vec![k.clone()], v.iter().map(|t| vec![t.clone()]).collect()))
        .collect();
    let mut problems = Vec::new();
    let mut seen_known = BTreeSet::new();
    for component in circles(&as_paths) {
        let members: BTreeSet<&str> = component.iter().map(|m| m[0].as_str()).collect();
        let known: Vec<&&[&str]> = KNOWN_CYCLES
            .iter()
            .filter(|cycle| cycle.iter().any(|m| members.contains(m)))
            .collect();
        let covered: BTreeSet<&str> = known.iter().flat_map(|c| c.iter().copied()).collect();
        seen_known.extend(known.iter().map(|c| c[0]));
        if covered == members {
            continue;
        }
        let first = component.iter().next().expect("a circle has members");
        let cycle = a_cycle(&as_paths, &component, first);
        let shown: Vec<String> = cycle
            .iter()
            .chain(std::iter::once(first))
            .map(|m| format!("{} ({})", m[0], files[&m[0]].display()))
            .collect();
        let inside: Vec<String> = members
            .iter()
            .flat_map(|from| {
                graph[*from]
                    .iter()
                    .filter(|to| members.contains(to.as_str()))
                    .map(move |to| format!("{from} -> {to}"))
            })
            .collect();
        problems.push(format!(
            "a circle of {} modules: {:?}\n  one cycle in it:\n    {}\n  its uses:\n    {}",
            members.len(),
            members,
            shown.join("\n -> "),
            inside.join("\n    ")
        ));
    }
    for cycle in KNOWN_CYCLES {
        let broken: Vec<String> = cycle
            .iter()
            .zip(cycle.iter().cycle().skip(1))
            .filter(|(a, b)| !graph.get(**a).is_some_and(|t| t.contains(**b)))
            .map(|(a, b)| format!("{a} -> {b}"))
            .collect();
        if !broken.is_empty() || !seen_known.contains(cycle[0]) {
            problems.push(format!(
                "the known cycle {cycle:?} is gone (no more {broken:?}): remove it from \
                 KNOWN_CYCLES"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "import circles (a module may use only modules below it; move the shared piece \
         down, or pass it in):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_parser_reads_groups_supers_and_literals() {
    let paths = use_tree("a::{b::{C, D as E}, self, f::*};");
    let shown: Vec<String> = paths
        .iter()
        .map(|(p, alias)| {
            format!(
                "{}{}",
                p.join("::"),
                alias
                    .as_deref()
                    .map(|a| format!(" as {a}"))
                    .unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(shown, ["a::b::C", "a::b::D as E", "a", "a::f::*"]);
    let code = blank("let s = \"crate::x\"; // super::y\nlet c = '\"'; crate::z::W");
    assert_eq!(path_starts(&code, "crate").len(), 1);
    assert_eq!(path_starts(&code, "super").len(), 0);
    assert_eq!(path_starts("$crate::a x::crate::b", "crate").len(), 0);
}

/// Every `.rs` file under `dir` that has a folder of the same name beside it.
fn files_beside_their_folder(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_beside_their_folder(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") && path.with_extension("").is_dir() {
            found.push(path);
        }
    }
}

/// One module layout across the workspace (issue 27): a module with children is
/// `name/mod.rs`, never `name.rs` beside a `name/` folder.
#[test]
fn every_module_with_children_is_a_mod_rs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for (_, file) in CRATES {
        if let Some(src) = root.join(file).parent() {
            files_beside_their_folder(src, &mut found);
        }
    }
    files_beside_their_folder(&root.join("python/src"), &mut found);
    assert!(
        found.is_empty(),
        "move each of these to <name>/mod.rs (one layout across the workspace): {found:?}"
    );
}
