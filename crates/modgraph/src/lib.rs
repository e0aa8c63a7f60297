//! The module graph of a crate, read from its source: which top-level module refers to which.
//!
//! A module is a file directly under `src/` (`set.rs`) or a directory of them (`io/`, whose
//! files all count as `io`); `lib.rs`/`main.rs` is the crate root. An edge `a -> b` is any
//! `crate::b` path in `a`'s code: `use crate::b::X`, `use crate::{b::X, c}`, or a path
//! written inline (`crate::b::f()`). A name the root re-exports (`pub use b::X;`, then
//! `crate::X`) counts as its module. Comments and the unit tests at the end of a file (from a
//! `#[cfg(test)]` line followed by `mod`) are left out: the graph is the code's layering, and
//! a test may reach any module.
//!
//! Invariants: the parse is textual and errs on the side of more edges (a `crate::x` inside a
//! string literal counts); edges to the root itself are left out (everything may use what the
//! root defines; the root is above every module).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module graph of one crate: module → the modules it refers to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Graph {
    pub edges: BTreeMap<String, BTreeSet<String>>,
}

/// Reads the crate whose `src/` is `src`.
pub fn read_crate(src: &Path) -> std::io::Result<Graph> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|r| src.join(r))
        .find(|p| p.exists());
    let reexports = match &root {
        Some(r) => reexports(&code(&std::fs::read_to_string(r)?)),
        None => BTreeMap::new(),
    };
    let mut files = Vec::new();
    collect(src, &mut files)?;
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut graph = Graph::default();
    for m in &modules {
        graph.edges.entry(m.clone()).or_default();
    }
    for f in &files {
        let Some(from) = module_of(src, f) else {
            continue;
        };
        let text = code(&std::fs::read_to_string(f)?);
        for name in crate_paths(&text) {
            let to = if modules.contains(&name) {
                Some(name)
            } else {
                reexports.get(&name).cloned()
            };
            if let Some(to) = to.filter(|t| *t != from && modules.contains(t)) {
                graph.edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    Ok(graph)
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// The top-level module a file belongs to; `None` for the crate root and `src/bin/`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    if rel.components().count() == 1 {
        let stem = first.strip_suffix(".rs")?;
        return (!matches!(stem, "lib" | "main")).then(|| stem.to_string());
    }
    (first != "bin").then(|| first.to_string())
}

/// The code of a file: comments removed, and the unit tests at its end.
pub fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    let mut in_block = false;
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]")
            && lines.peek().is_some_and(|n| {
                n.trim_start().starts_with("mod ") || n.trim_start().starts_with("pub mod ")
            })
        {
            break;
        }
        let mut rest = line;
        let mut kept = String::new();
        loop {
            if in_block {
                match rest.find("*/") {
                    Some(i) => {
                        in_block = false;
                        rest = &rest[i + 2..];
                    }
                    None => break,
                }
            }
            let line_comment = rest.find("//");
            let block = rest.find("/*");
            match (line_comment, block) {
                (Some(l), b) if b.is_none_or(|b| l < b) => {
                    kept.push_str(&rest[..l]);
                    break;
                }
                (_, Some(b)) => {
                    kept.push_str(&rest[..b]);
                    in_block = true;
                    rest = &rest[b + 2..];
                }
                _ => {
                    kept.push_str(rest);
                    break;
                }
            }
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// The first segment of every `crate::` path in `code` (each member of a `crate::{...}`
/// group).
pub fn crate_paths(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `$crate::`, `other_crate::`
        }
        let t = rest.trim_start();
        if let Some(group) = t.strip_prefix('{') {
            let mut depth = 1;
            let mut member_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => member_start = true,
                    c if member_start && (c.is_alphabetic() || c == '_') && depth == 1 => {
                        names.push(ident(&group[j..]));
                        member_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let id = ident(t);
            if !id.is_empty() {
                names.push(id);
            }
        }
    }
    names
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Names the root re-exports, with the module each comes from (`pub use m::{A, B}`,
/// `pub use m::A`, `pub use m::A as B`).
fn reexports(root: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in root.split(';') {
        let s = stmt.trim();
        let Some(path) = s.strip_prefix("pub use ") else {
            continue;
        };
        let path = path
            .trim()
            .trim_start_matches("crate::")
            .trim_start_matches("self::");
        let Some((module, items)) = path.split_once("::") else {
            continue;
        };
        let module = module.trim().to_string();
        let items = items.trim();
        let items = items
            .strip_prefix('{')
            .and_then(|i| i.strip_suffix('}'))
            .unwrap_or(items);
        for item in items.split(',') {
            let item = item.trim();
            let name = match item.split_once(" as ") {
                Some((_, alias)) => alias.trim(),
                None => item.rsplit("::").next().unwrap_or(item).trim(),
            };
            if !name.is_empty() {
                out.insert(name.to_string(), module.clone());
            }
        }
    }
    out
}

/// The cycles of the graph: its strongly connected components of more than one module
/// (Tarjan's algorithm), each sorted.
pub fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.g.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = Tarjan {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

/// The modules in layers, bottom first: each module's layer is one above the highest of the
/// modules it uses (modules in a cycle share the cycle's layer).
pub fn layers(g: &Graph) -> Vec<Vec<String>> {
    let mut level: BTreeMap<&str, usize> = BTreeMap::new();
    let in_cycle: BTreeMap<String, usize> = cycles(g)
        .into_iter()
        .enumerate()
        .flat_map(|(i, c)| c.into_iter().map(move |m| (m, i)))
        .collect();
    // Relax until no level changes (the graph is small; edges inside a cycle are ignored).
    loop {
        let mut changed = false;
        for (m, deps) in &g.edges {
            let l = deps
                .iter()
                .filter(|d| !(in_cycle.contains_key(m) && in_cycle.get(*d) == in_cycle.get(m)))
                .map(|d| level.get(d.as_str()).copied().unwrap_or(0) + 1)
                .max()
                .unwrap_or(0);
            if level.get(m.as_str()).copied().unwrap_or(0) < l {
                level.insert(m, l);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut out: Vec<Vec<String>> = Vec::new();
    for m in g.edges.keys() {
        let l = level.get(m.as_str()).copied().unwrap_or(0);
        if out.len() <= l {
            out.resize(l + 1, Vec::new());
        }
        out[l].push(m.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_groups_and_comments() {
        let c = code(
            "use crate::a::X;\nuse crate::{b::Y, c, d::{e, f}};\n// crate::g\n/* crate::h */ let x = crate::i::f();\n$crate::j\nother_crate::k\n#[cfg(test)]\nmod tests { use crate::l; }\n",
        );
        assert_eq!(crate_paths(&c), ["a", "b", "c", "d", "i"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let mut g = Graph::default();
        let edge = |g: &mut Graph, a: &str, b: &str| {
            g.edges.entry(a.into()).or_default().insert(b.into());
            g.edges.entry(b.into()).or_default();
        };
        edge(&mut g, "a", "b");
        edge(&mut g, "b", "c");
        assert!(cycles(&g).is_empty());
        assert_eq!(layers(&g), [vec!["c"], vec!["b"], vec!["a"]]);
        edge(&mut g, "c", "a");
        edge(&mut g, "d", "a");
        assert_eq!(cycles(&g), [vec!["a", "b", "c"]]);
    }

    #[test]
    fn reexported_names_count_as_their_module() {
        let r = reexports(&code(
            "pub use set::{CacheSet, Config as Cfg};\npub use io::Volume;\n",
        ));
        assert_eq!(r["CacheSet"], "set");
        assert_eq!(r["Cfg"], "set");
        assert_eq!(r["Volume"], "io");
    }
}
