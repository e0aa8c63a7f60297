//! No function in `crates/*/src` is longer than a screenful or two: every non-test `fn` whose
//! body spans more than [`MAX_LINES`] lines (from the line of `fn` to the line of its closing
//! brace) fails this test, named by file, name and line (issue 36, "smaller rooms").
//!
//! Invariants: the source is read as `modgraph` reads it (`modgraph::code`: comments and the
//! contents of literals left out; `modgraph::strip_tests`: `#[cfg(test)]` modules left out,
//! lines kept), so braces in literals and comments are not counted; a `fn` without a body (a
//! trait method's declaration) is not a function here; nested functions and closures count
//! within their enclosing function and are checked on their own too. Only [`ALLOWED`] may be longer, and an entry that no longer needs to be there fails the
//! test as well, so the list only shrinks.

use std::path::{Path, PathBuf};

/// Longest a function may be, in lines.
const MAX_LINES: usize = 150;

/// Functions allowed to be longer, by path (from the workspace root) and name: none. An
/// entry needs a reason written beside it, and goes once the function is split.
const ALLOWED: &[(&str, &str)] = &[];

/// A function longer than allowed: its name, the line its `fn` is on, its length in lines.
#[derive(Debug, PartialEq, Eq)]
struct Long {
    name: String,
    line: usize,
    lines: usize,
}

/// The index of the brace closing the one at `open` (or the end when it is not closed).
fn matching_brace(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, &c) in code.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Where the body of the function whose signature starts at `from` opens, if it has one.
fn body_start(code: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &c) in code.iter().enumerate().skip(from) {
        match c {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            b'{' if depth == 0 => return Some(k),
            b';' if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

/// The functions of `src` (outside `#[cfg(test)]` modules) longer than `max` lines.
fn long_functions(src: &str, max: usize) -> Vec<Long> {
    let (code, _) = modgraph::strip_tests(&modgraph::code(src));
    let code = code.as_bytes();
    let line_of = |at: usize| code[..at].iter().filter(|&&c| c == b'\n').count() + 1;
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut long = Vec::new();
    let mut i = 0;
    while let Some(n) = code[i..].windows(2).position(|w| w == b"fn") {
        let at = i + n;
        i = at + 2;
        let word_start = at == 0 || !is_ident(code[at - 1]);
        let followed = code.get(at + 2).is_some_and(|c| c.is_ascii_whitespace());
        if !word_start || !followed {
            continue;
        }
        let name: String = code[at + 2..]
            .iter()
            .skip_while(|c| c.is_ascii_whitespace())
            .take_while(|&&c| is_ident(c))
            .map(|&c| c as char)
            .collect();
        if name.is_empty() {
            continue; // `fn(u8) -> u8`, a function pointer type
        }
        // The body: the first `{` outside brackets, unless a `;` outside them comes first (a
        // declaration without a body; `[u8; 4]` in the signature is no end).
        let Some(open) = body_start(code, i) else {
            continue;
        };
        let close = matching_brace(code, open);
        let lines = line_of(close.min(code.len().saturating_sub(1))) - line_of(at) + 1;
        if lines > max {
            long.push(Long {
                name,
                line: line_of(at),
                lines,
            });
        }
    }
    long
}

/// Every `crates/*/src/**/*.rs` of the workspace, by path from its root.
fn sources(root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for krate in std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .flatten()
    {
        walk(&krate.path().join("src"), &mut out);
    }
    out.sort();
    out
}

#[test]
fn no_function_is_longer_than_the_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let files = sources(&root);
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut failures = Vec::new();
    let mut allowed_seen = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let src = std::fs::read_to_string(f).unwrap();
        for l in long_functions(&src, MAX_LINES) {
            if ALLOWED.contains(&(rel.as_str(), l.name.as_str())) {
                allowed_seen.push((rel.clone(), l.name));
                continue;
            }
            failures.push(format!(
                "{rel}:{}: fn {} is {} lines (at most {MAX_LINES}: name its parts)",
                l.line, l.name, l.lines
            ));
        }
    }
    for (path, name) in ALLOWED {
        if !allowed_seen.iter().any(|(p, n)| p == path && n == name) {
            failures.push(format!(
                "{path}: fn {name} is allowed to be long but is not (any more): take it off ALLOWED"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A source with `n` lines from `fn` to its closing brace.
fn function_of(name: &str, n: usize) -> String {
    let mut s = format!("fn {name}() {{\n");
    for k in 0..n - 2 {
        s.push_str(&format!("    let _x{k} = {k};\n"));
    }
    s.push_str("}\n");
    s
}

#[test]
fn a_function_of_151_lines_fails_and_150_passes() {
    let src = format!(
        "{}\n{}",
        function_of("short", 150),
        function_of("long", 151)
    );
    assert_eq!(
        long_functions(&src, MAX_LINES),
        vec![Long {
            name: "long".into(),
            line: 152,
            lines: 151
        }]
    );
}

#[test]
fn test_modules_are_skipped_and_literals_and_comments_do_not_count() {
    let test_mod = format!(
        "#[cfg(test)]\nmod tests {{\n    use super::*;\n{}}}\n",
        function_of("in_tests", 200)
    );
    // Braces in literals and comments would end `tricky` early (or late) if counted.
    let mut tricky = String::from(
        "fn tricky() {\n    let a = \"}}}\";\n    let b = '}';\n    let c = r#\"{\"#;\n    \
         // }\n    /* { /* } */ } */\n    let d = b'{';\n",
    );
    for k in 0..160 {
        tricky.push_str(&format!("    let _y{k} = {k};\n"));
    }
    tricky.push_str("}\nfn after<'a>(x: &'a str) -> &'a str {\n    x\n}\n");
    let src = format!("{test_mod}{tricky}trait T {{\n    fn declared(&self);\n}}\n");
    let long = long_functions(&src, MAX_LINES);
    assert_eq!(long.len(), 1, "{long:?}");
    assert_eq!(long[0].name, "tricky");
    assert_eq!(long[0].lines, 168);
}
