//! Every crate of the workspace imports its files one way: no file refers, through any
//! chain of paths or imports, back to itself. A new cycle fails here, naming its files; see
//! `cargo run -p modgraph` for the whole graph and its layers.

use std::path::PathBuf;

#[test]
fn no_crate_has_an_import_cycle() {
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = Vec::new();
    let mut found = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|d| d.join("src").is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let g = modgraph::read_crate(&dir.join("src")).unwrap();
        for c in modgraph::cycles(&g) {
            found.push(format!("{name}: {}", c.join(" <-> ")));
        }
        checked.push(format!("{name} ({} modules)", g.edges.len()));
    }
    assert!(
        checked.iter().any(|c| c.starts_with("engine (")),
        "the engine was not found among {checked:?}"
    );
    assert!(found.is_empty(), "import cycles: {found:#?}");
    eprintln!("no import cycle in {}", checked.join(", "));
}
