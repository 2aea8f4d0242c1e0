//! Checks of the code's shape that the compiler does not make.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The crate's top-level modules, each with the others it names (`crate::x`), outside its
/// tests and comments.
fn top_level_imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut imports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap();
            let top = relative.iter().next().unwrap().to_string_lossy();
            let top = top.trim_end_matches(".rs").to_string();
            if ["lib", "main", "architecture"].contains(&top.as_str()) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let named = imports.entry(top.clone()).or_default();
            named.extend(crate_paths(&text).into_iter().filter(|m| *m != top));
        }
    }
    imports
}

/// The first segment of each `crate::…` path in `text`, `crate::{a, b::c}` giving `a` and `b`,
/// from the code before its `#[cfg(test)]` and outside `//` comments.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let code: String = code
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            found.extend(group.split(',').filter_map(|item| first_ident(item.trim())));
        } else if let Some(name) = first_ident(rest) {
            found.insert(name);
        }
    }
    found
}

fn first_ident(s: &str) -> Option<String> {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (end > 0).then(|| s[..end].to_string())
}

/// A cycle in `graph`, as the path that closes it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit<'a>(
        node: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| *n == node) {
            let mut cycle: Vec<String> = path[start..].iter().map(|n| n.to_string()).collect();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if !done.insert(node) {
            return None;
        }
        path.push(node);
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// The top-level modules form layers: none reaches, through the others, back to itself.
/// A cycle makes modules that can only be read, tested and changed together.
#[test]
fn the_top_level_modules_import_no_cycle() {
    let graph = top_level_imports();
    assert!(graph.len() > 10, "found too few modules to check: {graph:?}");
    assert!(
        graph["dispatch"].contains("runtime"),
        "the scan misses imports: {graph:?}"
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!("the modules import each other in a cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn grouped_and_commented_paths_are_read_as_the_compiler_would() {
    let text = "use crate::{db::sessions, outbox};\n// crate::timers in a comment\nlet x = crate::kafka::X;\n\
                #[cfg(test)]\nmod tests { use crate::api; }";
    let found: Vec<String> = crate_paths(text).into_iter().collect();
    assert_eq!(found, ["db", "kafka", "outbox"]);
    let graph: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(a, b)| (a.to_string(), BTreeSet::from([b.to_string()])))
        .collect();
    assert_eq!(find_cycle(&graph).unwrap(), ["a", "b", "c", "a"]);
}
