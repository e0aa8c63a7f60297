//! The module graph of a crate, read from its source: which file refers to which.
//!
//! A node is one file under `src/`, named by its module path: `set.rs` is `set`, `io/read.rs`
//! is `io::read`, `io/mod.rs` is `io`; `lib.rs`/`main.rs` is the crate root and `src/bin/`
//! holds other roots, neither a node. An edge `a -> b` is a path in `a`'s code that names an
//! item defined in `b`: `crate::x::Y`, `super::Y`, `self::x::Y`, a child module's `x::Y` in
//! the file that declares `mod x;`, each member of a `{...}` group and a glob (`x::*`, an
//! edge to `x`). The path is followed module by module as far as files exist; its next
//! segment is an item of the module reached, and if that module imports the name (any `use`:
//! its children see private imports too), the edge goes where the import leads. A re-export
//! (`pub use`, `pub(crate) use`) is naming, not use, so it is no edge of its own; a private
//! `use` is an edge of the file that writes it.
//!
//! Left out: comments, the contents of string and character literals, test modules (an item
//! `mod` under `#[cfg(test)]`: its braces, or the whole file it declares), paths in macros'
//! `$crate::`, and edges to the root (everything may use what the root defines; the root is
//! above every module). An inline non-test `mod m { … }` belongs to its file.
//!
//! Invariants: textual, no name resolution beyond the above, erring toward more edges (a
//! module imported by name, `use crate::io; io::read::f()`, gives an edge to `io`, not to
//! `io::read`); the same source always gives the same graph (ordered maps, sorted files).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module graph of one crate: file module → the file modules it refers to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Graph {
    pub edges: BTreeMap<String, BTreeSet<String>>,
}

/// A module path (empty: the crate root).
type ModPath = Vec<String>;
/// A path as written: the module it is read from, and its segments after that.
type Written = (ModPath, Vec<String>);
/// A file's re-exports: name → where it leads.
type Reexports = BTreeMap<String, Written>;

/// One source file, parsed.
struct File {
    /// Its module path (empty for the root).
    module: ModPath,
    /// Paths it uses.
    uses: Vec<Written>,
    /// Names it imports (`use`, re-exported or not): where each leads.
    reexports: Reexports,
    /// Modules it imports every name of (`use x::*`, re-exported or not).
    globs: Vec<Written>,
    /// Names of the items it defines (at any depth: errs toward more).
    defines: BTreeSet<String>,
    /// Child modules declared under `#[cfg(test)]`.
    test_children: Vec<String>,
}

