//! `docs/architecture.md` shows the engine's layers as `modgraph` computes them: the block
//! under "## The engine's modules" is the tool's output for `crates/engine`, line for line. A
//! change that moves a file to another layer fails here with the block to paste.

use std::path::PathBuf;

#[test]
fn the_architecture_docs_layer_list_is_the_tools_output() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let g = modgraph::read_crate(&root.join("crates/engine/src")).unwrap();
    let want = modgraph::layer_lines(&g);
    assert!(want.len() > 3, "the engine's graph is too small: {want:?}");
    let section = doc
        .split("## The engine's modules")
        .nth(1)
        .expect("docs/architecture.md has a section \"## The engine's modules\"");
    let block = section
        .split("```")
        .nth(1)
        .expect("the section has a code block");
    let shown: Vec<&str> = block.lines().filter(|l| l.starts_with("layer ")).collect();
    assert!(
        shown == want,
        "docs/architecture.md's layer list is not `cargo run -p modgraph -- crates/engine`'s; \
         replace it with:\n{}",
        want.join("\n")
    );
}
