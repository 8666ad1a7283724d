//! ARCHITECTURE.md's "A token's path": at most seven files, each existing, entering at a
//! function it defines and calling the function the next step enters at, so the list
//! stays true as the code moves.

use std::path::Path;

struct Step {
    file: String,
    enters: String,
    calls: Option<String>,
}

/// The backticked words of `s`, in order.
fn ticked(s: &str) -> Vec<&str> {
    s.split('`').skip(1).step_by(2).collect()
}

fn steps(doc: &str) -> Vec<Step> {
    let from = doc.find("## A token's path").expect("ARCHITECTURE.md has a token's path");
    let section = &doc[from..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    // Numbered items, with their continuation lines.
    let mut items: Vec<String> = Vec::new();
    for line in section.lines() {
        let t = line.trim_start();
        if t.split_once(". ").is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())) {
            items.push(t.to_string());
        } else if line.starts_with("   ") && !items.is_empty() {
            items.last_mut().unwrap().push_str(line);
        } else if t.is_empty() && !items.is_empty() {
            break;
        }
    }
    items
        .iter()
        .map(|item| {
            let file = ticked(item).first().expect("a step names its file").to_string();
            let (_, links) = item.split_once("(enters ").unwrap_or_else(|| panic!("no `(enters ...)` in {item}"));
            let links = &links[..links.find(')').expect("closing parenthesis")];
            let names = ticked(links);
            Step {
                file,
                enters: names[0].to_string(),
                calls: links.contains("calls").then(|| names.last().unwrap().to_string()),
            }
        })
        .collect()
}

#[test]
fn the_token_path_is_at_most_seven_files_and_true() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let steps = steps(&doc);
    assert!((2..=7).contains(&steps.len()), "{} steps", steps.len());
    for (i, s) in steps.iter().enumerate() {
        let src =
            std::fs::read_to_string(root.join(&s.file)).unwrap_or_else(|e| panic!("step {}: {}: {e}", i + 1, s.file));
        assert!(src.contains(&format!("fn {}(", s.enters)), "step {}: {} defines no `fn {}`", i + 1, s.file, s.enters);
        match (&s.calls, steps.get(i + 1)) {
            (Some(c), Some(next)) => {
                assert!(src.contains(&format!("{c}(")), "step {}: {} never calls `{c}`", i + 1, s.file);
                assert_eq!(c, &next.enters, "step {} calls what step {} enters at", i + 1, i + 2);
            }
            (None, None) => {}
            (c, _) => panic!(
                "step {}: calls {c:?}, but the path {} there",
                i + 1,
                if c.is_some() { "ends" } else { "goes on" }
            ),
        }
    }
    assert!(steps.last().unwrap().file.ends_with("strata-storage/src/io.rs"), "the path ends at the expert read");
}