/// Reads the crate whose `src/` is `src`.
pub fn read_crate(src: &Path) -> std::io::Result<Graph> {
    let mut paths = Vec::new();
    collect(src, &mut paths)?;
    let mut files = Vec::new();
    for p in &paths {
        let Some(module) = module_of(src, p) else {
            continue;
        };
        files.push(parse(module, &std::fs::read_to_string(p)?));
    }
    // Files declared as test modules (and everything under them) are not part of the graph.
    let test_only: Vec<Vec<String>> = files
        .iter()
        .flat_map(|f| {
            f.test_children.iter().map(|c| {
                let mut m = f.module.clone();
                m.push(c.clone());
                m
            })
        })
        .collect();
    files.retain(|f| !test_only.iter().any(|t| f.module.starts_with(t)));
    let resolver = Resolver {
        files: files.iter().map(|f| (f.module.as_slice(), f)).collect(),
    };
    let mut graph = Graph::default();
    for f in files.iter().filter(|f| !f.module.is_empty()) {
        let from = f.module.join("::");
        let deps = graph.edges.entry(from.clone()).or_default();
        for (base, segs) in &f.uses {
            if let Some(to) = resolver.resolve(base.clone(), segs, 0) {
                if !to.is_empty() && to != f.module {
                    deps.insert(to.join("::"));
                }
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

/// The module path of a file; `None` under `src/bin/`.
fn module_of(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    let is_root = parts.is_empty() && matches!(stem, "lib" | "main");
    if !is_root && stem != "mod" {
        parts.push(stem.to_string());
    }
    Some(parts)
}

struct Resolver<'a> {
    files: BTreeMap<&'a [String], &'a File>,
}

impl Resolver<'_> {
    /// The file module that `segs`, read from module `cur`, names an item of.
    fn resolve(&self, mut cur: Vec<String>, segs: &[String], depth: usize) -> Option<Vec<String>> {
        for (i, s) in segs.iter().enumerate() {
            if s == "*" {
                break;
            }
            let mut next = cur.clone();
            next.push(s.clone());
            if self.files.contains_key(next.as_slice()) {
                cur = next;
                continue;
            }
            if let Some(m) = self.lead(&cur, s, &segs[i + 1..], depth) {
                return Some(m);
            }
            break;
        }
        self.files.contains_key(cur.as_slice()).then_some(cur)
    }

    /// Where item `name` of module `cur` (followed by `rest`) is defined: through the
    /// module's imports, its own items, then its glob imports; `None` if none has it.
    fn lead(
        &self,
        cur: &[String],
        name: &str,
        rest: &[String],
        depth: usize,
    ) -> Option<Vec<String>> {
        let file = self.files.get(cur)?;
        if depth >= 16 {
            return None;
        }
        if let Some((base, target)) = file.reexports.get(name) {
            let mut target = target.clone();
            target.extend(rest.iter().cloned());
            return self.resolve(base.clone(), &target, depth + 1);
        }
        if file.defines.contains(name) {
            return Some(cur.to_vec());
        }
        file.globs.iter().find_map(|(base, segs)| {
            let glob = self.resolve(base.clone(), segs, depth + 1)?;
            (glob != cur).then(|| self.lead(&glob, name, rest, depth + 1))?
        })
    }
}

/// Parses one file: its uses, its re-exports, its test children.
fn parse(module: Vec<String>, text: &str) -> File {
    let (code, test_children) = strip_tests(&code(text));
    let children: BTreeSet<String> = child_decls(&code).into_iter().collect();
    let mut reexports = BTreeMap::new();
    let mut globs = Vec::new();
    // Re-exports: `pub use …;` / `pub(crate) use …;`. Their paths are no edges of their own.
    let mut plain = String::with_capacity(code.len());
    let mut rest = code.as_str();
    while let Some(i) = find_reexport(rest) {
        plain.push_str(&rest[..i]);
        let stmt_start = &rest[i..];
        let end = stmt_start.find(';').unwrap_or(stmt_start.len());
        let stmt = &stmt_start[..end];
        let tree = &stmt[stmt.find("use").map_or(0, |u| u + 3)..];
        for (name, w) in imports(&module, &children, tree) {
            match name {
                Some(n) => {
                    reexports.insert(n, w);
                }
                None => globs.push(w),
            }
        }
        plain.push(' ');
        rest = &stmt_start[end..];
    }
    plain.push_str(rest);
    // A private `use` names items in this module too (its children may write `super::X`
    // for them): recorded for resolution like a re-export, and still an edge of this file.
    let mut from = 0;
    while let Some(i) = plain[from..].find("use") {
        let at = from + i;
        from = at + 3;
        if !boundary_before(&plain, at) || !plain[at + 3..].starts_with(char::is_whitespace) {
            continue;
        }
        let stmt = &plain[at + 3..];
        for (name, w) in imports(
            &module,
            &children,
            &stmt[..stmt.find(';').unwrap_or(stmt.len())],
        ) {
            match name {
                Some(n) => {
                    reexports.entry(n).or_insert(w);
                }
                None => globs.push(w),
            }
        }
    }
    let uses = paths(&plain, &children)
        .iter()
        .filter_map(|path| base_of(&module, &children, path))
        .collect();
    File {
        defines: definitions(&plain),
        module,
        uses,
        reexports,
        globs,
        test_children,
    }
}

/// What the use tree `tree` brings into `module`: each name (`None` for a glob, whose path
/// is then the module's, without the `*`) and where it leads.
fn imports(
    module: &[String],
    children: &BTreeSet<String>,
    tree: &str,
) -> Vec<(Option<String>, Written)> {
    let mut leaves = Vec::new();
    use_tree(tree.trim(), Vec::new(), &mut leaves);
    let mut out = Vec::new();
    for (path, alias) in leaves {
        let Some((base, mut segs)) = base_of(module, children, &path) else {
            continue;
        };
        if segs.last().is_some_and(|l| l == "*") {
            segs.pop();
            out.push((None, (base, segs)));
        } else if let Some(name) = alias.or_else(|| segs.last().cloned()) {
            if name != "self" {
                out.push((Some(name), (base, segs)));
            }
        }
    }
    out
}

/// The names of the items `code` defines (`struct`, `enum`, `union`, `trait`, `type`, `fn`,
/// `const`, `static`, `macro_rules!`), wherever they are.
fn definitions(code: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 9] = [
        "struct",
        "enum",
        "union",
        "trait",
        "type",
        "fn",
        "const",
        "static",
        "macro_rules!",
    ];
    let mut out = BTreeSet::new();
    for kw in KEYWORDS {
        let mut from = 0;
        while let Some(i) = code[from..].find(kw) {
            let at = from + i;
            from = at + kw.len();
            let after = &code[at + kw.len()..];
            if !boundary_before(code, at) || !after.starts_with(char::is_whitespace) {
                continue;
            }
            let name = ident(after.trim_start());
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// Where a `pub use` statement starts in `code`, if any.
fn find_reexport(code: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = code[from..].find("pub") {
        let at = from + i;
        from = at + 3;
        if !boundary_before(code, at) {
            continue;
        }
        let mut after = code[at + 3..].trim_start();
        if let Some(vis) = after.strip_prefix('(') {
            match vis.find(')') {
                Some(j) => after = vis[j + 1..].trim_start(),
                None => continue,
            }
        }
        if after.starts_with("use") && !after[3..].starts_with(|c: char| is_ident(c)) {
            return Some(at);
        }
    }
    None
}

/// The base module and segments of a path as written in module `module`: `crate::…` from the
/// root, `super::…` from the parent, `self::…` and a declared child's `child::…` from here.
fn base_of(module: &[String], children: &BTreeSet<String>, path: &[String]) -> Option<Written> {
    let first = path.first()?;
    match first.as_str() {
        "crate" => Some((Vec::new(), path[1..].to_vec())),
        "self" => Some((module.to_vec(), path[1..].to_vec())),
        "super" => {
            let mut base = module.to_vec();
            let mut i = 0;
            while path.get(i).is_some_and(|s| s == "super") {
                base.pop()?;
                i += 1;
            }
            Some((base, path[i..].to_vec()))
        }
        c if children.contains(c) => Some((module.to_vec(), path.to_vec())),
        _ => None,
    }
}

/// Every path in `code` that starts with `crate::`, `super::`, `self::` or a declared child's
/// name followed by `::`, expanded through `{…}` groups (each leaf one path; `self` in a group
/// names the group's prefix).
fn paths(code: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        if !bytes[i].is_ascii_alphabetic() && bytes[i] != b'_' {
            i += 1;
            continue;
        }
        let id = ident(&code[i..]);
        let start = i;
        i += id.len().max(1);
        // A path's first segment: not after `::` (`x::crate`), `$` (`$crate`) or another ident.
        let prev = code[..start].trim_end();
        if prev.ends_with("::")
            || prev.ends_with('$')
            || (start > 0 && !boundary_before(code, start))
        {
            continue;
        }
        let starts = matches!(id.as_str(), "crate" | "super" | "self") || children.contains(&id);
        if !starts || !code[i..].trim_start().starts_with("::") {
            continue;
        }
        let mut leaves = Vec::new();
        let len = use_tree(&code[start..], Vec::new(), &mut leaves);
        out.extend(leaves.into_iter().map(|(p, _)| p));
        i = start + len.max(id.len());
    }
    out
}

/// Parses a use tree (`a::b::{c, d::e as f, g::*}`) at the start of `s`, pushing each leaf's
/// full path (with its alias); returns how many bytes it read.
fn use_tree(s: &str, prefix: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) -> usize {
    let mut path = prefix;
    let mut pos = 0;
    loop {
        let rest = &s[pos..];
        let skipped = rest.len() - rest.trim_start().len();
        pos += skipped;
        let rest = &s[pos..];
        if let Some(group) = rest.strip_prefix('{') {
            pos += 1;
            let mut inner = group;
            loop {
                let t = inner.trim_start();
                pos += inner.len() - t.len();
                if t.starts_with('}') {
                    return pos + 1;
                }
                if t.is_empty() {
                    return pos;
                }
                if let Some(after) = t.strip_prefix(',') {
                    pos += 1;
                    inner = after;
                    continue;
                }
                let used = use_tree(t, path.clone(), out);
                if used == 0 {
                    // Not a path: skip one character.
                    let c = t.chars().next().map_or(1, char::len_utf8);
                    pos += c;
                    inner = &t[c..];
                    continue;
                }
                pos += used;
                inner = &t[used..];
            }
        }
        if rest.starts_with('*') {
            path.push("*".into());
            out.push((path, None));
            return pos + 1;
        }
        let id = ident(rest);
        if id.is_empty() {
            if !path.is_empty() && pos > 0 {
                out.push((path, None));
            }
            return pos;
        }
        pos += id.len();
        if id == "self" && !path.is_empty() {
            // `a::{self, …}` names `a` itself.
        } else {
            path.push(id);
        }
        let after = &s[pos..];
        let t = after.trim_start();
        if let Some(next) = t.strip_prefix("::") {
            pos += after.len() - next.len();
            continue;
        }
        let alias = t
            .strip_prefix("as")
            .filter(|a| a.starts_with(char::is_whitespace))
            .map(|a| ident(a.trim_start()));
        if let Some(a) = &alias {
            let a_at = after.find(a.as_str()).unwrap_or(0);
            pos += a_at + a.len();
        }
        out.push((path, alias.filter(|a| !a.is_empty())));
        return pos;
    }
}

/// The names of child modules declared in `code` (`mod x;`, `pub mod x;`, `mod x { … }`
/// counts too: its items are this file's).
fn child_decls(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("mod") {
        let at = from + i;
        from = at + 3;
        if !boundary_before(code, at) || code[at + 3..].starts_with(|c: char| is_ident(c)) {
            continue;
        }
        let rest = code[at + 3..].trim_start();
        let name = ident(rest);
        if !name.is_empty() && rest[name.len()..].trim_start().starts_with(';') {
            out.push(name);
        }
    }
    out
}

/// `code` without its test modules, and the names of the child files declared as tests.
/// A test module is `mod` (any visibility) after `#[cfg(test)]` and any further attributes:
/// its `{…}` is dropped, or for `mod x;` the declaration (x's file is dropped by the caller).
/// What is dropped leaves its newlines, so line numbers stay those of the file.
pub fn strip_tests(code: &str) -> (String, Vec<String>) {
    let mut out = String::with_capacity(code.len());
    let mut children = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let mut t = rest[i + "#[cfg(test)]".len()..].trim_start();
        while t.starts_with("#[") {
            match t.find(']') {
                Some(j) => t = t[j + 1..].trim_start(),
                None => break,
            }
        }
        let vis_end = if t.starts_with("pub(") {
            t.find(')').map_or(0, |j| j + 1)
        } else if t.starts_with("pub ") {
            3
        } else {
            0
        };
        let t2 = t[vis_end..].trim_start();
        let is_mod = t2.starts_with("mod") && t2[3..].starts_with(char::is_whitespace);
        if !is_mod {
            out.push_str("#[cfg(test)]");
            rest = &rest[i + "#[cfg(test)]".len()..];
            continue;
        }
        let after_mod = t2[3..].trim_start();
        let name = ident(after_mod);
        let body = after_mod[name.len()..].trim_start();
        let next = if let Some(after) = body.strip_prefix(';') {
            children.push(name);
            after
        } else if body.starts_with('{') {
            let mut depth = 0usize;
            let mut end = body.len();
            for (j, c) in body.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = j + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            &body[end..]
        } else {
            body
        };
        let dropped = &rest[i..rest.len() - next.len()];
        out.extend(dropped.chars().filter(|&c| c == '\n'));
        rest = next;
    }
    out.push_str(rest);
    (out, children)
}

/// The code of a file: comments removed, and the contents of string and character literals
/// (so braces and paths inside them count for nothing). Line structure is kept.
pub fn code(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut copy_from = 0;
    let flush = |out: &mut String, from: usize, to: usize| out.push_str(&text[from..to]);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                flush(&mut out, copy_from, i);
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                copy_from = i;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                flush(&mut out, copy_from, i);
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if b[i] == b'\n' {
                            out.push('\n');
                        }
                        i += 1;
                    }
                }
                copy_from = i;
            }
            b'r' if !ident_before(b, i) && raw_string_hashes(&b[i + 1..]).is_some() => {
                let hashes = raw_string_hashes(&b[i + 1..]).unwrap_or(0);
                flush(&mut out, copy_from, i);
                i += 2 + hashes; // r, hashes, opening quote
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                while i < b.len() && !b[i..].starts_with(&close) {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                i = (i + close.len()).min(b.len());
                out.push_str("\"\"");
                copy_from = i;
            }
            b'"' => {
                flush(&mut out, copy_from, i);
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i = (i + 1).min(b.len());
                out.push_str("\"\"");
                copy_from = i;
            }
            b'\'' => {
                // A character literal ('x', '\n', '\u{..}'), not a lifetime ('a).
                let len = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..].iter().position(|&c| c == b'\'').map(|p| p + 3)
                } else {
                    let ch = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + ch) == Some(&b'\'')).then_some(ch + 2)
                };
                match len {
                    Some(n) => {
                        flush(&mut out, copy_from, i);
                        out.push_str("' '");
                        i += n;
                        copy_from = i;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    flush(&mut out, copy_from, b.len().min(text.len()));
    out
}

/// `Some(number of #)` if `b` (just after an `r`) opens a raw string: `"` or `#…#"`.
fn raw_string_hashes(b: &[u8]) -> Option<usize> {
    let n = b.iter().take_while(|&&c| c == b'#').count();
    (b.get(n) == Some(&b'"')).then_some(n)
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn boundary_before(s: &str, at: usize) -> bool {
    !s[..at].chars().next_back().is_some_and(is_ident)
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn ident(s: &str) -> String {
    let first_ok = s
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_');
    if !first_ok {
        return String::new();
    }
    s.chars().take_while(|c| is_ident(*c)).collect()
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

/// The layers as `modgraph` prints them and `docs/architecture.md` shows them: one line per
/// layer, `layer N: a b c`.
pub fn layer_lines(g: &Graph) -> Vec<String> {
    layers(g)
        .iter()
        .enumerate()
        .map(|(i, layer)| format!("layer {i}: {}", layer.join(" ")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uses_of(module: &[&str], text: &str) -> Vec<Written> {
        parse(module.iter().map(|s| s.to_string()).collect(), text).uses
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn paths_groups_comments_strings_and_tests() {
        let text = "use crate::a::X;\nuse crate::{b::Y, c, d::{e, f}};\n// crate::g\n/* crate::h */ let x = crate::i::f();\nlet s = \"crate::s {\"; let c = '{';\n$crate::j\nother_crate::k\n#[cfg(test)]\n#[allow(x)]\nmod tests { fn t() { let _ = crate::l::m(); } }\nfn after() { crate::n::o(); }\n";
        let firsts: Vec<String> = uses_of(&["m"], text)
            .into_iter()
            .map(|(base, segs)| {
                assert!(base.is_empty());
                segs[0].clone()
            })
            .collect();
        assert_eq!(firsts, ["a", "b", "c", "d", "d", "i", "n"]);
    }

    #[test]
    fn super_self_and_children_are_read_from_where_they_are_written() {
        let u = uses_of(
            &["io", "read"],
            "use super::Volume;\nuse super::super::state::Inner;\nfn f() { self::g(); }\n",
        );
        assert_eq!(u[0], (strs(&["io"]), strs(&["Volume"])));
        assert_eq!(u[1], (strs(&[]), strs(&["state", "Inner"])));
        assert_eq!(u[2], (strs(&["io", "read"]), strs(&["g"])));
        let u = uses_of(
            &["io"],
            "mod read;\nmod plan;\nuse read::Hit;\nfn f() { plan::go(); x::read::y(); }\n",
        );
        assert_eq!(
            u,
            [
                (strs(&["io"]), strs(&["read", "Hit"])),
                (strs(&["io"]), strs(&["plan", "go"]))
            ]
        );
    }

    #[test]
    fn a_crate_resolves_through_reexports_per_file() {
        let dir = tempfile_dir();
        let w = |rel: &str, text: &str| {
            let p = dir.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        w(
            "lib.rs",
            "mod io;\nmod policy;\nmod state;\n#[cfg(test)]\nmod budget;\npub use io::Volume;\n",
        );
        w(
            "io/mod.rs",
            "mod read;\nmod plan;\npub use read::Hit;\nuse plan::Q;\npub struct Volume;\nfn f() { plan::p(); }\n",
        );
        w(
            "io/read.rs",
            "use super::Volume;\nuse super::Q;\npub struct Hit;\n",
        );
        w("io/plan.rs", "use crate::state::S;\npub struct Q;\n");
        w(
            "state.rs",
            "pub struct S;\nfn g() -> crate::Volume { todo!() }\nuse crate::policy::Order;\n",
        );
        w("budget.rs", "use crate::io::Hit;\n");
        w("policy/mod.rs", "mod order;\npub use order::*;\n");
        w("policy/order.rs", "pub struct Order;\n");
        let g = read_crate(&dir).unwrap();
        let e = |m: &str| g.edges[m].iter().cloned().collect::<Vec<_>>();
        assert_eq!(
            g.edges.keys().collect::<Vec<_>>(),
            [
                "io",
                "io::plan",
                "io::read",
                "policy",
                "policy::order",
                "state"
            ]
        );
        assert_eq!(e("io"), ["io::plan"]); // the re-export of read::Hit is no edge
        assert_eq!(e("io::read"), ["io", "io::plan"]); // super::Q, privately imported by io
        assert_eq!(e("io::plan"), ["state"]);
        // crate::Volume, re-exported by the root from io; Order through policy's glob.
        assert_eq!(e("state"), ["io", "policy::order"]);
        assert_eq!(cycles(&g), [strs(&["io", "io::plan", "state"])]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("modgraph-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
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
        assert_eq!(layer_lines(&g), ["layer 0: c", "layer 1: b", "layer 2: a"]);
        edge(&mut g, "c", "a");
        edge(&mut g, "d", "a");
        assert_eq!(cycles(&g), [vec!["a", "b", "c"]]);
    }
}
