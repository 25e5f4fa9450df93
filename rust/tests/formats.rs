//! Reading and writing graph and schedule files: bad input is an error, never a panic.

use proptest::prelude::*;
use remat::{simulate, Error, Graph, Op, Schedule};
use serde_json::{json, Value as Json};

/// x (input) → mm → a (activation, 16 B) → view → v (alias of a, forward output);
/// backward: mm_bw(t, a) → g (grad output).
fn valid() -> Json {
    json!({
        "schema": "remat.graph", "version": 1, "name": "tiny",
        "values": [
            {"id": 0, "name": "x", "bytes": 64, "kind": "input", "alias_of": null},
            {"id": 1, "name": "a", "bytes": 16, "kind": "activation", "alias_of": null},
            {"id": 2, "name": "v", "bytes": 0, "kind": "activation", "alias_of": 1},
            {"id": 3, "name": "t", "bytes": 16, "kind": "tangent", "alias_of": null},
            {"id": 4, "name": "g", "bytes": 64, "kind": "activation", "alias_of": null}
        ],
        "nodes": [
            {"id": 0, "name": "mm", "target": "aten.mm.default", "phase": "forward",
             "inputs": [0], "outputs": [1], "time": 1e-5, "temp_bytes": 0, "random": false},
            {"id": 1, "name": "view", "target": "aten.view.default", "phase": "forward",
             "inputs": [1], "outputs": [2], "time": 0.0, "temp_bytes": 0, "random": false},
            {"id": 2, "name": "mm_bw", "target": "aten.mm.default", "phase": "backward",
             "inputs": [3, 1], "outputs": [4], "time": 2e-5, "temp_bytes": 8, "random": false}
        ],
        "outputs": [{"value": 2, "kind": "forward"}, {"value": 4, "kind": "grad"}]
    })
}

fn graph_error(mutate: impl FnOnce(&mut Json)) -> String {
    let mut doc = valid();
    mutate(&mut doc);
    match Graph::from_json(&doc.to_string()) {
        Err(Error::Graph(msg)) => msg,
        other => panic!("expected a graph error, got {other:?}"),
    }
}

#[test]
fn a_valid_graph_round_trips() {
    let g = Graph::from_json(&valid().to_string()).unwrap();
    assert_eq!(g.name(), "tiny");
    assert_eq!(g.storage_owner(2), 1);
    assert_eq!(g.producer(1), Some(0));
    assert_eq!(g.users(1), &[1, 2]);
    assert!(g.is_alias_node(1) && !g.is_alias_node(0));
    assert_eq!(Graph::from_json(&g.to_json()).unwrap(), g);
    assert_eq!(g.to_petgraph().edge_count(), 2);
}

#[test]
fn malformed_text_and_headers_are_graph_errors() {
    assert!(matches!(
        Graph::from_json("{not json"),
        Err(Error::Graph(_))
    ));
    assert!(matches!(Graph::from_json("[]"), Err(Error::Graph(_))));
    assert!(graph_error(|d| d["version"] = json!(2)).contains("version"));
    assert!(graph_error(|d| d["schema"] = json!("remat.schedule")).contains("schema"));
    assert!(graph_error(|d| d["nodes"][0]["phase"] = json!("sideways")).contains("bad field"));
    assert!(graph_error(|d| d["values"][0]["bytes"] = json!(-1)).contains("bad field"));
}

#[test]
fn dangling_and_misordered_ids_are_graph_errors() {
    assert!(graph_error(|d| d["values"][1]["id"] = json!(7)).contains("ids must be 0..n"));
    assert!(graph_error(|d| d["nodes"][1]["id"] = json!(0)).contains("ids must be 0..n"));
    assert!(graph_error(|d| d["nodes"][0]["inputs"] = json!([99])).contains("unknown value 99"));
    assert!(graph_error(|d| d["nodes"][0]["outputs"] = json!([1, 99])).contains("unknown value 99"));
    assert!(graph_error(|d| d["outputs"][0]["value"] = json!(99)).contains("unknown value 99"));
    assert!(graph_error(|d| d["values"][2]["alias_of"] = json!(99)).contains("unknown value 99"));
}

#[test]
fn broken_dataflow_is_a_graph_error() {
    let msg = graph_error(|d| d["nodes"][0]["inputs"] = json!([1]));
    assert!(msg.contains("before any node produces it"), "{msg}");
    let msg = graph_error(|d| d["nodes"][1]["outputs"] = json!([1]));
    assert!(msg.contains("produced twice"), "{msg}");
    let msg = graph_error(|d| d["nodes"][2]["outputs"] = json!([]));
    assert!(msg.contains("produced by no node"), "{msg}");
    let msg = graph_error(|d| d["nodes"][0]["inputs"] = json!([3]));
    assert!(msg.contains("uses tangent"), "{msg}");
    let msg = graph_error(|d| d["nodes"][0]["phase"] = json!("backward"));
    assert!(msg.contains("comes after a backward node"), "{msg}");
    let msg = graph_error(|d| d["nodes"][0]["inputs"] = json!([0, 0]));
    assert!(msg.contains("twice"), "{msg}");
    let msg = graph_error(|d| d["outputs"][1]["kind"] = json!("forward"));
    assert!(msg.contains("does not exist in the forward phase"), "{msg}");
}

