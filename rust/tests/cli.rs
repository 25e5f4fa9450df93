//! `remat-plan`, the crate without Python: graph file in, schedule JSON out.

use std::process::Command;

fn remat_plan(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_remat-plan"))
        .args(args)
        .output()
        .expect("remat-plan runs")
}

const CNN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/rust/tests/graphs/cnn.json");

#[test]
fn plans_a_saved_graph_under_a_fractional_budget() {
    let out = remat_plan(&[CNN, "0.9"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let schedule: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let budget = schedule["solver"]["budget"].as_u64().unwrap();
    assert!(schedule["predicted"]["peak_bytes"].as_u64().unwrap() <= budget);
}

#[test]
fn an_infeasible_budget_names_the_smallest_one() {
    let out = remat_plan(&[CNN, "10"]);
    assert_eq!(out.status.code(), Some(2));
    let message = String::from_utf8_lossy(&out.stderr);
    assert!(message.contains("smallest feasible budget is"), "{message}");
}

#[test]
fn bad_arguments_print_the_usage() {
    for args in [
        &[][..],
        &[CNN][..],
        &[CNN, "1.5"][..],
        &["/no/such/file.json", "100"][..],
    ] {
        let out = remat_plan(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
}
