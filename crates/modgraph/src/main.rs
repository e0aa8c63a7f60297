//! `modgraph [CRATE_DIR ...]`: prints each crate's graph of files (what each file, named by
//! its module path, refers to), its layers (bottom first) and its import cycles. With no
//! argument, every crate under `crates/`. Exits 1 if any crate has a cycle.

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    let mut dirs: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if dirs.is_empty() {
        let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut all: Vec<PathBuf> = std::fs::read_dir(&crates)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        all.sort();
        dirs = all.into_iter().filter(|d| d.join("src").is_dir()).collect();
    }
    let mut any_cycle = false;
    for dir in dirs {
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let g = match modgraph::read_crate(&dir.join("src")) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("modgraph: {}: {e}", dir.display());
                return std::process::ExitCode::from(2);
            }
        };
        println!("# {name}");
        for (m, deps) in &g.edges {
            let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
            println!("{m} -> {}", deps.join(" "));
        }
        for line in modgraph::layer_lines(&g) {
            println!("{line}");
        }
        for c in modgraph::cycles(&g) {
            any_cycle = true;
            println!("CYCLE: {}", c.join(" <-> "));
        }
        println!();
    }
    if any_cycle {
        std::process::ExitCode::from(1)
    } else {
        std::process::ExitCode::SUCCESS
    }
}