#[test]
fn bad_aliases_and_times_are_graph_errors() {
    assert!(graph_error(|d| d["values"][2]["bytes"] = json!(4)).contains("must be 0"));
    let msg = graph_error(|d| {
        d["values"][4]["alias_of"] = json!(2);
        d["values"][4]["bytes"] = json!(0);
    });
    assert!(msg.contains("not a storage owner"), "{msg}");
    assert!(graph_error(|d| d["nodes"][0]["time"] = json!(-1.0)).contains("finite and >= 0"));
}

#[test]
fn schedules_use_the_documented_op_format() {
    let schedule = Schedule::new(vec![Op::Compute { node: 0 }], vec![Op::Free { value: 1 }]);
    let text = schedule.to_json();
    assert!(text.contains(r#"{"op":"compute","node":0}"#), "{text}");
    assert!(text.contains(r#"{"op":"free","value":1}"#), "{text}");
    assert!(
        text.contains(r#""schema":"remat.schedule","version":1"#),
        "{text}"
    );
    assert_eq!(Schedule::from_json(&text).unwrap(), schedule);
}

#[test]
fn bad_schedules_are_schedule_errors() {
    assert!(matches!(
        Schedule::from_json("nope"),
        Err(Error::Schedule(_))
    ));
    let wrong_version =
        r#"{"schema": "remat.schedule", "version": 3, "forward": [], "backward": []}"#;
    assert!(
        matches!(Schedule::from_json(wrong_version), Err(Error::Schedule(m)) if m.contains("version"))
    );
    let bad_op = r#"{"schema": "remat.schedule", "version": 1, "forward": [{"op": "jump"}], "backward": []}"#;
    assert!(matches!(
        Schedule::from_json(bad_op),
        Err(Error::Schedule(_))
    ));
    let g = Graph::from_json(&valid().to_string()).unwrap();
    let dangling = Schedule::new(
        vec![Op::Compute { node: 0 }, Op::Free { value: 42 }],
        vec![],
    );
    assert!(
        matches!(simulate(&g, &dangling), Err(Error::Schedule(m)) if m.contains("unknown value 42"))
    );
}

#[test]
fn a_planned_schedule_of_the_example_is_valid_json_for_python() {
    let g = Graph::from_json(&valid().to_string()).unwrap();
    let schedule = remat::plan(&g, u64::MAX, &Default::default()).unwrap();
    let doc: Json = serde_json::from_str(&schedule.to_json()).unwrap();
    assert_eq!(doc["solver"]["status"], "optimal");
    assert_eq!(doc["solver"]["name"], "rockmate");
    // The 64-byte gradient becomes `.grad`: not activation memory.
    assert_eq!(doc["predicted"]["peak_bytes"], 16 + 16 + 8);
    assert_eq!(
        doc["forward"],
        json!([{"op": "compute", "node": 0}, {"op": "compute", "node": 1}])
    );
}

/// Every integer field of the example, by JSON pointer.
const INT_FIELDS: &[&str] = &[
    "/values/1/alias_of",
    "/values/2/alias_of",
    "/values/4/alias_of",
    "/values/2/bytes",
    "/nodes/0/inputs/0",
    "/nodes/0/outputs/0",
    "/nodes/1/inputs/0",
    "/nodes/1/outputs/0",
    "/nodes/2/inputs/0",
    "/nodes/2/inputs/1",
    "/nodes/2/outputs/0",
    "/outputs/0/value",
    "/outputs/1/value",
    "/values/3/id",
    "/nodes/2/id",
];

proptest! {
    /// Whatever ids a file holds, reading it never panics, and a graph that reads plans.
    #[test]
    fn rewired_graphs_never_panic(edits in prop::collection::vec((0..INT_FIELDS.len(), 0u64..6), 1..4)) {
        let mut doc = valid();
        for (field, value) in edits {
            *doc.pointer_mut(INT_FIELDS[field]).unwrap() = json!(value);
        }
        if let Ok(g) = Graph::from_json(&doc.to_string()) {
            let (lo, hi) = remat::budget_range(&g).unwrap();
            prop_assert!(lo <= hi);
            remat::plan(&g, lo, &Default::default()).unwrap();
        }
    }
}
